"""DeltaKATA's chunked form on the GPU (PSD maps, group width K / groups a power of two >= 16, any number of
lifted features): the kernel-trick UT recurrence walked by one program per (sequence, head, value tile), the
lifted state streamed through memory row block by row block.

The chunk form (ops/kata/README.md, "Chunk form (kernel-trick UT)") splits into chunk-local algebra that
needs no state (`deltakata_coefficients`; its `[C, C]` part `chunk_algebra` in algebra.py: PyTorch with a written-out
backward, or kernels with `KernelConfig.deltakata_algebra_kernels`) and a walk that does. With the coefficients of chunk c (C tokens, state S entering it)

    M = (I + diag(β) tril(κ̂(K, K) ⊙ D, −1))⁻¹       [C, C]   the UT inverse
    A = κ(scale Q, K) ⊙ D ⊘ n                         [C, C]   the in-chunk scores, causal
    b = β v,  α = −β e^γ / n,  ω = D[C, ·] / n,  ρ = scale² e^γ,  λ = e^Γ

the walk is, per chunk, one read, one small solve and one write:

    Yk = ψ(K) S,  Yq = ψ(Q) S                         bilinear reads, ψ never built
    U  = M (b + α ⊙ Yk)                               the pseudo-values: the chunk form's solve, a product
    O  = ρ ⊙ Yq + A U
    S ← λ S + ψ(K)ᵀ (ω ⊙ U)

and its backward, chunks last to first with dS the gradient of the state leaving the chunk:

    Y' = ψ(K) dS,  dU = Aᵀ dO + ω ⊙ Y',  Z = Mᵀ dU
    dS ← λ dS + ψ(K)ᵀ (α ⊙ Z) + ψ(Q)ᵀ (ρ ⊙ dO)

from which every coefficient's gradient is a row dot or a chunk-local product, and the keys' and queries'
gradients are lift gradients of reads (chunk.py's `kata_lift_grad_kernel`) on the entering states, which the
backward rebuilds round by round from the few the forward keeps (`state_rounds`, `deltakata_states_kernel`).
Each value column of the walk is independent of the others (the reads, the solve and the write act column by
column), so a program owns a value tile of the whole `[P, V]` state and walks the sequence alone; its slice
stays in global memory (`[P, BV]` fp32: 512 KB for M1 at K = 64 in tiles of 32) and is read and written row block
by row block of E lifted features, as the read kernel of chunk.py does (ψ(scale·q) = scale² ψ(q) for these
degree-2 maps, so the kernels read raw q and ρ carries the scale). `deltakata_walk_ref` is the PyTorch twin.
"""
import math

import torch
import triton
import triton.language as tl

from polyattn.ops.common import wants_grad
from polyattn.ops.kata.feature_maps import make_feature_map
from polyattn.ops.triton.decay import reset_limit_ref
from polyattn.ops.triton.plan import block, chunk_table, get_config, no_output, sequence_lengths
from polyattn.ops.triton.precision import (
    check_kernel_inputs, dot_f32, first_nonfinite_row, mma_fp32, mma_right_fp32, nan_rows_from, to_output, zero_rows_from,
)

from . import chunk_kernels_fit
from .algebra import chunk_algebra, fdot
from .chunk import chunk_lengths, kata_lift_grad_kernel


@triton.jit
def slot_keys(x, tok, m_t, K, E, slot, GS: tl.constexpr, BF: tl.constexpr):
    """The GS groups of rows `tok` (flat token·head rows of a `[N_tok, H, K]` tensor) that read `slot`,
    as one `[C·GS, BF]` tile in x's dtype (row t·GS + j: group slot·GS + j), zero past E and the chunk."""
    o_g = tl.arange(0, GS)
    o_f = tl.arange(0, BF)
    cols = tok[:, None, None] * K + ((slot * GS + o_g) * E)[None, :, None] + o_f[None, None, :]  # [C, GS, BF]
    b_x = tl.load(x + cols, mask=m_t[:, None, None] & (o_f < E)[None, None, :], other=0.0)
    return tl.reshape(b_x, (tok.shape[0] * GS, BF))


@triton.jit
def slot_column(x, tok, m_t, K, E, slot, e, GS: tl.constexpr):
    """Column e of every group reading `slot`: `[C, GS]` fp32."""
    o_g = tl.arange(0, GS)
    cols = tok[:, None] * K + ((slot * GS + o_g) * E + e)[None, :]  # [C, GS]
    return tl.load(x + cols, mask=m_t[:, None], other=0.0).to(tl.float32)


@triton.jit
def block_read(b_x, b_xe, b_s, F32: tl.constexpr):
    """`Σ_j x_je (X_j S_e)` over the groups j of a slot: `[C·GS, BF] @ [BF, BV]` (x exact, the fp32 state
    rows split in halves), rows weighted by the column `b_xe [C, GS]` and summed over the groups: `[C, BV]`."""
    C: tl.constexpr = b_xe.shape[0]
    GS: tl.constexpr = b_xe.shape[1]
    b_r = mma_right_fp32(b_x, b_s, F32)  # [C·GS, BV]
    return tl.sum(tl.reshape(b_r, (C, GS, b_s.shape[1])) * b_xe[:, :, None], axis=1)


@triton.jit
def block_write(b_x, b_xe, b_y, F32: tl.constexpr):
    """`Σ_j X_jᵀ diag(x_je) Y`: the write of rows `b_y [C, BV]` (fp32) into state row block e, `[BF, BV]`."""
    C: tl.constexpr = b_xe.shape[0]
    GS: tl.constexpr = b_xe.shape[1]
    b_rows = tl.reshape(b_xe[:, :, None] * b_y[:, None, :], (C * GS, b_y.shape[1]))  # [C·GS, BV]
    return mma_right_fp32(tl.trans(b_x), b_rows, F32)  # [BF, C·GS] @ [C·GS, BV]


