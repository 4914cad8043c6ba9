"""The (gated) delta rule: the executable spec, as a dense attention matrix.

Recurrence (keys used as given, no normalisation inside)::

    S_t = exp(g_t) (I - β_t k_t k_t^T) S_{t-1} + β_t k_t v_t^T,        o_t = S_t^T (scale q_t)      (1)

Writing ``S_t = exp(G_t) h0 + Σ_{s<=t} Γ[t,s] k_s u_s^T`` with ``G`` the inclusive cumulative log-decay and
``Γ[t,s] = exp(G_t - G_s)`` turns (1) into a unit lower-triangular system for the pseudo-values u::

    (I + diag(β) (K K^T ⊙ Γ ⊙ L⁻)) U = diag(β) (V - diag(exp(G)) K h0)                               (2)
    O = (scale Q K^T ⊙ Γ ⊙ L) U + diag(exp(G)) (scale Q) h0                                          (3)
    S_T = exp(G_T) h0 + K^T diag(Γ[T-1, :]) U                                                         (4)

(L: causal mask with diagonal, L⁻: strictly below). With ``h0 = 0``, ``O = W V`` for the complete attention
matrix ``W = (scale Q K^T ⊙ Γ ⊙ L) (I + diag(β)(K K^T ⊙ Γ ⊙ L⁻))^{-1} diag(β)``.
"""

from __future__ import annotations

import torch

from polyattn.ops.chunked import delta_rule_system
from polyattn.ops.common import causal_matmul, causal_scores, compute_dtype


def delta_rule_attention_matrix(q, k, beta, g=None, *, scale):
    """The complete ``W [B, H, T, T]`` with ``O = W V`` (zero initial state): decay and delta inverse included."""
    dt = compute_dtype(q)
    q, k = (x.to(dt).transpose(1, 2) for x in (q, k))  # [B, T, H, K] -> [B, H, T, K]
    beta = beta.to(dt).transpose(1, 2)  # [B, H, T]
    g = torch.zeros_like(beta) if g is None else g.to(dt).transpose(1, 2)  # [B, H, T]
    D, M = delta_rule_system(k, beta, g)
    A = causal_scores(scale * (q @ k.transpose(-1, -2)), D)  # [B, H, T, T]
    # W = A M^{-1} diag(β), M^{-1} by forward substitution: row t of W sees rows <= t of M only
    eye = torch.eye(M.shape[-1], dtype=M.dtype, device=M.device)
    Minv = torch.linalg.solve_triangular(M, eye.expand_as(M), upper=False, unitriangular=True)  # [B, H, T, T]
    return causal_matmul(A, Minv) * beta[..., None, :]  # [B, H, T, T] @ [B, H, T, T] -> [B, H, T, T]


def delta_rule_naive(q, k, v, beta, g=None, *, scale, initial_state=None, output_final_state=False):
    """Equations (2)–(4). Returns ``(o [B,T,H,V], final_state [B,H,K,V] | None)``."""
    out_dtype, dt = q.dtype, compute_dtype(q)
    B, T, H, K = q.shape
    q, k, v = (x.to(dt).transpose(1, 2) for x in (q, k, v))  # [B, T, H, D] -> [B, H, T, D]
    q = q * scale
    beta = beta.to(dt).transpose(1, 2)  # [B, H, T]
    g = torch.zeros_like(beta) if g is None else g.to(dt).transpose(1, 2)  # [B, H, T]
    D, M = delta_rule_system(k, beta, g)
    G = torch.cumsum(g, dim=-1)  # [B, H, T]
    rhs = v
    if initial_state is not None:
        h0 = initial_state.to(dt)
        rhs = v - torch.exp(G)[..., None] * (k @ h0)  # [B, H, T, K] @ [B, H, K, V] -> [B, H, T, V]
    U = torch.linalg.solve_triangular(M, beta[..., None] * rhs, upper=False, unitriangular=True)  # [B, H, T, V]
    o = causal_matmul(causal_scores(q @ k.transpose(-1, -2), D), U)  # [B, H, T, T] @ [B, H, T, V] -> [B, H, T, V]
    final = k.transpose(-1, -2) @ (D[..., -1, :, None] * U)  # [B, H, K, T] @ [B, H, T, V] -> [B, H, K, V]
    if initial_state is not None:
        o = o + torch.exp(G)[..., None] * (q @ h0)
        final = final + torch.exp(G[..., -1])[..., None, None] * h0
    return o.transpose(1, 2).to(out_dtype), (final if output_final_state else None)  # -> [B, T, H, V]
