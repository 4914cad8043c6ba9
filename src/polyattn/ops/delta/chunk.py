"""Chunkwise (gated) delta rule in the WY/UT form: one triangular solve per chunk, a K×V state between chunks.

Inside a chunk (local inclusive cumulative log-decay ``gc``, ``D = Γ ⊙ L``, unit-lower ``M`` of
:func:`polyattn.ops.chunked.delta_rule_system`) and with the state ``h`` entering it, equation (2) of
the naive spec splits into a state-free part, solved for all chunks at once, and a part linear in h::

    W  = M^{-1} diag(β) diag(exp(gc)) K,     Ū = M^{-1} diag(β) V                  (all chunks in parallel)
    U  = Ū - W h                                                                    (pseudo-values)
    O  = (scale Q K^T ⊙ D) U + diag(exp(gc)) (scale Q) h
    h' = exp(gc[C-1]) h + (K ⊙ exp(gs))^T U,          gs[j] = g[j+1] + ... + g[C-1] (suffix sums, no differences)

Padding tokens have k = v = 0, β = 0 and g = 0: they change neither outputs nor states.
"""

from __future__ import annotations

import torch

from polyattn.ops.chunked import delta_rule_system
from polyattn.ops.common import causal_matmul, causal_scores, heads_chunks, heads_unchunk, suffix_sum
from polyattn.ops.chunked import chunk_inputs


def delta_rule_chunk(q, k, v, beta, g=None, *, scale, initial_state=None, output_final_state=False, chunk_size=64):
    """Returns ``(o [B,T,H,V], final_state [B,H,K,V] | None)``."""
    T = q.shape[1]
    C = min(chunk_size, T)  # no chunk wider than the sequence
    qc, kc, vc, gl = chunk_inputs(q, k, v, g, scale, C)  # [B, H, N, C, D], g: [B, H, N, C]
    bc = heads_chunks(beta.to(qc.dtype), C)  # [B, T, H] -> [B, H, N, C]
    D, M = delta_rule_system(kc, bc, gl)  # [B, H, N, C, C] each
    gc = torch.cumsum(gl, dim=-1)  # [B, H, N, C]
    rhs = torch.cat([kc * torch.exp(gc)[..., None], vc], dim=-1) * bc[..., None]  # [B, H, N, C, K + V]
    sol = torch.linalg.solve_triangular(M, rhs, upper=False, unitriangular=True)  # [B, H, N, C, K + V]
    K = kc.shape[-1]
    W, Ubar = sol[..., :K], sol[..., K:]  # [B, H, N, C, K], [B, H, N, C, V]
    Kdec = kc * torch.exp(suffix_sum(gl))[..., None]  # [B, H, N, C, K]
    B, H, N = gc.shape[:3]
    state = (
        torch.zeros(B, H, K, vc.shape[-1], dtype=qc.dtype, device=qc.device)
        if initial_state is None
        else initial_state.to(qc.dtype)
    )
    before, pseudo = [], []
    for n in range(N):
        before.append(state)
        U = Ubar[:, :, n] - W[:, :, n] @ state  # [B, H, C, K] @ [B, H, K, V] -> [B, H, C, V]
        pseudo.append(U)
        state = torch.exp(gc[:, :, n, -1])[..., None, None] * state + Kdec[:, :, n].transpose(-1, -2) @ U
    h = torch.stack(before, dim=2)  # [B, H, N, K, V]
    U = torch.stack(pseudo, dim=2)  # [B, H, N, C, V]
    o = causal_matmul(causal_scores(qc @ kc.transpose(-1, -2), D), U)  # [B, H, N, C, C] @ [B, H, N, C, V] -> [B, H, N, C, V]
    o = o + torch.exp(gc)[..., None] * (qc @ h)  # [B, H, N, C, K] @ [B, H, N, K, V] -> [B, H, N, C, V]
    return heads_unchunk(o, T).to(q.dtype), (state if output_final_state else None)
