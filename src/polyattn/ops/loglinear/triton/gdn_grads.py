"""The chunk-local backward of log-linear Gated DeltaNet on Triton: the gradients that `gdn_levels_backward`
(gdn.py) leaves for q̃, W, Ū, K̃, Tinv and each chunk's total log-decay, with the block output's, taken through the
chunk-local stage (`gdn_chunk_locals`) to dq, dk, dv, dβ, dg and the in-chunk columns of dlam, every chunk in
parallel, in three kernels as the delta rule's backward is split:

    gdn_chunk_value_grads_kernel   the value side in [C, BV] tiles: dv, dlam, dβ's value part; dP diag(β), dŪ Z^T
    gdn_chunk_score_grads_kernel   the [C, C] gradients over key tiles: dA, dTinv, dM, dβ, dg; dS, dKK + dKK^T
    gdn_chunk_key_grads_kernel     dq, dk, a program per chunk, head and key tile

passing two `[NC, H, C, C]` fp32 tiles a chunk between them. Each has a launcher (`chunk_*_grads_stage`) and a
PyTorch twin (`chunk_value_grads`, `chunk_score_grads`, `chunk_key_grads`), chained by `gdn_chunk_backward` and
`gdn_chunk_locals_backward` (the vector-Jacobian product of `gdn_chunk_locals`).
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from polyattn.ops.common.segsum import suffix_sum
from polyattn.ops.delta.triton.forward import chunk_program, chunk_tile_program
from polyattn.ops.triton.decay import chunk_decay, chunk_segsum, chunk_suffix
from polyattn.ops.triton.plan import block, get_config
from polyattn.ops.triton.precision import dot_f32, fp32_dot_mode, mma, mma_fp32, mma_left_fp32, to_output

from .gdn import ChunkLocals, chunk_layout, chunk_parts, value_tile
from .level_pass import intra_levels


@triton.jit
def chunk_gram(q, k, t, m_t, H, i_h, K, GRAM: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr):
    """`(Q K^T, K K^T)` of one chunk's rows `t` ([C, C] fp32 each, the second zero unless GRAM), over [C, BK]
    key tiles."""
    b_s = tl.zeros([C, C], dtype=tl.float32)
    b_kk = tl.zeros([C, C], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        row_k = (t * H + i_h)[:, None] * K + o_k[None, :]  # [C, BK]
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        b_k = tl.load(k + row_k, mask=m_tk, other=0.0)  # [C, BK]
        b_s += mma(tl.load(q + row_k, mask=m_tk, other=0.0), tl.trans(b_k), F32)  # [C, BK] @ [BK, C]
        if GRAM:
            b_kk += mma(b_k, tl.trans(b_k), F32)  # [C, BK] @ [BK, C]
    return b_s, b_kk


@triton.jit
def gdn_chunk_value_grads_kernel(
    q, k, v, g, beta, lam, t_inv, do, du, chunks, dv, dbeta, dlam, dps, dts, scale, H, K, V, L,
    C: tl.constexpr, LOG_C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr,
    F32: tl.constexpr, FP32_DOT: tl.constexpr,
):
    """grid: (num_chunks, H). Stage 1 of the chunk-local backward (twin `chunk_value_grads`), the value side of
    one chunk in [C, BV] tiles, from `A = scale Q K^T ⊙ D`, the forward's Tinv and the cotangents of the block's
    output (`do`) and of Ū (`du`), with `P = A Tinv diag(β)`, `B = P ⊙ lam_in`, `Z = diag(β) V`:

        dB = lower(dO V^T),   dV = B^T dO + diag(β) Tinv^T dŪ,   dP = dB ⊙ lam_in,   dlam_in = dB ⊙ P

    It writes dv (input dtype), the in-chunk level columns of dlam, dbeta's value part
    `colsum(dP ⊙ A Tinv) + rowsum(Tinv^T dŪ ⊙ V)` and, for stage 2, `dP diag(β)` (`dps`) and `dŪ Z^T` (`dts`),
    [C, C] fp32 tiles (`[NC, H, C, C]`)."""
    i_ch, i_h, _, _, o_t, t, m_t = chunk_program(chunks, C)
    lower = o_t[:, None] >= o_t[None, :]
    b_s, _ = chunk_gram(q, k, t, m_t, H, i_h, K, False, C, BK, F32)  # [C, C]: Q K^T
    b_g, b_gc, b_last = chunk_decay(g, t, m_t, H, i_h, USE_G)  # [C], [C], scalar
    b_a = tl.where(lower, b_s * scale * tl.exp2(chunk_segsum(b_g, b_gc, b_last, False, F32)), 0.0)  # [C, C]: A
    b_beta = tl.load(beta + t * H + i_h, mask=m_t, other=0.0).to(tl.float32)  # [C]
    b_ti = tl.load(t_inv + (t * H + i_h)[:, None] * C + o_t[None, :], mask=m_t[:, None], other=0.0)  # [C, C] fp32
    b_at = mma_fp32(b_a, b_ti, k.dtype.element_ty, F32, FP32_DOT)  # [C, C] @ [C, C]: A Tinv
    b_p = b_at * b_beta[None, :]  # [C, C]: P
    lut = intra_levels(C, LOG_C, tl.load(chunks + i_ch * 4 + 2))  # [C, C]
    m_lam = m_t[:, None] & lower & (lut < L)
    b_lam = tl.load(lam + (t * H + i_h)[:, None] * L + lut, mask=m_lam, other=0.0).to(tl.float32)  # [C, C]: lam_in
    b_blk = tl.where(m_lam, b_p * b_lam, 0.0)  # [C, C]: B
    b_db = tl.zeros([C, C], dtype=tl.float32)  # dO V^T
    b_dt = tl.zeros([C, C], dtype=tl.float32)  # dŪ Z^T
    b_dbeta = tl.zeros([C], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        row_v = (t * H + i_h)[:, None] * V + o_v[None, :]  # [C, BV]
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        b_v = tl.load(v + row_v, mask=m_tv, other=0.0)  # [C, BV]
        b_do = tl.load(do + row_v, mask=m_tv, other=0.0).to(b_v.dtype)  # [C, BV]
        b_du = tl.load(du + row_v, mask=m_tv, other=0.0)  # [C, BV] fp32
        b_db += mma(b_do, tl.trans(b_v), F32)  # [C, BV] @ [BV, C]
        b_dz = mma_fp32(tl.trans(b_ti), b_du, b_v.dtype, F32, FP32_DOT)  # [C, C] @ [C, BV]: Tinv^T dŪ
        b_dv = mma_left_fp32(tl.trans(b_blk), b_do, F32) + b_beta[:, None] * b_dz  # [C, C] @ [C, BV]
        tl.store(dv + row_v, to_output(b_dv, dv.dtype.element_ty, F32), mask=m_tv)  # downcast: input dtype
        b_z = b_v.to(tl.float32) * b_beta[:, None]  # [C, BV]: Z
        b_dt += mma_fp32(b_du, tl.trans(b_z), b_v.dtype, F32, FP32_DOT)  # [C, BV] @ [BV, C]: dŪ Z^T
        b_dbeta += tl.sum(b_dz * b_v.to(tl.float32), axis=1)
    b_db = tl.where(lower, b_db, 0.0)
    b_dp = tl.where(m_lam, b_db * b_lam, 0.0)  # [C, C]: dP
    b_dlam = tl.where(m_lam, b_db * b_p, 0.0)  # [C, C]: dlam_in
    for lev in tl.static_range(LOG_C + 1):  # the in-chunk level columns 0..c of each row
        tl.store(dlam + (t * H + i_h) * L + lev, tl.sum(tl.where(lut == lev, b_dlam, 0.0), axis=1), mask=m_t & (o_t * 0 + lev < L))
    b_dbeta += tl.sum(b_dp * b_at, axis=0)
    tl.store(dbeta + t * H + i_h, b_dbeta, mask=m_t)
    tile = (i_ch * H + i_h).to(tl.int64) * C * C + o_t[:, None] * C + o_t[None, :]  # [C, C]
    tl.store(dps + tile, b_dp * b_beta[None, :])
    tl.store(dts + tile, b_dt)


@triton.jit
def gdn_chunk_score_grads_kernel(
    q, k, g, beta, t_inv, w, dqt, dw, dkt, dt_inv, dlast, chunks, dps, dts, dbeta, dg, scale, H, K,
    C: tl.constexpr, BK: tl.constexpr, USE_G: tl.constexpr, USE_DT: tl.constexpr, F32: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    """grid: (num_chunks, H). Stage 2 (twin `chunk_score_grads`), the [C, C] gradients of one chunk, from stage 1's
    tiles (`dps`: dP diag(β), `dts`: dŪ Z^T) and the cotangents of q̃, W, K̃ (and Tinv: USE_DT, the final state's
    edge rows), over [C, BK] key tiles, with `Y = diag(β exp(gc)) K`:

        dA = dP diag(β) Tinv^T - dq̃ W^T,   dW' = dW - A^T dq̃,   dTinv = dŪ Z^T + A^T dP diag(β) + dW' Y^T [+ dTinv]
        dM = -strict(Tinv^T dTinv Tinv^T),   dS = lower(dA ⊙ D),   dKK = diag(β) (dM ⊙ D)

    It completes dbeta (stage 1 wrote its value part) and dg (every log-decay term, `dlast` the cotangent of the
    chunk's total log-decay) and stores for stage 3 dS over `dps` and `dKK + dKK^T` over `dts`."""
    i_ch, i_h, _, _, o_t, t, m_t = chunk_program(chunks, C)
    lower = o_t[:, None] >= o_t[None, :]
    b_dqw = tl.zeros([C, C], dtype=tl.float32)  # dq̃ W^T
    b_dwk = tl.zeros([C, C], dtype=tl.float32)  # dW K^T
    b_dqk = tl.zeros([C, C], dtype=tl.float32)  # dq̃ K^T
    b_dqq = tl.zeros([C], dtype=tl.float32)  # rowsum(dq̃ ⊙ Q)
    b_dkk_t = tl.zeros([C], dtype=tl.float32)  # rowsum(dK̃ ⊙ K)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        row_k = (t * H + i_h)[:, None] * K + o_k[None, :]  # [C, BK]
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        b_k = tl.load(k + row_k, mask=m_tk, other=0.0)  # [C, BK]
        b_dqt = tl.load(dqt + row_k, mask=m_tk, other=0.0)  # [C, BK] fp32
        b_dqw += mma_fp32(b_dqt, tl.trans(tl.load(w + row_k, mask=m_tk, other=0.0)), k.dtype.element_ty, F32, FP32_DOT)  # [C, BK] @ [BK, C]
        b_dwk += mma_left_fp32(tl.load(dw + row_k, mask=m_tk, other=0.0), tl.trans(b_k), F32)  # [C, BK] @ [BK, C]
        b_dqk += mma_left_fp32(b_dqt, tl.trans(b_k), F32)  # [C, BK] @ [BK, C]
        b_dqq += tl.sum(b_dqt * tl.load(q + row_k, mask=m_tk, other=0.0).to(tl.float32), axis=1)
        b_dkk_t += tl.sum(tl.load(dkt + row_k, mask=m_tk, other=0.0) * b_k.to(tl.float32), axis=1)
    b_s, b_kk = chunk_gram(q, k, t, m_t, H, i_h, K, True, C, BK, F32)  # [C, C]: Q K^T, K K^T (after the loop: fewer tiles live in it)
    b_g, b_gc, b_last = chunk_decay(g, t, m_t, H, i_h, USE_G)  # [C], [C], scalar
    b_d = tl.exp2(chunk_segsum(b_g, b_gc, b_last, False, F32))  # [C, C]: D, 0 above the diagonal
    b_a = tl.where(lower, b_s * scale * b_d, 0.0)  # [C, C]: A
    b_e = tl.exp2(b_gc)  # [C]: exp(gc)
    b_beta = tl.load(beta + t * H + i_h, mask=m_t, other=0.0).to(tl.float32)  # [C]
    tile = (i_ch * H + i_h).to(tl.int64) * C * C + o_t[:, None] * C + o_t[None, :]  # [C, C]
    # dW' K^T with dW' = dW - A^T dq̃: then dW' Y^T = (dW' K^T) diag(β exp(gc)) and rowsum(Tinv^T dW' ⊙ K) = colsum(Tinv ⊙ dW' K^T)
    b_dwk -= mma_fp32(tl.trans(b_a), b_dqk, k.dtype.element_ty, F32, FP32_DOT)  # [C, C] @ [C, C]
    b_dat = tl.load(dps + tile)  # [C, C]: dP diag(β), the gradient of A Tinv
    b_dt = tl.load(dts + tile) + mma_fp32(tl.trans(b_a), b_dat, k.dtype.element_ty, F32, FP32_DOT) + b_dwk * (b_beta * b_e)[None, :]  # dTinv
    if USE_DT:
        b_dt += tl.load(dt_inv + (t * H + i_h)[:, None] * C + o_t[None, :], mask=m_t[:, None], other=0.0)
    b_ti = tl.load(t_inv + (t * H + i_h)[:, None] * C + o_t[None, :], mask=m_t[:, None], other=0.0)  # [C, C] fp32
    b_da = mma_fp32(b_dat, tl.trans(b_ti), k.dtype.element_ty, F32, FP32_DOT) - b_dqw  # [C, C]: dA
    b_dyk = tl.sum(b_ti * b_dwk, axis=0)  # [C]: rowsum(dY ⊙ K), dY = Tinv^T dW'
    b_dm = mma_fp32(mma_fp32(tl.trans(b_ti), b_dt, k.dtype.element_ty, F32, FP32_DOT), tl.trans(b_ti), k.dtype.element_ty, F32, FP32_DOT)
    b_dm = tl.where(o_t[:, None] > o_t[None, :], -b_dm, 0.0)  # [C, C]: dM, strictly lower
    b_dmd = b_dm * b_d  # [C, C]: dM ⊙ D
    b_dbeta = tl.load(dbeta + t * H + i_h, mask=m_t, other=0.0) + b_e * b_dyk + tl.sum(b_dmd * b_kk, axis=1)
    tl.store(dbeta + t * H + i_h, b_dbeta, mask=m_t)
    b_dkk = b_dmd * b_beta[:, None]  # [C, C]: dKK
    if USE_G:
        b_ddd = b_dkk * b_kk + b_da * b_a  # [C, C]: dD ⊙ D (dA ⊙ S ⊙ D = dA ⊙ A)
        b_de = b_dqq * scale + b_beta * b_dyk  # [C]: d exp(gc)
        b_ds = b_dkk_t * tl.exp2(chunk_suffix(b_g, b_gc, b_last, F32))  # [C]: d log of exp(gc_last - gc)
        b_dgc = tl.where(m_t, tl.sum(b_ddd, axis=1) - tl.sum(b_ddd, axis=0) + b_de * b_e - b_ds, 0.0)  # [C]
        b_dl = tl.sum(b_ds, axis=0) + tl.load(dlast + i_ch * H + i_h)  # the chunk's total log-decay
        b_dg = tl.sum(tl.where(o_t[None, :] >= o_t[:, None], b_dgc[None, :], 0.0), axis=1) + b_dl  # [C]: reverse cumsum
        tl.store(dg + t * H + i_h, b_dg, mask=m_t)
    tl.store(dps + tile, tl.where(lower, b_da * b_d, 0.0))  # dS
    tl.store(dts + tile, b_dkk + tl.trans(b_dkk))


@triton.jit
def gdn_chunk_key_grads_kernel(
    q, k, g, beta, t_inv, dqt, dw, dkt, chunks, dss, dkks, dq, dk, scale, H, K,
    C: tl.constexpr, BK: tl.constexpr, USE_G: tl.constexpr, F32: tl.constexpr, FP32_DOT: tl.constexpr,
):
    """grid: (cdiv(K, BK) * num_chunks, H) (`chunk_tile_program`). Stage 3 (twin `chunk_key_grads`), one chunk's dq
    and dk in a [C, BK] key tile from stage 2's tiles dS (`dss`) and dKK + dKK^T (`dkks`):

        dq = scale (dS K + diag(exp(gc)) dq̃)
        dk = scale dS^T Q + (dKK + dKK^T) K + diag(β exp(gc)) Tinv^T dW' + diag(exp(gc_last - gc)) dK̃

    with `dW' = dW - A^T dq̃` (A formed again over every key tile rather than stored); input dtype."""
    i_k, i_ch, i_h, _, _, o_t, t, m_t = chunk_tile_program(chunks, tl.cdiv(K, BK), C)
    o_k = i_k * BK + tl.arange(0, BK)
    row_k = (t * H + i_h)[:, None] * K + o_k[None, :]  # [C, BK]
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    b_q = tl.load(q + row_k, mask=m_tk, other=0.0)  # [C, BK]
    b_k = tl.load(k + row_k, mask=m_tk, other=0.0)  # [C, BK]
    b_dqt = tl.load(dqt + row_k, mask=m_tk, other=0.0)  # [C, BK] fp32
    b_g, b_gc, b_last = chunk_decay(g, t, m_t, H, i_h, USE_G)  # [C], [C], scalar
    b_e = tl.exp2(b_gc)  # [C]: exp(gc)
    b_beta = tl.load(beta + t * H + i_h, mask=m_t, other=0.0).to(tl.float32)  # [C]
    tile = (i_ch * H + i_h).to(tl.int64) * C * C + o_t[:, None] * C + o_t[None, :]  # [C, C]
    b_ti = tl.load(t_inv + (t * H + i_h)[:, None] * C + o_t[None, :], mask=m_t[:, None], other=0.0)  # [C, C] fp32
    b_s, _ = chunk_gram(q, k, t, m_t, H, i_h, K, False, C, BK, F32)  # [C, C]: Q K^T
    b_a = tl.where(o_t[:, None] >= o_t[None, :], b_s * scale * tl.exp2(chunk_segsum(b_g, b_gc, b_last, False, F32)), 0.0)  # [C, C]: A
    b_dw = tl.load(dw + row_k, mask=m_tk, other=0.0) - mma_fp32(tl.trans(b_a), b_dqt, b_k.dtype, F32, FP32_DOT)  # [C, BK]: dW'
    b_dy = mma_fp32(tl.trans(b_ti), b_dw, b_k.dtype, F32, FP32_DOT)  # [C, C] @ [C, BK]: Tinv^T dW'
    b_dsc = tl.load(dss + tile)  # [C, C] fp32: dS
    b_dq = (mma_left_fp32(b_dsc, b_k, F32) + b_dqt * b_e[:, None]) * scale  # [C, C] @ [C, BK]
    b_dk = b_dy * (b_beta * b_e)[:, None] + tl.load(dkt + row_k, mask=m_tk, other=0.0) * tl.exp2(chunk_suffix(b_g, b_gc, b_last, F32))[:, None]
    b_dk += mma_left_fp32(tl.trans(b_dsc), b_q, F32) * scale + mma_left_fp32(tl.load(dkks + tile), b_k, F32)  # [C, C] @ [C, BK]
    tl.store(dq + row_k, to_output(b_dq, dq.dtype.element_ty, F32), mask=m_tk)  # downcast: input dtype
    tl.store(dk + row_k, to_output(b_dk, dk.dtype.element_ty, F32), mask=m_tk)  # downcast: input dtype


def gdn_chunk_locals_backward(q, k, v, g, beta, lam, table, grads: ChunkLocals, *, scale, C):
    """The vector-Jacobian product of `gdn_chunk_locals` for the cotangents `grads` (a `ChunkLocals` of
    gradients, any of them None): `(dq, dk, dv, dg (None without g), dbeta, dlam)`, fp32 token rows, in the three
    stages of `gdn_chunk_backward`'s kernels (`chunk_value_grads`, `chunk_score_grads`, `chunk_key_grads`, each
    the twin of one) on the padded chunks `[NC, H, C, *]`."""
    N_tok = q.shape[0]
    layout, p, cot = chunk_grads_inputs(q, k, v, g, beta, lam, table, grads, scale=scale, C=C)
    dv, dlam, dbeta, dAT, dT = chunk_value_grads(p, cot)
    dS, dKKs, dbeta, dgl = chunk_score_grads(p, cot, dAT, dT, dbeta)
    dq, dk = chunk_key_grads(p, cot, dS, dKKs)
    tokens = lambda x: layout.tokens(x, N_tok)  # noqa: E731
    per_token = lambda x: tokens(x[..., None])[..., 0]  # noqa: E731  [NC, H, C] -> [N_tok, H]
    return tokens(dq), tokens(dk), tokens(dv), per_token(dgl) if g is not None else None, per_token(dbeta), tokens(dlam)


def chunk_grads_inputs(q, k, v, g, beta, lam, table, grads: ChunkLocals, *, scale, C):
    """What the stage twins take: `(layout, p, cot)`, the chunk layout of `table`, `chunk_parts` with A, and the
    cotangents `grads` chunked (`[NC, H, C, *]`, zero where None)."""
    layout = chunk_layout(table, C)
    p = chunk_parts(q, k, v, g, beta, lam, layout, scale, C)
    NC, H = p["qc"].shape[:2]
    width = dict(o_intra=p["vc"].shape[-1], qt=p["qc"].shape[-1], w=p["qc"].shape[-1], u_bar=p["vc"].shape[-1], kt=p["qc"].shape[-1], t_inv=C)
    cot = {n: p["qc"].new_zeros(NC, H, C, d) if getattr(grads, n) is None else layout.chunked(getattr(grads, n)) for n, d in width.items()}
    cot["gc_last"] = None if grads.gc_last is None else grads.gc_last.to(p["qc"].dtype)
    p["A"] = torch.where(torch.ones(C, C, dtype=torch.bool, device=q.device).tril(), p["qc"] @ p["kc"].transpose(-1, -2) * p["D"], 0.0)
    return layout, p, cot


def chunk_value_grads(p: dict, cot: dict):
    """Twin of `gdn_chunk_value_grads_kernel` on `chunk_parts` `p` (with `A`) and the chunked cotangents `cot`:
    `(dv (its B^T dO + diag(β) Tinv^T dŪ, whole), dlam (in-chunk columns), dbeta (value part), dP diag(β),
    dŪ Z^T)`, with `P = A Tinv diag(β)`, `B = P ⊙ lam_in`, `Z = diag(β) V`:

        dB = lower(dO V^T),  dV = B^T dO + diag(β) Tinv^T dŪ,  dP = dB ⊙ lam_in,  dlam_in = dB ⊙ P"""
    vc, bc, t_inv, C = p["vc"], p["bc"], p["t_inv"], p["vc"].shape[-2]
    AT = p["A"] @ t_inv  # [NC, H, C, C]
    P = AT * bc[..., None, :]
    dB = torch.where(torch.ones(C, C, dtype=torch.bool, device=vc.device).tril(), cot["o_intra"] @ vc.transpose(-1, -2), 0.0)
    dZ = t_inv.transpose(-1, -2) @ cot["u_bar"]  # [NC, H, C, V]
    dv = (P * p["lam_in"]).transpose(-1, -2) @ cot["o_intra"] + bc[..., None] * dZ
    dP = dB * p["lam_in"]
    dlam = torch.zeros_like(p["lamc"]).scatter_add(-1, p["lut"], torch.where(p["m_lam"], dB * P, 0.0))  # [NC, H, C, L]
    dbeta = (dP * AT).sum(-2) + (dZ * vc).sum(-1)  # [NC, H, C]: column sums, row sums
    return dv, dlam, dbeta, dP * bc[..., None, :], cot["u_bar"] @ (bc[..., None] * vc).transpose(-1, -2)


def chunk_score_grads(p: dict, cot: dict, dAT, dT, dbeta):
    """Twin of `gdn_chunk_score_grads_kernel`: from stage 1's `dAT = dP diag(β)` (the gradient of A Tinv), `dT =
    dŪ Z^T` and dbeta's value part, `(dS, dKK + dKK^T, dbeta, dg)` with `Y = diag(β exp(gc)) K`:

        dA = dAT Tinv^T - dq̃ W^T,   dW' = dW - A^T dq̃,   dTinv = dT + A^T dAT + dW' Y^T (+ the given dTinv)
        dM = -strict(Tinv^T dTinv Tinv^T),   dS = lower(dA ⊙ D),   dKK = diag(β) (dM ⊙ D)

    and every log-decay term as `dgc` (the gradient of the in-chunk prefix sums), `dg = reverse cumsum`."""
    qc, kc, bc, gc, D, A, t_inv = p["qc"], p["kc"], p["bc"], p["gc"], p["D"], p["A"], p["t_inv"]
    C = qc.shape[-2]
    lower = torch.ones(C, C, dtype=torch.bool, device=qc.device).tril()
    E = torch.exp(gc)  # [NC, H, C]
    Y = (bc * E)[..., None] * kc  # [NC, H, C, K]
    dA = dAT @ t_inv.transpose(-1, -2) - cot["qt"] @ (t_inv @ Y).transpose(-1, -2)
    dW = cot["w"] - A.transpose(-1, -2) @ cot["qt"]  # [NC, H, C, K]: dW'
    dT = cot["t_inv"] + dT + A.transpose(-1, -2) @ dAT + dW @ Y.transpose(-1, -2)
    dYK = ((t_inv.transpose(-1, -2) @ dW) * kc).sum(-1)  # [NC, H, C]
    s = torch.exp(suffix_sum(p["gl"]))  # [NC, H, C]
    ds = (cot["kt"] * kc).sum(-1) * s  # [NC, H, C]: gradient of log s
    dM = torch.where(lower.tril(-1), -(t_inv.transpose(-1, -2) @ dT @ t_inv.transpose(-1, -2)), 0.0)  # [NC, H, C, C]
    KK = kc @ kc.transpose(-1, -2)
    dbeta = dbeta + E * dYK + (dM * KK * D).sum(-1)
    dKK = bc[..., None] * dM * D
    dDD = (bc[..., None] * dM * KK + torch.where(lower, dA * (qc @ kc.transpose(-1, -2)), 0.0)) * D  # the segment sums' gradient
    dE = (cot["qt"] * qc).sum(-1) + bc * dYK
    dgc = dDD.sum(-1) - dDD.sum(-2) + dE * E - ds
    dlast = ds.sum(-1) + (cot["gc_last"] if cot["gc_last"] is not None else 0.0)  # [NC, H]
    dgc = dgc + F.pad(dlast[..., None], [C - 1, 0])  # gc_last is the chunk's last prefix sum
    dgl = torch.flip(torch.cumsum(torch.flip(dgc, [-1]), -1), [-1])  # [NC, H, C]
    return torch.where(lower, dA * D, 0.0), dKK + dKK.transpose(-1, -2), dbeta, dgl


def chunk_key_grads(p: dict, cot: dict, dS, dKKs):
    """Twin of `gdn_chunk_key_grads_kernel`: `(dq, dk)` from stage 2's dS and `dKK + dKK^T`:

        dq = dS K + diag(exp(gc)) dq̃   (times scale: `qc` holds scale Q)
        dk = dS^T (scale Q) + (dKK + dKK^T) K + diag(β exp(gc)) Tinv^T dW' + diag(exp(gc_last - gc)) dK̃"""
    qc, kc, bc, gc, scale = p["qc"], p["kc"], p["bc"], p["gc"], p["scale"]
    E = torch.exp(gc)  # [NC, H, C]
    dW = cot["w"] - p["A"].transpose(-1, -2) @ cot["qt"]  # [NC, H, C, K]: dW'
    dq = (dS @ kc + E[..., None] * cot["qt"]) * scale
    dk = dS.transpose(-1, -2) @ qc + dKKs @ kc + (bc * E)[..., None] * (p["t_inv"].transpose(-1, -2) @ dW)
    return dq, dk + torch.exp(suffix_sum(p["gl"]))[..., None] * cot["kt"]


def _stage_modes(q, g):
    """`(config, BK, the launch options)` shared by the chunk gradients' three kernels."""
    config = get_config()
    return config, min(block(q.shape[-1]), 64), dict(
        USE_G=g is not None, F32=dot_f32(q.dtype), FP32_DOT=fp32_dot_mode(config, "delta_fp32_dot"),
        num_warps=config.gdn_chunk_warps, num_stages=config.num_stages,
    )


def chunk_value_grads_stage(q, k, v, g, beta, lam, t_inv, do, du, chunks: tuple, *, scale, grad_dtype=None):
    """`gdn_chunk_value_grads_kernel` over every grid chunk (twin `chunk_value_grads`): `(dv (in grad_dtype, default
    v's), dbeta's value part, dlam (the in-chunk level columns), dps, dts)`, the last two `[NC, H, C, C]` fp32."""
    N_tok, H, K = q.shape
    V, L = v.shape[-1], lam.shape[-1]
    config, BK, modes = _stage_modes(q, g)
    C, NC = config.chunk_size, chunks[2]
    dv = torch.empty_like(v, dtype=grad_dtype or v.dtype)
    dbeta = torch.empty(N_tok, H, dtype=torch.float32, device=q.device)
    dlam = torch.zeros(N_tok, H, L, dtype=torch.float32, device=q.device)
    dps, dts = (torch.empty(NC, H, C, C, dtype=torch.float32, device=q.device) for _ in range(2))
    gdn_chunk_value_grads_kernel[(NC, H)](
        q, k, v, g, beta, lam, t_inv, do.contiguous(), du, chunks[0], dv, dbeta, dlam, dps, dts,
        scale, H, K, V, L, C=C, LOG_C=C.bit_length() - 1, BK=BK, BV=value_tile(config, V), **modes,
    )
    return dv, dbeta, dlam, dps, dts


def chunk_score_grads_stage(q, k, g, beta, t_inv, w, grads: ChunkLocals, chunks: tuple, dps, dts, dbeta, *, scale):
    """`gdn_chunk_score_grads_kernel` over every grid chunk (twin `chunk_score_grads`) on stage 1's `dps`, `dts` and
    dbeta, which it overwrites with dS, `dKK + dKK^T` and the whole dbeta: returns dg (fp32, None without g)."""
    N_tok, H, K = q.shape
    config, BK, modes = _stage_modes(q, g)
    dg = torch.empty(N_tok, H, dtype=torch.float32, device=q.device) if g is not None else None
    gdn_chunk_score_grads_kernel[(chunks[2], H)](
        q, k, g, beta, t_inv, w, grads.qt, grads.w, grads.kt, grads.t_inv, grads.gc_last, chunks[0], dps, dts,
        dbeta, dg, scale, H, K, C=config.chunk_size, BK=BK, USE_DT=grads.t_inv is not None, **modes,
    )
    return dg


def chunk_key_grads_stage(q, k, g, beta, t_inv, grads: ChunkLocals, chunks: tuple, dss, dkks, *, scale, grad_dtype=None):
    """`gdn_chunk_key_grads_kernel` over every grid chunk and key tile (twin `chunk_key_grads`) from stage 2's dS
    (`dss`) and `dKK + dKK^T` (`dkks`): `(dq, dk)` in grad_dtype (default the inputs')."""
    H, K = q.shape[1:]
    config, BK, modes = _stage_modes(q, g)
    dq, dk = (torch.empty_like(x, dtype=grad_dtype or x.dtype) for x in (q, k))
    gdn_chunk_key_grads_kernel[(triton.cdiv(K, BK) * chunks[2], H)](
        q, k, g, beta, t_inv, grads.qt, grads.w, grads.kt, chunks[0], dss, dkks, dq, dk, scale, H, K,
        C=config.chunk_size, BK=BK, **modes,
    )
    return dq, dk


def gdn_chunk_backward(q, k, v, g, beta, lam, t_inv, w, grads: ChunkLocals, chunks: tuple, *, scale, grad_dtype=None):
    """The chunk-local backward's three stages over every grid chunk (`chunks`, the forward's table):
    `gdn_chunk_locals_backward`'s result `(dq, dk, dv (in grad_dtype, default the inputs' dtypes), dg (fp32, None
    without g), dbeta, dlam (fp32; the in-chunk level columns))` from flattened tokens, the forward's `t_inv` and
    `w`, and the cotangents `grads` (`o_intra` the output's gradient; `t_inv` may be None, the others not). The
    stages pass two `[NC, H, C, C]` fp32 tiles a chunk between them."""
    dv, dbeta, dlam, dps, dts = chunk_value_grads_stage(
        q, k, v, g, beta, lam, t_inv, grads.o_intra, grads.u_bar, chunks, scale=scale, grad_dtype=grad_dtype,
    )
    dg = chunk_score_grads_stage(q, k, g, beta, t_inv, w, grads, chunks, dps, dts, dbeta, scale=scale)
    dq, dk = chunk_key_grads_stage(q, k, g, beta, t_inv, grads, chunks, dps, dts, scale=scale, grad_dtype=grad_dtype)
    return dq, dk, dv, dg, dbeta, dlam
