"""The delta rule backward: a reverse recurrence for the state gradient, then every chunk in parallel.

With the forward of forward.py (R = diag(beta)(V - diag(exp(gc)) K h), U = Tinv R,
A_qk = scale Q K^T ⊙ Γ ⊙ L) and dh' the gradient of the state leaving the chunk:

    dU = A_qk^T dO + diag(exp(gc_last - gc)) K dh'                          [C, V]
    dR = Tinv^T dU                                                          [C, V]
    dh = exp(gc_last) dh' + (scale Q)^T diag(exp(gc)) dO - K^T diag(beta exp(gc)) dR

so `dR = X + Y dh'` with two state-independent factors, `X = Tinv^T A_qk^T dO` [C, V] and
`Y = Tinv^T diag(exp(gc_last - gc)) K` [C, K], both fp32, which `delta_grad_factors_kernel` forms
for every chunk in parallel. `delta_state_grad_kernel` then runs the recurrence backward over the
chunks of one sequence, head and value tile (three products per chunk), storing dh' of every chunk
(`dhs: [NC, H, K, V]`) and dR (`drs: [N_tok, H, V]`), both fp32.
Then two per-chunk kernels. `delta_score_grads_kernel` (one program per chunk and head) sums over
the value tiles the chunk's two [C, C] tiles and writes `dv = diag(beta) dR`:

    P  = dO U^T,   E = -dR U^T           (dA = strict_lower(E): U = (I + A)^{-1} R)
    dS = scale P ⊙ Γ ⊙ L,   M = diag(beta) (dA ⊙ Γ)

stored fp32 (`[NC, H, C, C]`); `delta_grads_kernel` (one program per chunk, head and key tile)
then forms

    dq = dS K + scale diag(exp(gc)) dO h^T
    dk = dS^T Q + (M + M^T) K + diag(exp(gc_last - gc)) U dh'^T - diag(beta exp(gc)) dR h^T
    dbeta = rowsum(dR ⊙ (V - diag(exp(gc)) K h)) + rowsum(dA ⊙ Γ ⊙ K K^T)

(the `K h` term as `rowsum(K ⊙ dR h^T)`, which reuses dk's product), each kernel writing its share
of dbeta (summed on the host), with the per-token `q . dq` and `v . dv` of the log-decay term `q . dq - v . dv` (function.py turns it into dg).
`delta_backward_ref` is the PyTorch twin of the four kernels (`delta_score_grads` launches the first per-chunk one).
"""
import torch
import triton
import triton.language as tl

from polyattn.ops.triton.decay import chunk_decay, chunk_segsum, chunk_suffix
from polyattn.ops.triton.plan import block
from polyattn.ops.triton.precision import SPLIT, dot_f32, mma, mma_fp32, mma_halves, mma_left_fp32, mma_right_acc, to_output

from .forward import chunk_program, chunk_scores, chunk_tile_program, sequence_tile, value_rows
from .wy import factor_tiles


