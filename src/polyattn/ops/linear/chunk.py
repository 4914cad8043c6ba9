"""Chunkwise causal linear attention: dense work inside chunks of C tokens, a K×V state between them.

The chunk math (inputs, summaries, outputs; exact decays and causal products) is the shared toolkit
``ops.chunked``; the states are carried chunk to chunk by ``common.carry_decayed``. Padding tokens
have k = v = 0 and g = 0, so they change neither outputs nor states.
"""

from __future__ import annotations

import torch

from polyattn.ops.chunked import chunk_inputs, chunk_outputs, chunk_summaries
from polyattn.ops.common import carry_decayed, heads_unchunk


def linear_attn_chunk(q, k, v, g=None, *, scale, initial_state=None, output_final_state=False, chunk_size=64):
    """Chunks in parallel, states carried chunk to chunk. Returns ``(o [B,T,H,V], final_state [B,H,K,V] | None)``."""
    T = q.shape[1]
    qc, kc, vc, gc = chunk_inputs(q, k, v, g, scale, min(chunk_size, T))  # no chunk wider than the sequence
    a, U = chunk_summaries(kc, vc, gc)
    after = carry_decayed(a, U, initial_state)  # [B, H, N, K, V]: the state after each chunk
    first = torch.zeros_like(U[:, :, :1]) if initial_state is None else initial_state.to(U.dtype)[:, :, None]
    before = torch.cat([first, after[:, :, :-1]], dim=2)  # [B, H, N, K, V]: the state entering each chunk
    o = chunk_outputs(qc, kc, vc, gc, before)
    return heads_unchunk(o, T).to(q.dtype), (after[:, :, -1] if output_final_state else None)
