"""Log-linear attention, the executable spec: a dense masked matrix.

The math is in ops/loglinear/README.md, "The mask and the two bases".

For one head and absolute positions ``P + t`` (``P`` = the initial state's position), with the Fenwick mask
``M^H[t, s] = lam[t, level(P + t, P + s)]`` for ``s <= t`` (0 above the diagonal)::

    O = (W ⊙ M^H) V                                                                              (1)

* ``beta=None`` (log-linear Mamba-2): ``W = (scale Q K^T) ⊙ exp(segsum g)``.
* ``beta`` given (log-linear Gated DeltaNet): ``W`` is the complete gated-delta-rule attention matrix,
  decay and delta-rule inverse included (:func:`polyattn.ops.delta.delta_rule_attention_matrix`); the mask
  multiplies W, never ``Q K^T`` before the inverse.

Every key is carried to a query by the same transition ``A_t = exp(g_t)(I - β_t k_t k_t^T)`` (``I`` scaled
by ``exp(g_t)`` without beta), ``W[t, s] = scale q_t^T A_t ⋯ A_{s+1} k_s β_s``. An initial state at position
``P`` holds level groups ``S0[l]`` of keys before ``P``; for query ``P + t`` group ``l`` lies in level
``max(l, level(P + t, P - 1))`` (the groups are nested, ops/loglinear/README.md, "Levels") and is read
through the query carried back to the start, ``q̃_t = (A_t ⋯ A_0)^T scale q_t``::

    q̃_t = exp(G_t) scale q_t - Σ_s W[t, s] exp(G_s) k_s      (G = cumsum g; no sum without beta)   (2)
    o_t += Σ_l lam[t, max(l, level(P + t, P - 1))] S0[l]^T q̃_t                                    (3)

The final state at position ``P + T`` holds, in level ``level(P + T - 1, P + s)``, the carried key
``F_s = A_{T-1} ⋯ A_{s+1} k_s β_s`` (row ``T - 1`` of W for the identity as query) times ``v_s^T``, and the
initial groups carried by ``A_{T-1} ⋯ A_0 = exp(G_{T-1}) I - Σ_s F_s exp(G_s) k_s^T``::

    S_final[l] = Σ_{s: level(P+T-1, P+s) = l} F_s v_s^T + Σ_{l': max(l', level(P+T-1, P-1)) = l} (A_{T-1} ⋯ A_0) S0[l']   (4)
"""

from __future__ import annotations

import torch

from polyattn.ops.common import causal_matmul, causal_scores, compute_dtype, exp_segsum, level, level_matrix, suffix_sum
from polyattn.ops.delta import delta_rule_attention_matrix
from polyattn.ops.chunked import delta_rule_system
from polyattn.ops.loglinear.state import LogLinearState, check_lam_levels, empty_batch, initial_levels, state_positions


def _level_of_previous(P: int, T: int) -> list[int]:
    """``level(P + t, P - 1)`` for ``t < T``: the level of the initial groups' most recent key (``P >= 1``)."""
    return [level(P + t, P - 1) for t in range(T)]


