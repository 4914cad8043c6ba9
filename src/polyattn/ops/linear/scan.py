"""Causal linear attention with chunk states from a log-depth associative scan.

Same chunk algebra as :mod:`polyattn.ops.linear.chunk`; the chunk-to-chunk recurrence
``h_n = exp(a_n) h_{n-1} + U_n`` is evaluated as an inclusive prefix scan of the summaries
``(a_n, U_n)`` under :func:`polyattn.ops.common.combine_decayed`, with the initial state as the
first element. Depth ``ceil(log2(N + 1))`` instead of N.
"""

from __future__ import annotations

import torch

from polyattn.ops.common import associative_scan, combine_decayed, heads_unchunk
from polyattn.ops.chunked import chunk_inputs, chunk_outputs, chunk_summaries


def linear_attn_scan(q, k, v, g=None, *, scale, initial_state=None, output_final_state=False, chunk_size=64):
    """Returns ``(o [B,T,H,V], final_state [B,H,K,V] | None)``."""
    T = q.shape[1]
    qc, kc, vc, gc = chunk_inputs(q, k, v, g, scale, min(chunk_size, T))  # no chunk wider than the sequence
    a, U = chunk_summaries(kc, vc, gc)
    B, H, N, K, V = U.shape
    h0 = torch.zeros(B, H, K, V, dtype=U.dtype, device=U.device) if initial_state is None else initial_state.to(U.dtype)
    a = torch.cat([torch.zeros_like(a[..., :1]), a], dim=-1)  # [B, H, N + 1]
    U = torch.cat([h0[:, :, None], U], dim=2)  # [B, H, N + 1, K, V]
    _, states = associative_scan(combine_decayed, (a, U), dim=2)  # states[:, :, n] = state after n chunks
    o = chunk_outputs(qc, kc, vc, gc, states[:, :, :N])
    return heads_unchunk(o, T).to(q.dtype), (states[:, :, N] if output_final_state else None)
