"""Chunkwise causal linear attention: dense work inside chunks of C tokens, a K×V state between them.

With chunk-local inclusive cumulative log-decays ``gc`` (``gc[i] = g[0] + ... + g[i]`` inside the chunk),
suffix sums ``gs`` (``gs[j] = g[j+1] + ... + g[C-1]``), the in-chunk segment sums ``segsum(g)[i, j] =
g[j+1] + ... + g[i]`` and the state ``h`` entering the chunk, for the chunk's rows::

    O   = ((scale Q) K^T ⊙ exp(segsum g) ⊙ [j <= i]) V  +  exp(gc) ⊙ (scale Q) h          (intra + inter)
    h'  = exp(a) h + U,   a = gc[C-1],   U = (K ⊙ exp(gs))^T V                              (summary (a, U))

Every decay is a direct sum of the log-decays it spans (never ``gc_i - gc_j``), so one huge or
infinite log-decay (``g = -inf``: an exact reset) leaves the rest exact; the causal mask is selected,
not multiplied, so a non-finite future token never reaches an earlier row (ops/README.md, Guarantees).

Padding tokens have k = v = 0 and g = 0, so they change neither outputs nor states.
"""

from __future__ import annotations

import torch

from polyattn.ops.common import (
    carry_decayed, causal_matmul, causal_scores, compute_dtype, exp_segsum, heads_chunks, heads_unchunk, suffix_sum,
)


def chunk_inputs(q, k, v, g, scale, C):
    """Pad to a multiple of C and reshape: ``q, k, v -> [B, H, N, C, D]``, ``g -> [B, H, N, C]`` (zeros if None)."""
    dt = compute_dtype(q)
    B, T, H, _ = q.shape
    if g is None:
        g = torch.zeros(B, T, H, dtype=dt, device=q.device)
    return tuple(heads_chunks(x.to(dt), C) for x in (q * scale, k, v, g))  # [B, T, H, *] -> [B, H, N, C, *]


def chunk_summaries(k, v, g):
    """Per-chunk ``(a [B,H,N], U [B,H,N,K,V])``: total log-decay and the state the chunk makes from zero."""
    a = g.sum(dim=-1)  # [B, H, N]
    U = (k * torch.exp(suffix_sum(g))[..., None]).transpose(-1, -2) @ v  # [B,H,N,K,C] @ [B,H,N,C,V] -> [B,H,N,K,V]
    return a, U


def chunk_outputs(q, k, v, g, states_before):
    """Outputs of every chunk given the state entering it: ``states_before: [B, H, N, K, V]`` -> ``[B, H, N, C, V]``."""
    gc = torch.cumsum(g, dim=-1)  # [B, H, N, C]
    A = causal_scores(q @ k.transpose(-1, -2), exp_segsum(g))  # [B, H, N, C, C]
    o = causal_matmul(A, v)  # [B, H, N, C, C] @ [B, H, N, C, V] -> [B, H, N, C, V]
    return o + torch.exp(gc)[..., None] * (q @ states_before)  # [B, H, N, C, K] @ [B, H, N, K, V] -> [B, H, N, C, V]


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