@triton.jit
def chunk_square(x, i_c, H, i_h, C: tl.constexpr, TRANS: tl.constexpr):
    """Chunk i_c's `[C, C]` fp32 matrix of head i_h from `x [NC, H, C, C]`, transposed with TRANS."""
    o_c = tl.arange(0, C)
    base = x + (i_c * H + i_h) * C * C
    if TRANS:
        return tl.load(base + o_c[None, :] * C + o_c[:, None])
    return tl.load(base + o_c[:, None] * C + o_c[None, :])


@triton.jit
def state_write(k, tok, m_t, K, E, V, o_f, o_v, m_s, b_w, b_lam, src, dst, G: tl.constexpr, SUM: tl.constexpr,
                BF: tl.constexpr, F32: tl.constexpr):
    """`dst ← λ src + ψ(K)ᵀ W` on one `[P, BV]` state slice (src may be dst), row block by row block: the walk's
    write, and the same arithmetic when the backward recomputes the entering states (bit for bit)."""
    GS: tl.constexpr = G if SUM else 1
    SLOTS: tl.constexpr = 1 if SUM else G
    for slot in range(0, SLOTS):
        b_k = slot_keys(k, tok, m_t, K, E, slot, GS, BF)
        for e in range(0, E):
            rows = ((slot * E + e) * E + o_f)[:, None] * V + o_v[None, :]
            b_s = b_lam * tl.load(src + rows, mask=m_s, other=0.0)
            b_s += block_write(b_k, slot_column(k, tok, m_t, K, E, slot, e, GS), b_w, F32)
            tl.store(dst + rows, b_s, mask=m_s)


@triton.jit
def deltakata_walk_kernel(
    q, k, m, a, b, alpha, omega, rho, lam, st, hs, ckpt, u, yk, yq, o, chunks, cu_chunks, H, K, V, E, P,
    G: tl.constexpr, SUM: tl.constexpr, C: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, STORE_HS: tl.constexpr,
    F32: tl.constexpr,
):
    """grid: (cdiv(V, BV), N, H). The forward walk of one value tile of one sequence and head: `st [N, H, P, V]`
    fp32 holds the initial state at launch and the final one after; per chunk (rows `(bos, eos, ., .)` of
    `chunks`, sequence n's from `cu_chunks[n]`) the reads Yk, Yq, the pseudo-values U and the output O, stored
    fp32 per token (`u`, `yk`, `yq`, `o [N_tok, H, V]`), and with STORE_HS the state entering every chunk c with
    `ckpt[c] >= 0` as `hs[ckpt[c]]` (`hs [NK, H, P, V]`, the backward's checkpoints). q, k: `[N_tok, H, K]` in the
    kernels' dtype; the coefficients as the module says."""
    i_v, i_n, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    GS: tl.constexpr = G if SUM else 1  # groups reading one slot
    SLOTS: tl.constexpr = 1 if SUM else G
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_f = tl.arange(0, BF)
    m_s = (o_f < E)[:, None] & m_v[None, :]  # [BF, BV]
    p_st = st + (i_n * H + i_h).to(tl.int64) * P * V
    dtype = k.dtype.element_ty
    for i_c in range(tl.load(cu_chunks + i_n), tl.load(cu_chunks + i_n + 1)):
        t = tl.load(chunks + i_c * 4).to(tl.int64) + tl.arange(0, C)
        m_t = t < tl.load(chunks + i_c * 4 + 1)
        tok = t * H + i_h  # [C]
        m_tv = m_t[:, None] & m_v[None, :]
        i_k = tl.load(ckpt + i_c).to(tl.int64)  # this chunk's checkpoint slot, or -1
        b_yk = tl.zeros([C, BV], dtype=tl.float32)
        b_yq = tl.zeros([C, BV], dtype=tl.float32)
        for slot in range(0, SLOTS):
            b_k = slot_keys(k, tok, m_t, K, E, slot, GS, BF)  # [C·GS, BF]
            b_q = slot_keys(q, tok, m_t, K, E, slot, GS, BF)
            for e in range(0, E):
                rows = ((slot * E + e) * E + o_f)[:, None] * V + o_v[None, :]  # [BF, BV]
                b_s = tl.load(p_st + rows, mask=m_s, other=0.0)  # [BF, BV]
                if STORE_HS and i_k >= 0:
                    tl.store(hs + (i_k * H + i_h) * P * V + rows, b_s, mask=m_s)
                b_yk += block_read(b_k, slot_column(k, tok, m_t, K, E, slot, e, GS), b_s, F32)
                b_yq += block_read(b_q, slot_column(q, tok, m_t, K, E, slot, e, GS), b_s, F32)
        b_rhs = tl.load(b + tok[:, None] * V + o_v[None, :], mask=m_tv, other=0.0)  # [C, BV]
        b_rhs += tl.load(alpha + tok, mask=m_t, other=0.0)[:, None] * b_yk
        # a non-finite row (a NaN or Inf in k, v, beta or g) and every row after it enter the products as zeros,
        # so that 0 * NaN in a product never reaches the rows before it; their own outputs are made NaN
        first = first_nonfinite_row(b_rhs)
        b_u = mma_fp32(chunk_square(m, i_c, H, i_h, C, False), zero_rows_from(b_rhs, first), dtype, F32, 0)  # [C, C] @ [C, BV]
        b_o = mma_fp32(chunk_square(a, i_c, H, i_h, C, False), zero_rows_from(b_u, first), dtype, F32, 0)
        b_o = nan_rows_from(tl.load(rho + tok, mask=m_t, other=0.0)[:, None] * b_yq + b_o, first)
        b_u = nan_rows_from(b_u, first)  # the state is non-finite from here on
        out = tok[:, None] * V + o_v[None, :]  # [C, BV]
        tl.store(u + out, b_u, mask=m_tv)
        tl.store(yk + out, b_yk, mask=m_tv)
        tl.store(yq + out, b_yq, mask=m_tv)
        tl.store(o + out, to_output(b_o, o.dtype.element_ty, F32), mask=m_tv)
        b_w = b_u * tl.load(omega + tok, mask=m_t, other=0.0)[:, None]  # [C, BV]: ω ⊙ U
        state_write(k, tok, m_t, K, E, V, o_f, o_v, m_s, b_w, tl.load(lam + i_c * H + i_h), p_st, p_st, G, SUM, BF, F32)
        tl.debug_barrier()  # the next chunk reads what every thread wrote


