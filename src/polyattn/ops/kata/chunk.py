"""KATA and DeltaKATA in chunks: linear state, ψ(q) never built (ops/kata/README.md, "Operating points and cost").

KATA, chunk c of size C, in-chunk inclusive log-decay cumsum γ_t, tile D = exp(segsum(g_c)), augmented
values ``[v | 1]`` and augmented state ``[S | z]`` (state.py), so one pass gives numerator and normaliser:

    intra:   O_c = (κ(scale Q_c, K_c) ⊙ D) [V_c | 1]               squared-score tile, C×C        (1)
    inter:   O_c += exp(γ_t) · ψ(scale q_t)ᵀ [S | z]_{c−1}         bilinear Σ_i q_iᵀ S_(i) q_i    (2)
    update:  [S | z]_c = exp(Γ_c) [S | z]_{c−1} + Σ_s D[C, s] ψ(k_s) [v_s | 1]ᵀ                    (3)

(1) and the chunk summaries (3, from a zero start) are computed for all chunks at once; ``kata_chunk``
then carries the state sequentially and ``kata_scan`` (scan.py) combines the summaries by a log-depth
associative scan. Per token: O(C·K) score FLOPs + O(C·V) for (1), O(P·V) for (2) and (3).

DeltaKATA, kernel-trick UT form (ops/kata/README.md, "Chunk form (kernel-trick UT)"): with unit lifted
keys ψ̂_s = ψ(k_s)/n_s, n_s = max(√κ(k_s, k_s), eps), the pseudo-values U of chunk c solve

    (I + diag(β) tril(κ̂(K, K) ⊙ D, −1)) U = diag(β) (V − diag(exp(γ)) ψ̂(K) S_{c−1})              (4)
    O_c = exp(γ) ⊙ ψ(scale Q) S_{c−1} + (κ(scale Q, K) ⊙ D ⊘ n) U                                   (5)
    S_c = exp(Γ_c) S_{c−1} + Σ_s D[C, s] ψ̂(k_s) u_sᵀ                                               (6)

with κ̂(k_t, k_s) = κ(k_t, k_s)/(n_t n_s); ψ̂(K) S is a bilinear read, the write (6) never builds ψ.
"""

from __future__ import annotations

import torch

from polyattn.ops.common import carry_decayed, causal_matmul, causal_scores, compute_dtype, exp_segsum, heads_chunks, heads_unchunk
from polyattn.ops.kata.feature_maps import make_feature_map
from polyattn.ops.kata.state import join_state, normalized_read, split_state, with_ones


def kata_chunk_summaries(fmap, q, k, v, g):
    """Per-chunk parts of (1) and (3) for ``q, k: [B,H,NC,C,K]``, ``v: [B,H,NC,C,W]``, ``g: [B,H,NC,C]``.

    Returns ``(intra [B,H,NC,C,W], local_state [B,H,NC,P,W], chunk_log_decay Γ [B,H,NC])``.
    """
    D = exp_segsum(g)  # [B, H, NC, C, C]
    intra = causal_matmul(causal_scores(fmap.kernel(q, k), D), v)  # [B, H, NC, C, C] @ [B, H, NC, C, W] -> [B, H, NC, C, W]   (1)
    local_state = fmap.write(k, D[..., -1, :, None] * v)  # [B, H, NC, P, W]: Σ_s D[C, s] ψ(k_s) v_sᵀ   (3)
    return intra, local_state, g.sum(-1)


def kata_chunk_read(fmap, q, g, intra, states_before):
    """(2): ``intra + exp(γ) ψ(q)ᵀ S_{c−1}`` with ``states_before: [B, H, NC, P, W]``; returns ``[B, H, NC, C, W]``."""
    gamma = torch.cumsum(g, dim=-1)  # [B, H, NC, C]
    return intra + torch.exp(gamma)[..., None] * fmap.read(q, states_before)  # [B, H, NC, C, W]


def prepare(q, k, v, g, *, feature, groups, combine, scale, chunk_size):
    """Shared front end of the chunked KATA forms: lift options, augmented values, chunked tensors."""
    dt = compute_dtype(q)
    B, T, H, K = q.shape
    fmap = make_feature_map(feature, K, groups, combine)
    g = torch.zeros(B, T, H, dtype=dt, device=q.device) if g is None else g.to(dt)
    v = with_ones(v.to(dt))  # [B, T, H, V + 1]; padding gives a zero ones-column, so padded tokens add nothing
    C = min(chunk_size, T)  # no chunk wider than the sequence
    chunks = tuple(heads_chunks(x, C) for x in (scale * q.to(dt), k.to(dt), v, g))  # [B, H, NC, C, ...]
    return fmap, dt, chunks


