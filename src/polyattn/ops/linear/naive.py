"""Causal linear attention with per-token log-decay: the executable spec (masked-matrix form).

For one head, with ``D[t, s] = exp(g[s+1] + ... + g[t])`` for ``s <= t`` (0 above the diagonal):

    O = ((scale Q) K^T ⊙ D) V + diag(exp(G)) (scale Q) h0,          G[t] = g[0] + ... + g[t]     (1)
    S_T = exp(G[T-1]) h0 + K^T diag(D[T-1, :]) V                                                 (2)

which is the recurrence ``S_t = exp(g_t) S_{t-1} + k_t v_t^T``, ``o_t = S_t^T (scale q_t)``, ``S_{-1} = h0``.
"""

from __future__ import annotations

import torch

from polyattn.ops.common import causal_matmul, causal_scores, compute_dtype, exp_segsum


def linear_attn_naive(q, k, v, g=None, *, scale, initial_state=None, output_final_state=False):
    """Equations (1)–(2) with dense ``[T, T]`` matrices. Returns ``(o [B,T,H,V], final_state [B,H,K,V] | None)``."""
    out_dtype, dt = q.dtype, compute_dtype(q)
    B, T, H, K = q.shape
    q, k, v = (x.to(dt).transpose(1, 2) for x in (q, k, v))  # [B, T, H, D] -> [B, H, T, D]
    q = q * scale
    g = torch.zeros(B, H, T, dtype=dt, device=q.device) if g is None else g.to(dt).transpose(1, 2)  # [B, H, T]
    D = exp_segsum(g)  # [B, H, T, T]
    A = causal_scores(q @ k.transpose(-1, -2), D)  # [B, H, T, K] @ [B, H, K, T] -> [B, H, T, T]
    o = causal_matmul(A, v)  # [B, H, T, T] @ [B, H, T, V] -> [B, H, T, V]
    final = k.transpose(-1, -2) @ (D[..., -1, :, None] * v)  # [B, H, K, T] @ [B, H, T, V] -> [B, H, K, V]
    if initial_state is not None:
        h0 = initial_state.to(dt)
        G = torch.cumsum(g, dim=-1)  # [B, H, T]
        o = o + torch.exp(G)[..., None] * (q @ h0)  # [B, H, T, K] @ [B, H, K, V] -> [B, H, T, V]
        final = final + torch.exp(G[..., -1])[..., None, None] * h0
    o = o.transpose(1, 2).to(out_dtype)  # [B, H, T, V] -> [B, T, H, V]
    return o, (final if output_final_state else None)