@triton.jit
def deltakata_states_kernel(
    k, u, omega, lam, hk, hs, chunks, bounds, H, K, V, E, P,
    G: tl.constexpr, SUM: tl.constexpr, C: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, F32: tl.constexpr,
):
    """grid: (cdiv(V, BV), N, H). The states entering one round's chunks, recomputed for the backward: sequence n's
    chunks `lo <= c < hi` (row n of `bounds [N, 4]`: lo, hi, base, checkpoint) start from the checkpoint
    `hk[checkpoint]` and enter `hs [base + c - lo]`, each the previous one written with the forward's stored
    pseudo-values `u` (the forward walk's `state_write`, so bit for bit its states; the twin: the entering
    states of `deltakata_walk_ref`)."""
    i_v, i_n, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    lo = tl.load(bounds + i_n * 4)
    hi = tl.load(bounds + i_n * 4 + 1)
    base = tl.load(bounds + i_n * 4 + 2).to(tl.int64)
    if lo < hi:
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        o_f = tl.arange(0, BF)
        m_s = (o_f < E)[:, None] & m_v[None, :]
        p_k = hk + (tl.load(bounds + i_n * 4 + 3).to(tl.int64) * H + i_h) * P * V
        p_s = hs + (base * H + i_h) * P * V
        for r in range(0, P // E):
            rows = (r * E + o_f)[:, None] * V + o_v[None, :]
            tl.store(p_s + rows, tl.load(p_k + rows, mask=m_s, other=0.0), mask=m_s)
        tl.debug_barrier()
        for i_c in range(lo, hi - 1):
            t = tl.load(chunks + i_c * 4).to(tl.int64) + tl.arange(0, C)
            m_t = t < tl.load(chunks + i_c * 4 + 1)
            tok = t * H + i_h  # [C]
            b_u = tl.load(u + tok[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)  # [C, BV]
            b_w = b_u * tl.load(omega + tok, mask=m_t, other=0.0)[:, None]
            p_s = hs + ((base + i_c - lo) * H + i_h) * P * V
            state_write(k, tok, m_t, K, E, V, o_f, o_v, m_s, b_w, tl.load(lam + i_c * H + i_h), p_s, p_s + H * P * V,
                        G, SUM, BF, F32)
            tl.debug_barrier()


@triton.jit
def deltakata_walk_grad_kernel(
    q, k, m, a, do, alpha, omega, rho, lam, hs, dst, ds, z, du, yg, dlam, chunks, bounds, NC, H, K, V, E, P,
    G: tl.constexpr, SUM: tl.constexpr, C: tl.constexpr, BF: tl.constexpr, BV: tl.constexpr, F32: tl.constexpr,
):
    """grid: (cdiv(V, BV), N, H). The backward walk over one round's chunks (`bounds` as
    `deltakata_states_kernel`'s), last to first: `dst [N, H, P, V]` fp32 holds the gradient of the state leaving
    the round at launch and of the one entering it after; chunk c's `ds [base + c - lo]` gets the gradient of
    the state leaving it, `z` (Z), `du` (dU), `yg` (Y') `[N_tok, H, V]` fp32 its rows (the module's names) and
    `dlam [NV, NC, H]` this value tile's share of `<S entering, dS leaving>` (`hs`: the entering states, laid
    out as ds); `do [N_tok, H, V]` in any dtype."""
    i_v, i_n, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    GS: tl.constexpr = G if SUM else 1
    SLOTS: tl.constexpr = 1 if SUM else G
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_f = tl.arange(0, BF)
    m_s = (o_f < E)[:, None] & m_v[None, :]
    p_st = dst + (i_n * H + i_h).to(tl.int64) * P * V
    dtype = k.dtype.element_ty
    lo = tl.load(bounds + i_n * 4)
    hi = tl.load(bounds + i_n * 4 + 1)
    base = tl.load(bounds + i_n * 4 + 2).to(tl.int64)
    for cc in range(lo, hi):
        i_c = lo + hi - 1 - cc
        p_seg = ((base + i_c - lo) * H + i_h) * P * V
        t = tl.load(chunks + i_c * 4).to(tl.int64) + tl.arange(0, C)
        m_t = t < tl.load(chunks + i_c * 4 + 1)
        tok = t * H + i_h
        m_tv = m_t[:, None] & m_v[None, :]
        b_y = tl.zeros([C, BV], dtype=tl.float32)
        b_dlam = tl.zeros([BF, BV], dtype=tl.float32)
        for slot in range(0, SLOTS):
            b_k = slot_keys(k, tok, m_t, K, E, slot, GS, BF)
            for e in range(0, E):
                rows = ((slot * E + e) * E + o_f)[:, None] * V + o_v[None, :]
                b_s = tl.load(p_st + rows, mask=m_s, other=0.0)
                tl.store(ds + p_seg + rows, b_s, mask=m_s)
                b_dlam += b_s * tl.load(hs + p_seg + rows, mask=m_s, other=0.0)
                b_y += block_read(b_k, slot_column(k, tok, m_t, K, E, slot, e, GS), b_s, F32)
        tl.store(dlam + (i_v * NC + i_c) * H + i_h, tl.sum(tl.sum(b_dlam, axis=1), axis=0))
        out = tok[:, None] * V + o_v[None, :]
        b_do = tl.load(do + out, mask=m_tv, other=0.0).to(tl.float32)  # [C, BV]
        b_du = mma_fp32(chunk_square(a, i_c, H, i_h, C, True), b_do, dtype, F32, 0)  # Aᵀ dO
        b_du += tl.load(omega + tok, mask=m_t, other=0.0)[:, None] * b_y
        b_z = mma_fp32(chunk_square(m, i_c, H, i_h, C, True), b_du, dtype, F32, 0)  # Mᵀ dU
        tl.store(z + out, b_z, mask=m_tv)
        tl.store(du + out, b_du, mask=m_tv)
        tl.store(yg + out, b_y, mask=m_tv)
        b_wk = b_z * tl.load(alpha + tok, mask=m_t, other=0.0)[:, None]  # [C, BV]: α ⊙ Z
        b_wq = b_do * tl.load(rho + tok, mask=m_t, other=0.0)[:, None]  # ρ ⊙ dO
        b_lam = tl.load(lam + i_c * H + i_h)
        for slot in range(0, SLOTS):
            b_k = slot_keys(k, tok, m_t, K, E, slot, GS, BF)
            b_q = slot_keys(q, tok, m_t, K, E, slot, GS, BF)
            for e in range(0, E):
                rows = ((slot * E + e) * E + o_f)[:, None] * V + o_v[None, :]
                b_s = b_lam * tl.load(p_st + rows, mask=m_s, other=0.0)
                b_s += block_write(b_k, slot_column(k, tok, m_t, K, E, slot, e, GS), b_wk, F32)
                b_s += block_write(b_q, slot_column(q, tok, m_t, K, E, slot, e, GS), b_wq, F32)
                tl.store(p_st + rows, b_s, mask=m_s)
        tl.debug_barrier()


@triton.jit
def deltakata_chunk_grads_kernel(du, b, alpha, yk, do, u, dm, da, chunks, H, V, C: tl.constexpr, BV: tl.constexpr):
    """grid: (NC, H). The walk's gradients of chunk i_c's `[C, C]` coefficients from its rows (flat `[N_tok, H, V]`,
    read through the chunk table, zero past the chunk's end): `dm = dU (b + α ⊙ Yk)ᵀ`, `da = dO Uᵀ` (`[NC, H, C, C]`
    fp32; dO in any dtype), products to about fp32 precision (`fdot`) over value tiles of BV."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t = tl.load(chunks + i_c * 4).to(tl.int64) + tl.arange(0, C)
    m_t = t < tl.load(chunks + i_c * 4 + 1)
    tok = t * H + i_h
    b_alpha = tl.load(alpha + tok, mask=m_t, other=0.0)
    acc_m = tl.zeros([C, C], dtype=tl.float32)
    acc_a = tl.zeros([C, C], dtype=tl.float32)
    for v0 in range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        rows = tok[:, None] * V + o_v[None, :]
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        b_rhs = tl.load(b + rows, mask=m_tv, other=0.0) + b_alpha[:, None] * tl.load(yk + rows, mask=m_tv, other=0.0)
        acc_m += fdot(tl.load(du + rows, mask=m_tv, other=0.0), tl.trans(b_rhs))
        acc_a += fdot(tl.load(do + rows, mask=m_tv, other=0.0).to(tl.float32), tl.trans(tl.load(u + rows, mask=m_tv, other=0.0)))
    o_c = tl.arange(0, C)
    out = (i_c * H + i_h).to(tl.int64) * C * C + o_c[:, None] * C + o_c[None, :]
    tl.store(dm + out, acc_m)
    tl.store(da + out, acc_a)


def chunk_grads(held: list, b, alpha, yk, do, u, table, chunk_size: int) -> tuple:
    """`(dm, da) [NC, H, C, C]` fp32, the walk's gradients of M and A from its rows (flat, `deltakata_chunk_grads_kernel`'s
    docstring): the kernel with `KernelConfig.deltakata_algebra_kernels`, else its twin (PyTorch products of chunked
    copies). dU comes as the one entry of `held`, which is emptied, so that the twin frees it before dA is formed.
    Every row is `[N_tok, H, V]` (α `[N_tok, H]`), contiguous."""
    du = held.pop()
    N_tok, H, V = u.shape
    if get_config().deltakata_algebra_kernels:
        dm, da = (u.new_empty(table.shape[0], H, chunk_size, chunk_size) for _ in range(2))
        deltakata_chunk_grads_kernel[(table.shape[0], H)](du, b, alpha, yk, do, u, dm, da, table, H, V, C=chunk_size,
                                                          BV=min(block(V), 32), num_warps=8)
        return dm, da
    idx, mask = chunk_layout(table, chunk_size, N_tok)
    rhs = b + alpha[..., None] * yk  # [N_tok, H, V]
    dm = to_chunks(du, idx, mask) @ to_chunks(rhs, idx, mask).transpose(-1, -2)  # [NC, H, C, V] @ [NC, H, V, C]
    del rhs, du
    da = to_chunks(do, idx, mask).float() @ to_chunks(u, idx, mask).transpose(-1, -2)  # dO chunked in its dtype, then widened
    return dm, da


def deltakata_walk_ref(q, k, m, a, b, alpha, omega, rho, lam, h0, seq_lens: tuple, chunk_size: int, fmap):
    """Twin of `deltakata_walk_kernel` in float64 on flattened tokens: `(o, ht, hs, u, yk, yq)` as the kernel
    stores them (hs: the state entering every chunk). Differentiable, so its autograd is the backward's twin."""
    N_tok, H, _ = k.shape
    V = b.shape[-1]
    d = [x.double() for x in (q, k, m, a, b, alpha, omega, rho, lam)]
    q, k, m, a, b, alpha, omega, rho, lam = d
    outs = {n: [] for n in ("o", "u", "yk", "yq")}
    hs, finals, c, bos = [], [], 0, 0
    for n, length in enumerate(seq_lens):
        S = torch.zeros(H, fmap.dim(), V, dtype=torch.float64, device=k.device) if h0 is None else h0[n].double()
        for size in chunk_lengths((length,), chunk_size):
            hs.append(S)
            rows = slice(bos, bos + size)
            kc, qc = k[rows].transpose(0, 1), q[rows].transpose(0, 1)  # [H, n, K]
            yk, yq = fmap.read(kc, S), fmap.read(qc, S)  # [H, n, V]
            rhs = b[rows].transpose(0, 1) + alpha[rows].t()[..., None] * yk
            u = m[c][:, :size, :size] @ rhs  # [H, n, n] @ [H, n, V]
            o = rho[rows].t()[..., None] * yq + a[c][:, :size, :size] @ u
            S = lam[c][:, None, None] * S + fmap.write(kc, omega[rows].t()[..., None] * u)
            for name, x in zip(("o", "u", "yk", "yq"), (o, u, yk, yq)):
                outs[name].append(x.transpose(0, 1))
            c, bos = c + 1, bos + size
        finals.append(S)
    cat = {n: torch.cat(x) if x else k.new_zeros(0, H, V, dtype=torch.float64) for n, x in outs.items()}
    return cat["o"], torch.stack(finals), torch.stack(hs), cat["u"], cat["yk"], cat["yq"]


def chunk_layout(table: torch.Tensor, chunk_size: int, N_tok: int):
    """`(index [NC, C], mask [NC, C])`: the tokens of every chunk (`plan.chunk_table` rows), padded to C."""
    idx = table[:, :1].long() + torch.arange(chunk_size, device=table.device)  # [NC, C]
    mask = idx < table[:, 1:2]
    return idx.clamp(max=max(N_tok - 1, 0)), mask


def to_chunks(x: torch.Tensor, idx: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Flat tokens `[N_tok, H, ...]` as chunks `[NC, H, C, ...]`, zero past each chunk's end: one gather into a
    contiguous tensor (products of it copy nothing), the rows past the end (the next sequence's tokens) filled with
    zeros in place, not multiplied by them: a non-finite token must not reach another sequence's chunk."""
    heads = torch.arange(x.shape[1], device=x.device)[:, None]  # [H, 1]
    y = x[idx[:, None, :], heads]  # [NC, H, C, ...]
    return y.masked_fill_(~mask.view(mask.shape[0], 1, mask.shape[1], *(1,) * (x.dim() - 2)), 0.0)


def from_chunks(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Inverse of `to_chunks`: `[NC, H, C, ...]` -> flat tokens `[N_tok, H, ...]` (chunks lie in token order)."""
    return x.movedim(2, 1)[mask]


def deltakata_coefficients(q, k, v, beta, g, *, fmap, scale: float, eps: float, idx, mask):
    """The chunk-local algebra of the walk (module docstring), from flat fp32 tokens `q, k [N_tok, H, K]`,
    `beta`, `g [N_tok, H]` (g None: no decay) and `v [N_tok, H, V]` (any float dtype: b = β v is formed in fp32, and
    autograd keeps v as it came, not an fp32 copy): `(M, A [NC, H, C, C], b [N_tok, H, V], α, ω, ρ [N_tok, H],
    λ [NC, H])`, differentiable (`chunk_algebra`'s written-out backward for the `[C, C]` part). Padded rows have
    k = 0 and β = 0: they neither read nor write."""
    kc, qc, bc = (to_chunks(x, idx, mask) for x in (k, q, beta))  # [NC, H, C, ...]
    gc = torch.zeros_like(bc) if g is None else to_chunks(reset_limit_ref(g), idx, mask)  # [NC, H, C]
    M, A, alpha, omega, rho, lam = chunk_algebra(kc, qc, bc, gc, fmap.groups, fmap.combine, scale, eps)
    alpha, omega, rho = (from_chunks(x, mask) for x in (alpha, omega, rho))
    return M, A, beta[..., None] * v, alpha, omega, rho, lam


def value_tile(heads: int, V: int, device) -> int:
    """The walks' value tile: `KernelConfig.deltakata_block_v` (at most the padded V), halved down to 16 while the
    `heads` (sequences x heads) walks would leave multiprocessors idle (on the H200 at 65,536 tokens, M1 in chunks of
    64: a tile of 32 took 38.7 ms forward for 8 sequences of 8K and 75.5 for 2 of 32K, one of 16: 55.0 and 61.6)."""
    BV = min(block(V), get_config().deltakata_block_v)
    units = torch.cuda.get_device_properties(device).multi_processor_count if torch.device(device).type == "cuda" else 1
    while BV > 16 and heads * triton.cdiv(V, BV) < units:
        BV //= 2
    return BV


def state_interval(seq_lens: tuple, chunk_size: int) -> int:
    """R, the chunks between the entering states the forward keeps for the backward (`KernelConfig.
    deltakata_state_interval`, or by default ⌈√(c / 2)⌉ for the longest sequence's c chunks). The backward walks
    rounds of R chunks of every sequence, last round first, recomputing each round's entering states from its
    checkpoint into a buffer of R states a sequence, beside one as large for their gradients: c / R + 2R states a
    sequence instead of 2c, the least at that R. R = 1 keeps every state and recomputes none (2c states, the
    fastest backward)."""
    fixed = get_config().deltakata_state_interval
    if fixed is not None:
        if fixed < 1:
            raise ValueError(f"KernelConfig: expected deltakata_state_interval >= 1 or None, got {fixed}")
        return fixed
    longest = max([1] + [triton.cdiv(n, chunk_size) for n in seq_lens])
    return max(1, math.ceil(math.sqrt(longest / 2)))


def checkpoint_counts(seq_lens: tuple, chunk_size: int) -> list:
    """Per sequence, how many entering states its forward keeps: one every `state_interval` chunks from its first."""
    R = state_interval(seq_lens, chunk_size)
    return [triton.cdiv(len(chunk_lengths((n,), chunk_size)), R) for n in seq_lens]


def state_rounds(seq_lens: tuple, chunk_size: int, block_t: int, device) -> dict:
    """The checkpoint layout and the backward's rounds (`state_interval`), cached like plan's tables: `ckpt [NC]`
    int32 (chunk c's checkpoint slot, or -1), `NK` checkpoints, `NS` states in the round buffers, and per round,
    first to last, `bounds [N, 4]` int32 (lo, hi, base, checkpoint: the rows of the states and reverse-walk
    kernels) and the lift-gradient kernel's `tiles [NT, 4]` int32 (bos, eos, slot in the round buffer, 0) of at
    most block_t tokens of one chunk each. At R = 1 every entering state is a checkpoint (`recompute` False):
    one round over all chunks whose buffer slots are the checkpoints' own, the fastest backward."""
    R = state_interval(seq_lens, chunk_size)
    key = (seq_lens, chunk_size, block_t, R, str(device))
    if key in _ROUNDS:
        return _ROUNDS[key]
    pieces = [chunk_lengths((n,), chunk_size) for n in seq_lens]  # each sequence's chunk lengths
    counts = checkpoint_counts(seq_lens, chunk_size)
    ckpt, NK, rounds, NS = [], 0, [], 1
    for sizes, count in zip(pieces, counts):
        ckpt += [NK + j // R if j % R == 0 else -1 for j in range(len(sizes))]
        NK += count
    longest = max([0] + [len(x) for x in pieces])
    span = R if R > 1 else max(1, longest)  # R = 1 keeps every state: one round reads them all, nothing recomputed
    for r in range(triton.cdiv(longest, span)):
        rows, tiles, c0, k0, base, bos = [], [], 0, 0, 0, 0
        for sizes, count in zip(pieces, counts):
            lo, hi = c0 + min(r * span, len(sizes)), c0 + min((r + 1) * span, len(sizes))
            rows.append((lo, hi, base, k0 + r * span // R if lo < hi else 0))
            t = bos + sum(sizes[:lo - c0])
            for c in range(lo, hi):
                size = sizes[c - c0]
                tiles += [(t + s, t + min(s + block_t, size), base + c - lo, 0) for s in range(0, size, block_t)]
                t += size
            base += hi - lo
            c0, k0, bos = c0 + len(sizes), k0 + count, bos + sum(sizes)
        NS = max(NS, base)
        rounds.append(dict(bounds=torch.tensor(rows, dtype=torch.int32).to(device),
                           tiles=torch.tensor(tiles, dtype=torch.int32).view(-1, 4).to(device), NT=len(tiles)))
    if len(_ROUNDS) > 64:
        _ROUNDS.clear()
    _ROUNDS[key] = dict(ckpt=torch.tensor(ckpt, dtype=torch.int32).to(device), NK=NK, NS=NS, rounds=rounds, recompute=R > 1)
    return _ROUNDS[key]


_ROUNDS: dict = {}


def _walk_plan(seq_lens, H, K, V, groups: int, combine: str, device, dtype) -> dict:
    """The launches' shared arguments: chunk table, sizes, constexprs, the checkpoints and rounds (`state_rounds`)."""
    config = get_config()
    C = config.deltakata_chunk_size
    E = K // groups
    if C < 16 or C & (C - 1):
        raise ValueError(f"KernelConfig: expected deltakata_chunk_size a power of two >= 16, got {C}")
    if not chunk_kernels_fit(K, groups, 16):
        raise ValueError(f"DeltaKATA impl='triton_chunk': expected K / groups a power of two >= 16, got K = {K}, groups = {groups}")
    table, cu_chunks, NC = chunk_table(tuple(seq_lens), C, device)
    P = make_feature_map("psd", K, groups, combine).dim()
    BT = min(config.kata_read_block, C)
    return dict(
        C=C, table=table, cu_chunks=cu_chunks, NC=NC, sizes=(H, K, V, E, P), BV=value_tile(len(seq_lens) * H, V, device),
        meta=dict(G=groups, SUM=combine == "sum", F32=dot_f32(dtype)), warps=config.kata_chunk_warps,
        BT=BT, stages=config.kata_read_stages, rounds=state_rounds(tuple(seq_lens), C, BT, device),
    )


def _lift_grad(x, y, weight, states, zs, plan: dict, tiles: dict, into: torch.Tensor) -> None:
    """Adds `∇_x Σ_t weight_t ψ(x_t)ᵀ states[c(t)] y_t` over one round's tiles (`state_rounds`) to `into` (fp32):
    chunk.py's lift-gradient kernel (rows `y` in x's dtype enter it exact, fp32 rows split in two halves)."""
    H, K, V, E, P = plan["sizes"]
    kata_lift_grad_kernel[(tiles["NT"], H)](
        x, y, weight, weight, states, zs, into, None, tiles["tiles"], H, K, V, E, P, BF=block(E), BT=plan["BT"], BV=block(V),
        ACCUMULATE=True, READ=False, num_warps=plan["warps"], num_stages=plan["stages"], **plan["meta"],
    )


@torch.library.custom_op("polyattn::deltakata_walk", mutates_args=())
def deltakata_walk(
    q: torch.Tensor, k: torch.Tensor, m: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor,
    omega: torch.Tensor, rho: torch.Tensor, lam: torch.Tensor, h0: torch.Tensor | None, seq_lens: list[int], groups: int,
    combine: str, dtype: torch.dtype, store_hs: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`deltakata_walk_kernel` as a custom op on flat fp32 tokens (q, k enter the kernel in `dtype`, exact for
    values that came from it): `(o, ht [N, H, P, V], hs [NK, H, P, V] the checkpoints (`state_rounds`) with
    store_hs (else empty), u, yk, yq)`,
    o `[N_tok, H, V]` in `dtype` (rounded once; its cotangent then enters the lift gradient exact), the rows fp32."""
    N_tok, H, K = k.shape
    V = b.shape[-1]
    plan = _walk_plan(seq_lens, H, K, V, groups, combine, k.device, dtype)
    P = plan["sizes"][-1]
    N = len(seq_lens)
    m, a = m.contiguous(), a.contiguous()  # the kernels read them row-major
    st = torch.zeros(N, H, P, V, dtype=torch.float32, device=k.device) if h0 is None else h0.float().clone()
    rounds = plan["rounds"]
    hs = torch.empty(rounds["NK"], H, P, V, dtype=torch.float32, device=k.device) if store_hs else no_output(k)
    u, yk, yq = (torch.empty(N_tok, H, V, dtype=torch.float32, device=k.device) for _ in range(3))
    o = torch.empty(N_tok, H, V, dtype=dtype, device=k.device)
    deltakata_walk_kernel[(triton.cdiv(V, plan["BV"]), N, H)](
        q.to(dtype), k.to(dtype), m, a, b, alpha, omega, rho, lam, st, hs, rounds["ckpt"], u, yk, yq, o, plan["table"],
        plan["cu_chunks"], *plan["sizes"], C=plan["C"], BF=block(plan["sizes"][3]), BV=plan["BV"], STORE_HS=store_hs,
        num_warps=plan["warps"], **plan["meta"],
    )
    return o, st, hs, u, yk, yq


@deltakata_walk.register_fake
def _(q, k, m, a, b, alpha, omega, rho, lam, h0, seq_lens, groups, combine, dtype, store_hs):
    N_tok, H, K = k.shape
    V = b.shape[-1]
    P = make_feature_map("psd", K, groups, combine).dim()
    NK = sum(checkpoint_counts(tuple(seq_lens), get_config().deltakata_chunk_size))
    hs = k.new_empty(NK, H, P, V) if store_hs else no_output(k)
    rows = [k.new_empty(N_tok, H, V) for _ in range(3)]
    return k.new_empty(N_tok, H, V, dtype=dtype), k.new_empty(len(seq_lens), H, P, V), hs, *rows


@torch.library.custom_op("polyattn::deltakata_walk_backward", mutates_args=())
def deltakata_walk_backward(
    do: torch.Tensor, dht: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, m: torch.Tensor, a: torch.Tensor,
    b: torch.Tensor, alpha: torch.Tensor, omega: torch.Tensor, rho: torch.Tensor, lam: torch.Tensor, hs: torch.Tensor,
    u: torch.Tensor, yk: torch.Tensor, yq: torch.Tensor, seq_lens: list[int], groups: int, combine: str, dtype: torch.dtype,
    want_dh0: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor]:
    """The walk's backward (module docstring): `(dq, dk, dM, dA, db, dα, dω, dρ, dλ, dh0)`, all fp32 (dh0 empty
    unless want_dh0); q, k in `dtype` (the kernels' tensor-core operands, as the forward saved them). The reverse
    kernel gives the state gradients and the rows Z, dU, Y'; the coefficients' gradients are row dots and
    chunk-local products of them; dq and dk are lift gradients of the reads (on the entering states) and of the
    write (on the state gradients). Round by round (`state_rounds`), last first: the round's entering states
    recomputed from the checkpoints `hs`, its reverse walk, its lift gradients."""
    N_tok, H, K = k.shape
    V = b.shape[-1]
    plan = _walk_plan(seq_lens, H, K, V, groups, combine, k.device, dtype)
    P = plan["sizes"][-1]
    N = len(seq_lens)
    m, a = m.contiguous(), a.contiguous()
    dst = torch.zeros(N, H, P, V, dtype=torch.float32, device=k.device) if dht is None else dht.float().clone()
    layout = plan["rounds"]
    NS = layout["NS"]
    ds = torch.empty(NS, H, P, V, dtype=torch.float32, device=k.device)
    states = torch.empty_like(ds) if layout["recompute"] else hs
    z, du, yg = (torch.empty(N_tok, H, V, dtype=torch.float32, device=k.device) for _ in range(3))
    NV = triton.cdiv(V, plan["BV"])
    dlam = torch.empty(NV, plan["NC"], H, dtype=torch.float32, device=k.device)
    zs = torch.zeros(NS, H, P, dtype=torch.float32, device=k.device)  # no normaliser column
    dq = torch.zeros(N_tok, H, K, dtype=torch.float32, device=k.device)
    dk = torch.zeros_like(dq)
    do = do.contiguous()
    launch = dict(C=plan["C"], BF=block(plan["sizes"][3]), BV=plan["BV"], num_warps=plan["warps"], **plan["meta"])
    for rnd in reversed(layout["rounds"]):
        if layout["recompute"]:
            deltakata_states_kernel[(NV, N, H)](
                k, u, omega, lam, hs, states, plan["table"], rnd["bounds"], *plan["sizes"], **launch,
            )
        deltakata_walk_grad_kernel[(NV, N, H)](
            q, k, m, a, do, alpha, omega, rho, lam, states, dst, ds, z, du, yg, dlam, plan["table"], rnd["bounds"],
            plan["NC"], *plan["sizes"], **launch,
        )
        _lift_grad(q, do, rho, states, zs, plan, rnd, dq)  # the read Yq
        _lift_grad(k, z, alpha, states, zs, plan, rnd, dk)  # the read Yk
        _lift_grad(k, u, omega, ds, zs, plan, rnd, dk)  # the write
    # the chunk-local products below set the peak: every buffer and row goes as soon as nothing reads it
    del ds, states, zs
    if not want_dh0:
        dst = no_output(k)
    dalpha, domega, drho = (z * yk).sum(-1), (yg * u).sum(-1), (do.float() * yq).sum(-1)  # [N_tok, H]
    del yg
    held = [du]
    del du
    dm, da = chunk_grads(held, b, alpha, yk, do, u, plan["table"], plan["C"])
    return (dq, dk, dm, da, z, dalpha, domega, drho, dlam.sum(0), dst)


@deltakata_walk_backward.register_fake
def _(do, dht, q, k, m, a, b, alpha, omega, rho, lam, hs, u, yk, yq, seq_lens, groups, combine, dtype, want_dh0):
    N_tok, H, K = k.shape
    P = make_feature_map("psd", K, groups, combine).dim()
    dh0 = b.new_empty(len(seq_lens), H, P, b.shape[-1]) if want_dh0 else no_output(b)
    return (b.new_empty(q.shape), b.new_empty(k.shape), m.new_empty(m.shape), a.new_empty(a.shape), b.new_empty(b.shape),
            alpha.new_empty(alpha.shape), omega.new_empty(omega.shape), rho.new_empty(rho.shape), lam.new_empty(lam.shape),
            dh0)


def _walk_setup_context(ctx, inputs, output):
    q, k, m, a, b, alpha, omega, rho, lam, h0, seq_lens, groups, combine, dtype, store_hs = inputs
    _, _, hs, u, yk, yq = output
    # q, k kept as the kernels read them (in dtype), not as the fp32 inputs: on bf16 half the bytes, no copy in the backward
    ctx.save_for_backward(q.to(dtype), k.to(dtype), m, a, b, alpha, omega, rho, lam, hs, u, yk, yq)
    ctx.options = (seq_lens, groups, combine, dtype)
    ctx.store_hs = store_hs
    ctx.set_materialize_grads(False)  # no zero cotangents filled for the saved intermediates (hs: every chunk's lifted state)


def _walk_backward(ctx, do, dht, _, __, ___, ____):
    if not ctx.store_hs:
        raise RuntimeError("deltakata_walk: differentiated without the entering states (store_hs=False)")
    saved = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(saved[-1])
    want_dh0 = ctx.needs_input_grad[9]
    dq, dk, dm, da, db, dalpha, domega, drho, dlam, dh0 = deltakata_walk_backward(
        do.contiguous(), None if dht is None else dht.contiguous(), *saved, *ctx.options, want_dh0,
    )
    return (dq, dk, dm, da, db, dalpha, domega, drho, dlam, dh0 if want_dh0 else None,
            None, None, None, None, None)


deltakata_walk.register_autograd(_walk_backward, setup_context=_walk_setup_context)


def deltakata_chunk_fused(
    q, k, v, beta, g=None, *, groups, combine, eps, scale, initial_state=None, output_final_state=False, cu_seqlens=None,
):
    """Triton chunked form of DeltaKATA for the PSD maps (inputs validated, scale resolved), forward and backward:
    the chunk-local coefficients (`chunk_algebra`, algebra.py), the walk on the kernels. q, k
    `[B, T, H, K]`, v `[B, T, H, V]`, beta, g `[B, T, H]`; initial_state `S [N, H, P, V]`; cu_seqlens with B == 1. q, k,
    beta and g enter in fp32 copies (one rounding of each gradient), v as it is (b = β v formed in fp32), q and k the
    kernels' tensor cores in their own dtype. Returns `(o [B, T, H, V] in q's dtype, S [N, H, P, V] fp32 or None)`."""
    check_kernel_inputs(q)
    B, T, H, K = q.shape
    V = v.shape[-1]
    seq_lens = sequence_lengths(cu_seqlens, B, T)
    fmap = make_feature_map("psd", K, groups, combine)
    plan = _walk_plan(seq_lens, H, K, V, groups, combine, q.device, q.dtype)
    h0 = None if initial_state is None else initial_state.float().contiguous()
    if q.numel() == 0:
        state = torch.zeros(len(seq_lens), H, fmap.dim(), V, dtype=torch.float32, device=q.device) if h0 is None else h0
        return v.new_zeros(B, T, H, V).to(q.dtype), (state.clone() if output_final_state else None)
    flat = [None if x is None else x.reshape(B * T, H, *x.shape[3:]).float().contiguous() for x in (q, k, beta, g)]  # [B*T, H, ...]
    idx, mask = chunk_layout(plan["table"], plan["C"], B * T)
    coefs = deltakata_coefficients(flat[0], flat[1], v.reshape(B * T, H, V), *flat[2:], fmap=fmap, scale=float(scale), eps=float(eps),
                                   idx=idx, mask=mask)
    store_hs = torch.is_grad_enabled() and wants_grad((q, k, v, beta, g, initial_state))
    o, ht, _, _, _, _ = deltakata_walk(flat[0], flat[1], *coefs, h0, list(seq_lens), groups, combine, q.dtype, store_hs)
    return o.view(B, T, H, V), (ht if output_final_state else None)


__all__ = [
    "checkpoint_counts", "deltakata_chunk_fused", "deltakata_coefficients",
    "deltakata_states_kernel", "deltakata_walk", "deltakata_walk_grad_kernel", "deltakata_walk_kernel",
    "deltakata_walk_ref", "state_interval", "state_rounds",
]
