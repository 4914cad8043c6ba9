"""KATA's quadratic tiled form: the flash-style operating point (ops/kata/README.md, "Operating points and cost").

FlashAttention-2's tiling with exp and the running max removed: for each query tile i, loop over the
key tiles j <= i and accumulate ``Σ_s A[t, s] [v_s | 1]`` (numerator | normaliser) with scores
``A = κ(scale Q_i, K_j) ⊙ D_ij`` computed as sums of squared group dot products (``fmap.kernel``):
ψ is never built and nothing is carried along time. The decay between query t in tile i and key s in
an earlier tile j is assembled from in-tile segment sums,

    log D_ij[t, s] = (g_{s+1} + ... + g_end(j)) + Σ_{j<m<i} Γ_m + (g_start(i) + ... + g_t),

``Γ_m`` being tile m's total log-decay. Cost per head: O(T² K) score FLOPs (Mg: the same as one QKᵀ;
Σg: groups× that), O(T² V) for the outputs. ``initial_state`` is read once per query (a bilinear form)
and the final state, when asked for, is one write after the quadratic pass.
"""

from __future__ import annotations

import torch

from polyattn.ops.common import causal_matmul, causal_scores, exp_segsum, heads_unchunk, suffix_sum
from polyattn.ops.kata.chunk import prepare
from polyattn.ops.kata.state import join_state, normalized_read, split_state


def kata_parallel(
    q, k, v, g=None, *, feature="psd", groups=1, combine="concat", normalize=True, eps=1e-6, scale,
    initial_state=None, output_final_state=False, chunk_size=64,
):
    """Tiled quadratic KATA; ``chunk_size`` is the query/key tile size. Returns ``(o [B,T,H,V], KataState | None)``."""
    out_dtype, T = q.dtype, q.shape[1]
    fmap, dt, (qc, kc, vc, gc) = prepare(
        q, k, v, g, feature=feature, groups=groups, combine=combine, scale=scale, chunk_size=chunk_size
    )
    NC = qc.shape[2]
    head = torch.cumsum(gc, dim=-1)  # g_start(i) + ... + g_t: [B, H, NC, C]
    tail = suffix_sum(gc)  # g_{s+1} + ... + g_end(j): [B, H, NC, C]
    tile_decay = gc.sum(-1)  # Γ: [B, H, NC]
    state = join_state(initial_state, dt)  # [B, H, P, V + 1] or None
    outputs = []
    for i in range(NC):
        diagonal = causal_scores(fmap.kernel(qc[:, :, i], kc[:, :, i]), exp_segsum(gc[:, :, i]))  # [B, H, C, C]
        out = causal_matmul(diagonal, vc[:, :, i])  # diagonal tile: [B, H, C, C] @ [B, H, C, W] -> [B, H, C, W]
        between = torch.zeros_like(tile_decay[:, :, 0])  # Σ_{j<m<i} Γ_m: [B, H]
        for j in range(i - 1, -1, -1):
            log_decay = head[:, :, i, :, None] + between[..., None, None] + tail[:, :, j, None, :]  # [B, H, C, C]
            scores = fmap.kernel(qc[:, :, i], kc[:, :, j]) * torch.exp(log_decay)  # [B, H, C, C]
            out = out + scores @ vc[:, :, j]  # [B, H, C, C] @ [B, H, C, W] -> [B, H, C, W]
            between = between + tile_decay[:, :, j]
        if state is not None:
            out = out + torch.exp(head[:, :, i] + between[..., None])[..., None] * fmap.read(qc[:, :, i], state)
        outputs.append(out)
    out = heads_unchunk(torch.stack(outputs, dim=2), T)  # [B, H, NC, C, V + 1] -> [B, T, H, V + 1]
    o = normalized_read(out, normalize, eps).to(out_dtype)  # [B, T, H, V]
    if not output_final_state:
        return o, None
    total = tile_decay.sum(-1)  # [B, H]
    after = suffix_sum(tile_decay)  # Σ_{m>j} Γ_m: [B, H, NC]
    weight = torch.exp(tail + after[..., None])  # D[T, s]: [B, H, NC, C]
    final = fmap.write(kc.flatten(2, 3), (weight[..., None] * vc).flatten(2, 3))  # [B, H, NC*C, ...] -> [B, H, P, V + 1]
    if state is not None:
        final = final + torch.exp(total)[..., None, None] * state
    return o, split_state(final)
