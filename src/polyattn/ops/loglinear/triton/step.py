"""Fused one-token decoding step of log-linear Mamba-2 and Gated DeltaNet: the levels are updated in place.

`loglinear_step_kernel` implements `loglinear_attn_step` of ops/loglinear/recurrent.py for a batch
whose sequences sit at their own positions `t`:

    j = ctz(t);  S[j+1] += S[0] + … + S[j];  S[0..j] = 0      (t > 0: the Fenwick carry)
    S[l] <- exp(g) S[l]
    Mamba-2 (no beta):   S[0] = k vᵀ
    Gated DeltaNet:      S[l] <- S[l] − β k (kᵀ S[l]) for every l;  S[0] = β k vᵀ
    o = Σ_l lam[l] S[l]ᵀ (scale q)

on the shared step front (ops/triton/step.py): one program per (batch, head, value tile) walks the
L levels; the carry is a running sum in registers. The tile holds all K rows of its value columns, so
the delta rule's read `kᵀ S[l]` is complete in the program. A state at position 0 is empty (its levels
are ignored, and the step zeroes them). Only the levels the step can change are touched: a level that
holds no keys at position t (`state.occupied_levels`: level l >= 1 iff bit l - 1 of t - 1 is set) is
zero, stays zero under the decay and the transition, and adds nothing to the read, so it is neither
read nor written, except level ctz(t) + 1, which the carry fills. The step reads and writes the
occupied levels (1 + popcount(t - 1)) and the carry's target: at t = 2^k every level below k + 2,
on average over t about half of them.
"""
import torch
import triton
import triton.language as tl

from polyattn.ops.triton.plan import block
from polyattn.ops.triton.precision import dot_f32, to_output
from polyattn.ops.triton.step import step_tile


@triton.jit
def loglinear_step_kernel(
    q, k, v, g, beta, lam, pos, state, o, scale, H, K, V, L,
    BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, USE_BETA: tl.constexpr, F32: tl.constexpr,
):
    """One decoding step for one (batch, head, V tile); q, k: [B, H, K], v, o: [B, H, V],
    lam: [B, H, L], g, beta: [B, H] or None, pos: [B], state: [B, H, L, K, V] fp32."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    b_beta = 1.0
    if USE_BETA:
        b_beta = tl.load(beta + i_bh).to(tl.float32)
    t = tl.load(pos + i_bh // H)
    j = t * 0 - 1  # no carry at position 0
    if t > 0:
        j = t * 0
        while ((t >> j) & 1) == 0:
            j += 1
    o_v = i_v * BV + tl.arange(0, BV)
    b_o = tl.zeros([BV], dtype=tl.float32)
    b_acc = tl.zeros([BK, BV], dtype=tl.float32)
    last = tl.maximum(t - 1, 0)
    for lv in range(0, L):
        occupied = (t > 0) & ((lv == 0) | (((last >> tl.maximum(lv - 1, 0)) & 1) == 1))  # keys in level lv
        if occupied | (lv == j + 1) | (t == 0):  # else: zero before and after this step
            # step_tile addresses a [.., K, V] state by (batch * heads) index; shifting the base by
            # (i_bh * (L - 1) + lv) K V lands it on level lv of this (batch, head) in [B, H, L, K, V]
            base = state + (i_bh.to(tl.int64) * (L - 1) + lv) * K * V
            p_s, m_s, b_s, b_q, b_k, b_v = step_tile(q, k, v, g, base, scale, K, V, BK, BV, USE_G)
            if not occupied:  # the carry's target, or a level of an empty state: zero
                b_s = tl.zeros_like(b_s)
            if lv <= j:
                b_acc += b_s
                b_s = b_s * 0.0
            elif lv == j + 1:
                b_s += b_acc
            if USE_BETA:  # (I − β k kᵀ) S[l]: the read kᵀ S[l] over all K rows of the tile
                b_s -= (b_beta * b_k)[:, None] * tl.sum(b_k[:, None] * b_s, axis=0)[None, :]
            if lv == 0:
                b_s = (b_beta * b_k)[:, None] * b_v[None, :]  # [BK, 1] * [1, BV] -> [BK, BV]
            b_lam = tl.load(lam + i_bh * L + lv).to(tl.float32)
            b_o += b_lam * tl.sum(b_s * b_q[:, None], axis=0)
            tl.store(p_s, b_s, mask=m_s)
    tl.store(o + i_bh * V + o_v, to_output(b_o, o.dtype.element_ty, F32), mask=o_v < V)  # downcast: output dtype


def loglinear_attn_step_inplace(q, k, v, lam, g, levels, position, *, scale, beta=None):
    """One decoding step of log-linear Mamba-2 (`beta=None`) or Gated DeltaNet with `levels` updated
    in place (the arguments of `ops.loglinear.recurrent.loglinear_attn_step`, which returns a new state).

    q, k: [B, H, K]; v: [B, H, V]; lam: [B, H, L]; g, beta: [B, H] or None; levels: [B, H, L, K, V] fp32
    contiguous; position: [B] int64, each sequence's own (the caller guarantees `L >=
    num_levels(position + 1)`). Returns `(o [B, H, V] in q's dtype, levels)`.
    """
    B, H, K = q.shape
    V, L = v.shape[-1], lam.shape[-1]
    if levels.shape != (B, H, L, K, V) or levels.dtype != torch.float32 or not levels.is_contiguous():
        raise ValueError(f"expected contiguous fp32 levels of shape {(B, H, L, K, V)}, got {tuple(levels.shape)} {levels.dtype}")
    o = torch.empty(B, H, V, dtype=q.dtype, device=q.device)
    BV = min(block(V), max(16, 8192 // block(K)))  # [BK, BV] tiles of 8K fp32: 64 at K = 128, 17% faster than 32 on the H200
    loglinear_step_kernel[(triton.cdiv(V, BV), B * H)](
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous() if g is not None else None,
        beta.contiguous() if beta is not None else None, lam.contiguous(), position.contiguous(), levels, o, scale, H, K, V, L,
        BK=block(K), BV=BV, USE_G=g is not None, USE_BETA=beta is not None, F32=dot_f32(q.dtype), num_warps=4,
    )
    return o, levels