@triton.jit
def delta_grad_factors_kernel(
    q, k, do, g, t_inv, chunks, xs, ys, ys_lo, scale, H, K, V,
    C: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, USE_G: tl.constexpr, F32: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    """grid: (num_chunks, H). `X = (Tinv^T A_qk^T) dO` (fp32) and `Y = (Tinv^T diag(exp(gc_last - gc))) K` of one
    chunk, in [C, BD] column tiles (fp32 left factors split in two halves). Y is stored fp32, or, when `ys` has
    the input dtype, as its two halves in `ys` and `ys_lo`: split once here rather than by every value tile of
    the reverse recurrence in every chunk."""
    _, i_h, _, _, o_t, t, m_t = chunk_program(chunks, C)
    o_k = tl.arange(0, BK)
    row_k = (t * H + i_h)[:, None] * K + o_k[None, :]  # [C, BK]
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    b_q = tl.load(q + row_k, mask=m_tk, other=0.0)  # [C, BK]
    b_k = tl.load(k + row_k, mask=m_tk, other=0.0)  # [C, BK]
    b_tinv = tl.load(t_inv + (t * H + i_h)[:, None] * C + o_t[None, :], mask=m_t[:, None], other=0.0)  # [C, C]
    b_g, b_gc, b_last = chunk_decay(g, t, m_t, H, i_h, USE_G)  # [C], [C], scalar
    b_att = chunk_scores(b_q, b_k, b_g, b_gc, b_last, scale, F32)  # [C, C]
    b_gs = chunk_suffix(b_g, b_gc, b_last, F32)  # [C]
    b_m = mma_fp32(tl.trans(b_tinv), tl.trans(b_att), b_q.dtype, F32, FP32_DOT)  # [C, C] @ [C, C]: Tinv^T A_qk^T
    factor_tiles(do, b_m, xs, xs, t, m_t, H, i_h, V, C, C, BD, F32, False, False)
    factor_tiles(k, tl.trans(b_tinv) * tl.exp2(b_gs)[None, :], ys, ys_lo, t, m_t, H, i_h, K, C, C, BD, F32, False, False)


@triton.jit
def delta_state_grad_kernel(
    q, k, do, beta, g, xs, ys, ys_lo, seqs, cu_chunks, dht, dh0, dhs, drs,
    scale, H, K, V,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, SAVE: tl.constexpr, F32: tl.constexpr,
    FP32_DOT: tl.constexpr, LEAD: tl.constexpr,
):
    """grid: (cdiv(V, BV), N, H). The fp32 [BK, BV] state gradient stays in registers; the
    loop walks the sequence's chunks last to first: `dR = X + Y dh'`, then dh; with SAVE, dh' of every
    chunk (`dhs`) and dR (`drs`) are stored for the per-chunk gradient kernels. LEAD: the state's first
    LEAD columns see no dO and no X (`do`, `xs` have V - LEAD columns; forward.value_rows)."""
    i_n, i_h, bos, eos, c0, o_k, m_k, o_v, m_v, m_s, state_tile = sequence_tile(seqs, cu_chunks, K, V, BK, BV)
    o_t = tl.arange(0, C)
    if USE_DHT:
        b_dh = tl.load(dht + (i_n * H + i_h) * K * V + state_tile, mask=m_s, other=0.0)  # [BK, BV]
    else:
        b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    n_chunks = tl.cdiv(eos - bos, C)
    for j in range(0, n_chunks):
        i = n_chunks - 1 - j
        t = bos + i * C + o_t
        m_t = t < eos
        if SAVE:
            tl.store(dhs + ((c0 + i) * H + i_h) * K * V + state_tile, b_dh, mask=m_s)
        row_k = (t * H + i_h)[:, None] * K + o_k[None, :]  # [C, BK]
        m_tk = m_t[:, None] & m_k[None, :]
        row_v = (t * H + i_h)[:, None] * V + o_v[None, :]  # [C, BV]
        m_tv = m_t[:, None] & m_v[None, :]
        b_y = tl.load(ys + row_k, mask=m_tk, other=0.0)  # [C, BK]: Y, or its high half
        if ys.dtype.element_ty == tl.float32:
            b_y_lo = b_y  # Y itself: one IEEE product, no low half
        else:
            b_y_lo = tl.load(ys_lo + row_k, mask=m_tk, other=0.0)  # [C, BK]: its low half
        b_q = tl.load(q + row_k, mask=m_tk, other=0.0)  # [C, BK]
        b_k = tl.load(k + row_k, mask=m_tk, other=0.0)  # [C, BK]
        b_dr = value_rows(xs, t, H, i_h, V, o_v, m_tv, LEAD) + mma_halves(b_y, b_y_lo, b_dh, F32, FP32_DOT)  # [C, BK] @ [BK, BV]
        if SAVE:
            tl.store(drs + row_v, b_dr, mask=m_tv)
        b_do = value_rows(do, t, H, i_h, V, o_v, m_tv, LEAD)  # [C, BV]
        b_beta = tl.load(beta + t * H + i_h, mask=m_t, other=0.0).to(tl.float32)  # [C]
        b_g, b_gc, b_last = chunk_decay(g, t, m_t, H, i_h, USE_G)  # [C], [C], scalar
        b_egc = tl.exp2(b_gc)  # [C]
        b_dow = b_do.to(tl.float32) * (b_egc * scale)[:, None]  # [C, BV]
        b_drw = b_dr * (b_beta * b_egc)[:, None]  # [C, BV]
        b_dh = mma_right_acc(tl.trans(b_q), b_dow, b_dh * tl.exp2(b_last), F32, SPLIT)  # [BK, C] @ [C, BV]
        b_dh = mma_right_acc(tl.trans(b_k), -b_drw, b_dh, F32, SPLIT)  # [BK, C] @ [C, BV]
    if STORE_DH0:
        tl.store(dh0 + (i_n * H + i_h) * K * V + state_tile, b_dh, mask=m_s)


@triton.jit
def delta_score_grads_kernel(
    k, v, beta, g, do, chunks, us, drs, dss, mms, dv, dbeta, vdv, scale, H, K, V,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, F32: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    """grid: (num_chunks, H). The chunk's two [C, C] gradient tiles over the whole V, in [C, BV]
    value tiles: `dS = scale (dO U^T) ⊙ Γ ⊙ L` and `M + M^T` with `M = diag(beta) strict_lower(-dR U^T ⊙ Γ)`,
    stored fp32 (`dss, mms: [NC, H, C, C]`) for `delta_grads_kernel`; also `dv = diag(beta) dR`,
    `v . dv` and the key-independent part of dbeta, `rowsum(dR ⊙ V) + rowsum(dA ⊙ Γ ⊙ K K^T)`."""
    i_ch, i_h, _, _, o_t, t, m_t = chunk_program(chunks, C)
    b_beta = tl.load(beta + t * H + i_h, mask=m_t, other=0.0).to(tl.float32)  # [C]
    b_p = tl.zeros([C, C], dtype=tl.float32)
    b_e = tl.zeros([C, C], dtype=tl.float32)
    b_db = tl.zeros([C], dtype=tl.float32)
    b_vdv = tl.zeros([C], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        row_v = (t * H + i_h)[:, None] * V + o_v[None, :]  # [C, BV]
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        b_u = tl.load(us + row_v, mask=m_tv, other=0.0)  # [C, BV] fp32
        b_dr = tl.load(drs + row_v, mask=m_tv, other=0.0)  # [C, BV] fp32
        b_do = tl.load(do + row_v, mask=m_tv, other=0.0)  # [C, BV]
        b_p = mma_right_acc(b_do, tl.trans(b_u), b_p, F32, SPLIT)  # [C, BV] @ [BV, C] -> [C, C]
        b_e -= mma_fp32(b_dr, tl.trans(b_u), b_do.dtype, F32, FP32_DOT)  # [C, BV] @ [BV, C] -> [C, C]
        b_v = tl.load(v + row_v, mask=m_tv, other=0.0).to(tl.float32)  # [C, BV]
        b_dv = b_dr * b_beta[:, None]  # [C, BV]
        b_db += tl.sum(b_dr * b_v, axis=1)  # [C]
        b_vdv += tl.sum(b_v * b_dv, axis=1)  # [C]
        tl.store(dv + row_v, to_output(b_dv, dv.dtype.element_ty, F32), mask=m_tv)  # downcast: input dtype
    b_kk = tl.zeros([C, C], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        b_k = tl.load(k + (t * H + i_h)[:, None] * K + o_k[None, :], mask=m_t[:, None] & (o_k < K)[None, :], other=0.0)
        b_kk += mma(b_k, tl.trans(b_k), F32)  # [C, BK] @ [BK, C] -> [C, C]
    b_g, b_gc, b_last = chunk_decay(g, t, m_t, H, i_h, USE_G)  # [C], [C], scalar
    b_gamma = tl.exp2(chunk_segsum(b_g, b_gc, b_last, False, F32))  # [C, C], 0 above the diagonal
    b_da = tl.where(o_t[:, None] > o_t[None, :], b_e * b_gamma, 0.0)  # [C, C]: dA ⊙ Γ
    b_db += tl.sum(b_da * b_kk, axis=1)  # [C]
    b_m = b_da * b_beta[:, None]  # [C, C]
    tile = (i_ch * H + i_h).to(tl.int64) * C * C + o_t[:, None] * C + o_t[None, :]  # [C, C]
    tl.store(dss + tile, b_p * b_gamma * scale)
    tl.store(mms + tile, b_m + tl.trans(b_m))
    tl.store(dbeta + t * H + i_h, b_db, mask=m_t)
    tl.store(vdv + t * H + i_h, b_vdv, mask=m_t)


@triton.jit
def delta_grads_kernel(
    q, k, g, beta, do, chunks, hs, dhs, us, drs, dss, mms, dq, dk, dbeta, dgterm,
    scale, N_tok, H, K, V,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, F32: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    """grid: (cdiv(K, BK) * num_chunks, H) (`chunk_tile_program`). One program per chunk, head and key tile: over the value
    tiles it accumulates the state-side products `dO h^T`, `U dh'^T`, `dR h^T` ([C, BK] fp32),
    then adds the score-side ones from `delta_score_grads_kernel`'s tiles:

        dq = dS K + diag(scale exp(gc)) dO h^T
        dk = dS^T Q + (M + M^T) K + diag(exp(gc_last - gc)) U dh'^T - diag(beta exp(gc)) dR h^T

    and writes its dq, dk columns, its share of dbeta, `-exp(gc) rowsum(K ⊙ dR h^T)` (the
    `-rowsum(dR ⊙ exp(gc) K h)` term), and of `q . dq` (per key tile, summed on the host)."""
    i_k, i_ch, i_h, _, _, o_t, t, m_t = chunk_tile_program(chunks, tl.cdiv(K, BK), C)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    row_k = (t * H + i_h)[:, None] * K + o_k[None, :]  # [C, BK]
    m_tk = m_t[:, None] & m_k[None, :]
    b_q = tl.load(q + row_k, mask=m_tk, other=0.0)  # [C, BK]
    b_k = tl.load(k + row_k, mask=m_tk, other=0.0)  # [C, BK]
    b_dqh = tl.zeros([C, BK], dtype=tl.float32)
    b_udh = tl.zeros([C, BK], dtype=tl.float32)
    b_drh = tl.zeros([C, BK], dtype=tl.float32)
    p_state = ((i_ch * H + i_h) * K + o_k[None, :]).to(tl.int64) * V  # [1, BK]: row starts of h^T
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        row_v = (t * H + i_h)[:, None] * V + o_v[None, :]  # [C, BV]
        m_tv = m_t[:, None] & m_v[None, :]
        m_vk = m_v[:, None] & m_k[None, :]
        b_u = tl.load(us + row_v, mask=m_tv, other=0.0)  # [C, BV] fp32
        b_dr = tl.load(drs + row_v, mask=m_tv, other=0.0)  # [C, BV] fp32
        b_do = tl.load(do + row_v, mask=m_tv, other=0.0)  # [C, BV]
        b_ht = tl.load(hs + p_state + o_v[:, None], mask=m_vk, other=0.0)  # [BV, BK] = h^T tile
        b_dht = tl.load(dhs + p_state + o_v[:, None], mask=m_vk, other=0.0)  # [BV, BK] = dh'^T tile
        b_dqh = mma_right_acc(b_do, b_ht, b_dqh, F32, SPLIT)  # [C, BV] @ [BV, BK] -> [C, BK]
        b_udh += mma_fp32(b_u, b_dht, b_q.dtype, F32, FP32_DOT)  # [C, BV] @ [BV, BK]
        b_drh += mma_fp32(b_dr, b_ht, b_q.dtype, F32, FP32_DOT)  # [C, BV] @ [BV, BK]
    b_beta = tl.load(beta + t * H + i_h, mask=m_t, other=0.0).to(tl.float32)  # [C]
    b_g, b_gc, b_last = chunk_decay(g, t, m_t, H, i_h, USE_G)  # [C], [C], scalar
    b_egc = tl.exp2(b_gc)  # [C]
    tile = (i_ch * H + i_h).to(tl.int64) * C * C + o_t[:, None] * C + o_t[None, :]  # [C, C]
    b_ds = tl.load(dss + tile)  # [C, C] fp32
    b_dq = mma_left_fp32(b_ds, b_k, F32) + b_dqh * (b_egc * scale)[:, None]  # [C, C] @ [C, BK]
    b_dk = mma_left_fp32(tl.trans(b_ds), b_q, F32) + mma_left_fp32(tl.load(mms + tile), b_k, F32)  # [C, C] @ [C, BK]
    b_dk += b_udh * tl.exp2(chunk_suffix(b_g, b_gc, b_last, F32))[:, None] - b_drh * (b_beta * b_egc)[:, None]
    tl.store(dq + row_k, to_output(b_dq, dq.dtype.element_ty, F32), mask=m_tk)  # downcast: input dtype
    tl.store(dk + row_k, to_output(b_dk, dk.dtype.element_ty, F32), mask=m_tk)  # downcast: input dtype
    b_dbh = -b_egc * tl.sum(b_k.to(tl.float32) * b_drh, axis=1)  # [C]
    tl.store(dbeta + (i_k * N_tok + t) * H + i_h, b_dbh, mask=m_t)
    tl.store(dgterm + (i_k * N_tok + t) * H + i_h, tl.sum(b_q.to(tl.float32) * b_dq, axis=1), mask=m_t)  # q . dq


def delta_score_grads(k, v, beta, g, do, us, drs, *, scale, chunks, chunk_size, block_v, fp32_dot, num_warps, num_stages=2):
    """Launch `delta_score_grads_kernel` on flattened inputs (`[N_tok, H, D]`, beta, g `[N_tok, H]`,
    us, drs fp32). Returns `(dss, mms [NC, H, C, C] fp32, dv [N_tok, H, V] in v's dtype, dbeta [N_tok, H]
    fp32 (the key-independent part), vdv [N_tok, H] fp32)`."""
    N_tok, H, K = k.shape
    V, C = v.shape[-1], chunk_size
    dss, mms = (torch.empty(chunks[2], H, C, C, dtype=torch.float32, device=k.device) for _ in range(2))
    dv = torch.empty_like(v)
    dbeta, vdv = (torch.empty(N_tok, H, dtype=torch.float32, device=k.device) for _ in range(2))
    delta_score_grads_kernel[(chunks[2], H)](
        k, v, beta, g, do, chunks[0], us, drs, dss, mms, dv, dbeta, vdv, scale, H, K, V,
        C=C, BK=min(block(K), 64), BV=block_v, USE_G=g is not None, F32=dot_f32(k.dtype), FP32_DOT=fp32_dot,
        num_warps=num_warps, num_stages=num_stages,
    )
    return dss, mms, dv, dbeta, vdv


def delta_backward_ref(q, k, v, beta, g, t_inv, do, dht, hs, us, seq_lens: tuple, *, scale, chunk_size):
    """PyTorch twin of the four kernels (float64): `(dq, dk, dv, dbeta, dgterm, dh0, dhs, drs, dss, mms)`
    from the forward's saved `t_inv, hs, us`, the output gradient `do` and `dht` (or None); dss, mms
    are the score kernel's `[NC, H, C, C]` tiles dS and M + M^T, zero past a chunk's last token."""
    N_tok, H, K = q.shape
    V = v.shape[-1]
    q, k, v, beta, t_inv, do, us = (x.double() for x in (q, k, v, beta, t_inv, do, us))
    hs = hs.double()
    g = torch.zeros_like(beta) if g is None else g.double()
    dq, dk = torch.zeros_like(q), torch.zeros_like(k)
    dv, drs = torch.zeros_like(v), torch.zeros_like(v)
    dbeta, dgterm = torch.zeros_like(beta), torch.zeros_like(beta)
    dhs = torch.zeros_like(hs)
    dss = torch.zeros(hs.shape[0], H, chunk_size, chunk_size, dtype=torch.float64, device=q.device)
    mms = torch.zeros_like(dss)
    dh0s, bos, c = [], 0, 0
    for n, length in enumerate(seq_lens):
        starts = list(range(bos, bos + length, chunk_size))
        dh = torch.zeros(H, K, V, dtype=torch.float64, device=q.device) if dht is None else dht[n].double()
        for i in reversed(range(len(starts))):
            s = starts[i]
            e = min(s + chunk_size, bos + length)
            qc, kc, vc, doc, uc = (x[s:e].transpose(0, 1) for x in (q, k, v, do, us))  # [n, H, D] -> [H, n, D]
            bc = beta[s:e].t()  # [H, n]
            gc = torch.cumsum(g[s:e].t(), -1)  # [H, n]
            last = gc[:, -1:]  # [H, 1]
            tinv = t_inv[s:e, :, : e - s].transpose(0, 1)  # [H, n, n]
            gamma = torch.exp(gc[:, :, None] - gc[:, None, :]).tril()  # [H, n, n]
            h = hs[c + i]
            dhs[c + i] = dh
            att = scale * (qc @ kc.transpose(-1, -2)) * gamma  # [H, n, n]
            du = att.transpose(-1, -2) @ doc + torch.exp(last - gc)[..., None] * (kc @ dh)  # [H, n, V]
            dr = tinv.transpose(-1, -2) @ du  # [H, n, V]
            p = doc @ uc.transpose(-1, -2)  # [H, n, n]
            da = torch.tril(-(dr @ uc.transpose(-1, -2)) * gamma, diagonal=-1)  # [H, n, n]
            m = bc[..., None] * da  # [H, n, n]
            ds = scale * p * gamma  # [H, n, n]
            dss[c + i, :, : e - s, : e - s] = ds
            mms[c + i, :, : e - s, : e - s] = m + m.transpose(-1, -2)
            dq_c = ds @ kc + scale * torch.exp(gc)[..., None] * (doc @ h.transpose(-1, -2))
            dk_c = (ds.transpose(-1, -2) @ qc + torch.exp(last - gc)[..., None] * (uc @ dh.transpose(-1, -2))
                    - (bc * torch.exp(gc))[..., None] * (dr @ h.transpose(-1, -2)) + m @ kc + m.transpose(-1, -2) @ kc)
            dv_c = bc[..., None] * dr  # [H, n, V]
            db_c = (dr * (vc - torch.exp(gc)[..., None] * (kc @ h))).sum(-1) + (da * (kc @ kc.transpose(-1, -2))).sum(-1)
            dq[s:e], dk[s:e], dv[s:e], drs[s:e] = (x.transpose(0, 1) for x in (dq_c, dk_c, dv_c, dr))
            dbeta[s:e] = db_c.t()
            dgterm[s:e] = ((qc * dq_c).sum(-1) - (vc * dv_c).sum(-1)).t()
            dh = (torch.exp(last)[..., None] * dh + scale * (qc * torch.exp(gc)[..., None]).transpose(-1, -2) @ doc
                  - kc.transpose(-1, -2) @ ((bc * torch.exp(gc))[..., None] * dr))
        dh0s.append(dh)
        bos += length
        c += len(starts)
    return dq, dk, dv, dbeta, dgterm, torch.stack(dh0s), dhs, drs, dss, mms
