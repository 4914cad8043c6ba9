"""KATA and DeltaKATA, the executable spec, with ψ built explicitly (ops/kata/README.md).

KATA, for one head, with ``D[t, s] = exp(g[s+1] + ... + g[t])`` for ``s <= t`` (0 above the diagonal):

    A = (ψ(scale Q) ψ(K)ᵀ) ⊙ D,          A[t, s] = κ(scale q_t, k_s) D[t, s]                        (1)
    num_t = Σ_s A[t, s] v_s + exp(G_t) ψ(scale q_t)ᵀ S_0,   den_t = Σ_s A[t, s] + exp(G_t) ψ(scale q_t)·z_0  (2)
    o_t = num_t / max(den_t, eps)   (normalize=True),   o_t = num_t   (normalize=False)                (3)
    S_T = exp(G_T) S_0 + Σ_s D[T, s] ψ(k_s) v_sᵀ,   z_T = exp(G_T) z_0 + Σ_s D[T, s] ψ(k_s)             (4)

with ``G_t = g_1 + ... + g_t``. DeltaKATA: the gated delta rule on unit lifted keys
``ψ̂_t = ψ(k_t) / max(‖ψ(k_t)‖, eps)`` (‖ψ(k)‖² = κ(k, k)):

    S_t = exp(g_t) (I − β_t ψ̂_t ψ̂_tᵀ) S_{t−1} + β_t ψ̂_t v_tᵀ,   o_t = S_tᵀ ψ(scale q_t)               (5)
"""

from __future__ import annotations

import torch

from polyattn.ops.common import causal_matmul, causal_scores, compute_dtype, exp_segsum
from polyattn.ops.kata.feature_maps import make_feature_map
from polyattn.ops.kata.state import KataState


def kata_naive(
    q, k, v, g=None, *, feature="psd", groups=1, combine="concat", normalize=True, eps=1e-6, scale,
    initial_state=None, output_final_state=False,
):
    """Equations (1)–(4) with dense ``[T, T]`` scores. Returns ``(o [B,T,H,V], KataState | None)``."""
    out_dtype, dt = q.dtype, compute_dtype(q)
    B, T, H, K = q.shape
    fmap = make_feature_map(feature, K, groups, combine)
    q, k, v = (x.to(dt).transpose(1, 2) for x in (q, k, v))  # [B, T, H, D] -> [B, H, T, D]
    g = torch.zeros(B, H, T, dtype=dt, device=q.device) if g is None else g.to(dt).transpose(1, 2)  # [B, H, T]
    psi_q, psi_k = fmap.lift(scale * q), fmap.lift(k)  # [B, H, T, P]
    D = exp_segsum(g)  # [B, H, T, T]
    A = causal_scores(psi_q @ psi_k.transpose(-1, -2), D)  # [B, H, T, P] @ [B, H, P, T] -> [B, H, T, T]   (1)
    num, den = causal_matmul(A, v), A.sum(-1)  # [B, H, T, V], [B, H, T]
    S = psi_k.transpose(-1, -2) @ (D[..., -1, :, None] * v)  # [B, H, P, T] @ [B, H, T, V] -> [B, H, P, V]   (4)
    z = (psi_k.transpose(-1, -2) @ D[..., -1, :, None]).squeeze(-1)  # [B, H, P, T] @ [B, H, T, 1] -> [B, H, P]
    if initial_state is not None:
        S0, z0 = initial_state.S.to(dt), initial_state.z.to(dt)
        w = torch.exp(torch.cumsum(g, dim=-1))  # [B, H, T]: exp(G_t)
        num = num + w[..., None] * (psi_q @ S0)  # [B, H, T, P] @ [B, H, P, V] -> [B, H, T, V]   (2)
        den = den + w * (psi_q @ z0[..., None]).squeeze(-1)  # [B, H, T, P] @ [B, H, P, 1] -> [B, H, T]
        S = S + w[..., -1, None, None] * S0
        z = z + w[..., -1, None] * z0
    o = num / den.clamp_min(eps)[..., None] if normalize else num  # (3)
    o = o.transpose(1, 2).to(out_dtype)  # [B, H, T, V] -> [B, T, H, V]
    return o, (KataState(S, z) if output_final_state else None)


def deltakata_naive(
    q, k, v, beta, g=None, *, feature="psd", groups=1, combine="concat", eps=1e-6, scale,
    initial_state=None, output_final_state=False,
):
    """Equation (5), token by token on explicit lifted features. Returns ``(o [B,T,H,V], S [B,H,P,V] | None)``."""
    out_dtype, dt = q.dtype, compute_dtype(q)
    B, T, H, K = q.shape
    fmap = make_feature_map(feature, K, groups, combine)
    q, k, v, beta = (x.to(dt) for x in (q, k, v, beta))
    psi_q, psi_k = fmap.lift(scale * q), fmap.lift(k)  # [B, T, H, P]
    unit_k = psi_k / torch.linalg.vector_norm(psi_k, dim=-1, keepdim=True).clamp_min(eps)  # ψ̂: [B, T, H, P]
    P, V = psi_k.shape[-1], v.shape[-1]
    S = torch.zeros(B, H, P, V, dtype=dt, device=q.device) if initial_state is None else initial_state.to(dt)
    outputs = []
    for t in range(T):
        w, b = unit_k[:, t], beta[:, t, :, None, None]  # [B, H, P], [B, H, 1, 1]
        if g is not None:
            S = torch.exp(g[:, t].to(dt))[..., None, None] * S
        erase = w[..., :, None] * (w[..., None, :] @ S)  # [B, H, P, 1] * ([B, H, 1, P] @ [B, H, P, V]) -> [B, H, P, V]
        S = S - b * erase + b * w[..., :, None] * v[:, t, :, None, :]  # exp(g)(I − β ψ̂ψ̂ᵀ) S + β ψ̂ vᵀ
        outputs.append((psi_q[:, t, :, None, :] @ S).squeeze(-2))  # [B, H, 1, P] @ [B, H, P, V] -> [B, H, V]
    o = torch.stack(outputs, dim=1).to(out_dtype)  # T x [B, H, V] -> [B, T, H, V]
    return o, (S if output_final_state else None)