def loglinear_attn_naive(q, k, v, lam, g=None, *, beta=None, scale, initial_state=None, output_final_state=False):
    """Equations (1)–(4) with dense ``[T, T]`` matrices. Returns ``(o [B,T,H,V], LogLinearState | None)``."""
    out_dtype, dt = q.dtype, compute_dtype(q)
    B, T, H, K = q.shape
    V, L = v.shape[-1], lam.shape[-1]
    check_lam_levels(L, initial_state, T)
    positions = state_positions(initial_state, B)  # on the host: the level grid follows absolute positions
    if B == 0:
        return empty_batch(q, v, L, output_final_state)
    S0, position = initial_levels(initial_state, B, H, L, K, V, dt, q.device)  # [B, H, L, K, V], [B]
    q, k, v = (x.to(dt).transpose(1, 2) for x in (q, k, v))  # [B, T, H, D] -> [B, H, T, D]
    lam = lam.to(dt).permute(0, 2, 1, 3)  # [B, T, H, L] -> [B, H, T, L]
    g = torch.zeros(B, H, T, dtype=dt, device=q.device) if g is None else g.to(dt).transpose(1, 2)  # [B, H, T]
    G = torch.cumsum(g, dim=-1)  # [B, H, T]
    if beta is None:
        W = causal_scores(scale * (q @ k.transpose(-1, -2)), exp_segsum(g))  # [B, H, T, T]
    else:
        beta = beta.to(dt).transpose(1, 2)  # [B, T, H] -> [B, H, T]
        W = delta_rule_attention_matrix(q.transpose(1, 2), k.transpose(1, 2), beta.transpose(1, 2), g.transpose(1, 2), scale=scale)

    lev = torch.stack([level_matrix(T, offset=P, device=q.device) for P in positions])  # [B, T, T], -1 above
    lev = lev[:, None].expand(B, H, T, T)  # [B, H, T, T]
    mask = torch.gather(lam, -1, lev.clamp(min=0))  # [B, H, T, L] -> [B, H, T, T]: lam[t, level(t, s)]
    o = causal_matmul(causal_scores(W, mask), v)  # (1): [B, H, T, T] @ [B, H, T, V] -> [B, H, T, V]

    # the carried keys F (row T-1 of W for the identity as query) and the carry of the initial groups
    decay_to_end = torch.exp(suffix_sum(g))  # [B, H, T]: exp(g_{s+1} + ... + g_{T-1})
    if beta is None:
        F = (k * decay_to_end[..., None]).transpose(-1, -2)  # [B, H, K, T]
    else:
        _, M = delta_rule_system(k, beta, g)  # unit lower [B, H, T, T]
        # F = (K ⊙ decay)^T M^{-1} diag(β)  <=>  F^T = diag(β) M^{-T} (K ⊙ decay)
        Ft = torch.linalg.solve_triangular(M.transpose(-1, -2), k * decay_to_end[..., None], upper=True, unitriangular=True)
        F = (Ft * beta[..., None]).transpose(-1, -2)  # [B, H, K, T]
    lev_end = lev[:, :, -1]  # [B, H, T]: level(P + T - 1, P + s)
    onehot = (lev_end[..., None] == torch.arange(L, device=q.device)).to(dt)  # [B, H, T, L]
    final = torch.einsum("bhks,bhsv,bhsl->bhlkv", F, v, onehot)  # (4), keys of this call

    for b, P in enumerate(positions):
        if P == 0:
            continue
        qt = torch.exp(G[b])[..., None] * (scale * q[b])  # [H, T, K]
        if beta is not None:
            qt = qt - causal_matmul(W[b], torch.exp(G[b])[..., None] * k[b])  # (2): [H, T, T] @ [H, T, K] -> [H, T, K]
        previous = _level_of_previous(P, T)  # host ints
        m = torch.tensor(previous, device=q.device)  # [T]
        group_level = torch.maximum(torch.arange(L, device=q.device)[None, :], m[:, None])  # [T, L]
        lam_groups = torch.gather(lam[b], -1, group_level.expand(H, T, L))  # [H, T, L]
        reads = torch.einsum("htk,hlkv->htlv", qt, S0[b])  # [H, T, L, V]
        o[b] = o[b] + (lam_groups[..., None] * reads).sum(-2)  # (3)
        carry_all = torch.exp(G[b, :, -1])[:, None, None] * torch.eye(K, dtype=dt, device=q.device)  # [H, K, K]
        if beta is not None:
            carry_all = carry_all - F[b] @ (torch.exp(G[b])[..., None] * k[b])  # [H, K, T] @ [H, T, K] -> [H, K, K]
        carried = carry_all[:, None] @ S0[b]  # [H, 1, K, K] @ [H, L, K, V] -> [H, L, K, V]
        to_level = torch.clamp(torch.arange(L, device=q.device), min=previous[-1])  # [L]: max(l', level(P+T-1, P-1))
        final[b] = final[b].index_add(1, to_level, carried)  # (4), initial groups
    o = o.transpose(1, 2).to(out_dtype)  # [B, H, T, V] -> [B, T, H, V]
    if not output_final_state:
        return o, None
    return o, LogLinearState(final, position + T)