def kata_chunked(
    q, k, v, g, *, prefix, feature, groups, combine, normalize, eps, scale, initial_state, output_final_state, chunk_size,
):
    """(1)–(3) with the states before each chunk given by ``prefix`` (``common.carry_decayed`` or a log-depth scan).

    ``prefix(decays [B,H,NC+1], summaries [B,H,NC+1,P,W])`` gets the initial state as summary 0 (decay 0)
    and returns the inclusive prefix: entry c is the state before chunk c, entry NC the final state.
    """
    out_dtype, T = q.dtype, q.shape[1]
    fmap, dt, (qc, kc, vc, gc) = prepare(
        q, k, v, g, feature=feature, groups=groups, combine=combine, scale=scale, chunk_size=chunk_size
    )
    intra, local_state, chunk_decay = kata_chunk_summaries(fmap, qc, kc, vc, gc)
    state = join_state(initial_state, dt)
    if state is None:
        state = torch.zeros_like(local_state[:, :, 0])  # [B, H, P, V + 1]
    decays = torch.cat([torch.zeros_like(chunk_decay[:, :, :1]), chunk_decay], dim=2)  # [B, H, NC + 1]
    summaries = torch.cat([state[:, :, None], local_state], dim=2)  # [B, H, NC + 1, P, V + 1]
    states = prefix(decays, summaries)  # [B, H, NC + 1, P, V + 1]
    out = kata_chunk_read(fmap, qc, gc, intra, states[:, :, :-1])  # [B, H, NC, C, V + 1]
    o = normalized_read(heads_unchunk(out, T), normalize, eps).to(out_dtype)  # [B, T, H, V]
    return o, (split_state(states[:, :, -1]) if output_final_state else None)


def kata_chunk(
    q, k, v, g=None, *, feature="psd", groups=1, combine="concat", normalize=True, eps=1e-6, scale,
    initial_state=None, output_final_state=False, chunk_size=64,
):
    """(1)–(3) with the state carried chunk by chunk. Returns ``(o [B,T,H,V], KataState | None)``."""
    return kata_chunked(
        q, k, v, g, prefix=carry_decayed, feature=feature, groups=groups, combine=combine, normalize=normalize, eps=eps,
        scale=scale, initial_state=initial_state, output_final_state=output_final_state, chunk_size=chunk_size,
    )


def deltakata_chunk(
    q, k, v, beta, g=None, *, feature="psd", groups=1, combine="concat", eps=1e-6, scale,
    initial_state=None, output_final_state=False, chunk_size=64,
):
    """(4)–(6), state carried chunk by chunk. Returns ``(o [B,T,H,V], S [B,H,P,V] | None)``."""
    out_dtype, dt = q.dtype, compute_dtype(q)
    B, T, H, K = q.shape
    fmap = make_feature_map(feature, K, groups, combine)
    g = torch.zeros(B, T, H, dtype=dt, device=q.device) if g is None else g.to(dt)
    C = min(chunk_size, T)  # no chunk wider than the sequence
    qc, kc, vc, bc, gc = (heads_chunks(x, C) for x in (scale * q.to(dt), k.to(dt), v.to(dt), beta.to(dt), g))
    # padded tokens have beta = 0, so their pseudo-values are 0 and they write nothing
    self_kernel = fmap.kernel(kc[..., None, :], kc[..., None, :])[..., 0, 0]  # κ(k_s, k_s) = ‖ψ(k_s)‖²: [B, H, NC, C]
    norm = self_kernel.clamp_min(eps**2).sqrt()  # n_s = max(‖ψ(k_s)‖, eps), finite gradients at k_s = 0
    D = exp_segsum(gc)  # [B, H, NC, C, C]
    decay_q = torch.exp(torch.cumsum(gc, dim=-1))  # exp(γ_t): [B, H, NC, C]
    unit_gram = fmap.kernel(kc, kc) / (norm[..., :, None] * norm[..., None, :])  # κ̂(K, K): [B, H, NC, C, C]
    eye = torch.eye(C, dtype=dt, device=q.device)
    lower = eye + bc[..., :, None] * torch.tril(unit_gram * D, diagonal=-1)  # I + diag(β) tril(κ̂ ⊙ D, −1)
    scores = causal_scores(fmap.kernel(qc, kc) / norm[..., None, :], D)  # κ(scale Q, K) ⊙ D ⊘ n: [B, H, NC, C, C]
    write_weight = D[..., -1, :] / norm  # D[C, s] / n_s: [B, H, NC, C]
    P, V = fmap.dim(), v.shape[-1]
    state = torch.zeros(B, H, P, V, dtype=dt, device=q.device) if initial_state is None else initial_state.to(dt)
    outputs = []
    for c in range(qc.shape[2]):
        prev_read = fmap.read(kc[:, :, c], state) / norm[:, :, c, :, None]  # ψ̂(K) S_{c−1}: [B, H, C, V]
        rhs = bc[:, :, c, :, None] * (vc[:, :, c] - decay_q[:, :, c, :, None] * prev_read)  # [B, H, C, V]
        u = torch.linalg.solve_triangular(lower[:, :, c], rhs, upper=False, unitriangular=True)  # (4): [B, H, C, V]
        inter = decay_q[:, :, c, :, None] * fmap.read(qc[:, :, c], state)  # [B, H, C, V]
        outputs.append(inter + causal_matmul(scores[:, :, c], u))  # (5): [B, H, C, C] @ [B, H, C, V] -> [B, H, C, V]
        written = fmap.write(kc[:, :, c], write_weight[:, :, c, :, None] * u)  # Σ_s D[C, s] ψ̂(k_s) u_sᵀ: [B, H, P, V]
        state = torch.exp(gc[:, :, c].sum(-1))[..., None, None] * state + written  # (6)
    o = heads_unchunk(torch.stack(outputs, dim=2), T).to(out_dtype)  # [B, H, NC, C, V] -> [B, T, H, V]
    return o, (state if output_final_state else None)
