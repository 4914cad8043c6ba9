"""Stages 2 and 3 of the delta rule forward: the chunk-to-chunk recurrence and the outputs.

Together they implement `delta_rule_chunk` (ops/delta/chunk.py). Per chunk, with `gc` the
chunk-local cumulative log-decay, Tinv the solved matrix of wy.py and h the [K, V] fp32 state
entering the chunk (ops/delta/README.md, "Chunk form"):

    R  = diag(beta) (V - diag(exp(gc)) K h),   U = Tinv R                 pseudo-values [C, V]
    h' = exp(gc_last) h + K^T diag(exp(gc_last - gc)) U
    O  = (scale Q K^T ⊙ Γ ⊙ L) U + diag(exp(gc)) (scale Q) h

`delta_states_kernel` runs the first two lines, one program per sequence, head and value tile
with the state on chip (three products per chunk on its dependent path), and forms O as it goes
or stores h entering every chunk (`hs: [NC, H, K, V]`) and U (`us: [N_tok, H, V]`), both fp32,
for `delta_outputs_kernel`, which forms O for every chunk in parallel (function.fused_outputs
picks; the backward reads hs and us either way). Every fp32 operand of the recurrence (state, R,
U) enters the tensor cores split in input-dtype halves, exact to ~2^-16 (`KernelConfig.delta_fp32_dot`
picks other modes); the two products that only form O take theirs (the score tile, U, h) rounded
(`KernelConfig.delta_out_dot`). `delta_forward_ref` is the PyTorch twin of both.
"""
import torch
import triton
import triton.language as tl

from polyattn.ops.triton.decay import chunk_decay, chunk_segsum, chunk_suffix, select_scores
from polyattn.ops.triton.precision import (
    SPLIT, first_nonfinite_row, mma, mma_fp32, mma_right_acc, mma_right_fp32, nan_rows_from, to_output,
)


@triton.jit
def sequence_tile(seqs, cu_chunks, K, V, BK: tl.constexpr, BV: tl.constexpr):
    """This program's sequence, head and state tile in a (value tile, sequence, head) grid:
    `(i_n, i_h, bos, eos, c0, o_k, m_k, o_v, m_v, m_s, state_tile)` with `c0` the sequence's first
    chunk and `state_tile` the [BK, BV] offsets inside one [K, V] state."""
    return sequence_tile_of(tl.program_id(0), tl.program_id(1), tl.program_id(2), seqs, cu_chunks, K, V, BK, BV)


@triton.jit
def sequence_tile_of(i_v, i_n, i_h, seqs, cu_chunks, K, V, BK: tl.constexpr, BV: tl.constexpr):
    """`sequence_tile` for value tile i_v of sequence i_n and head i_h (a grid with more on its first axis)."""
    bos = tl.load(seqs + i_n * 4).to(tl.int64)
    eos = tl.load(seqs + i_n * 4 + 1).to(tl.int64)
    c0 = tl.load(cu_chunks + i_n).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_s = m_k[:, None] & m_v[None, :]
    return i_n, i_h, bos, eos, c0, o_k, m_k, o_v, m_v, m_s, o_k[:, None] * V + o_v[None, :]


@triton.jit
def chunk_scores(b_q, b_k, b_g, b_gc, b_last, scale, F32: tl.constexpr):
    """The chunk's score tile `A_qk = scale Q K^T ⊙ exp2(D)` [C, C] (0 above the diagonal, by select:
    a non-finite key reaches no earlier row) from q, k [C, BK] and the chunk's log2-decays (ops/triton/decay.py)."""
    return select_scores(mma(b_q, tl.trans(b_k), F32), chunk_segsum(b_g, b_gc, b_last, False, F32), scale)  # [C, BK] @ [BK, C]


@triton.jit
def chunk_rows(chunks, i_ch, C: tl.constexpr):
    """Chunk `i_ch`'s rows: `(bos, eos, o_t, t, m_t)`, `t = bos + o_t` masked by `m_t = t < eos`."""
    bos = tl.load(chunks + i_ch * 4).to(tl.int64)
    eos = tl.load(chunks + i_ch * 4 + 1).to(tl.int64)
    o_t = tl.arange(0, C)
    t = bos + o_t
    return bos, eos, o_t, t, t < eos


@triton.jit
def chunk_program(chunks, C: tl.constexpr):
    """This program's chunk and head in a (chunk, head, ...) grid and the chunk's rows:
    `(i_ch, i_h, bos, eos, o_t, t, m_t)` (`chunk_rows`)."""
    i_ch, i_h = tl.program_id(0), tl.program_id(1)
    bos, eos, o_t, t, m_t = chunk_rows(chunks, i_ch, C)
    return i_ch, i_h, bos, eos, o_t, t, m_t


@triton.jit
def chunk_tile_program(chunks, tiles, C: tl.constexpr):
    """This program's tile, chunk and head in a (tiles * chunks, head) grid, the tile axis fastest so that
    the `tiles` programs of one chunk run side by side and share its loads through L2:
    `(i_tile, i_ch, i_h, bos, eos, o_t, t, m_t)`."""
    i_tile, i_ch, i_h = tl.program_id(0) % tiles, tl.program_id(0) // tiles, tl.program_id(1)
    bos, eos, o_t, t, m_t = chunk_rows(chunks, i_ch, C)
    return i_tile, i_ch, i_h, bos, eos, o_t, t, m_t


@triton.jit
def value_rows(x, t, H, i_h, V, o_v, m_tv, LEAD: tl.constexpr):
    """Rows `t` of `x [N_tok, H, V - LEAD]` in the state's value columns `o_v` ([C, BV], masked by `m_tv`): the
    state's first LEAD columns read zeros (LEAD = K: a transition's identity, `function.entering_states`)."""
    if LEAD == 0:
        return tl.load(x + (t * H + i_h)[:, None] * V + o_v[None, :], mask=m_tv, other=0.0)
    cols = o_v - LEAD  # [BV]: x's columns, negative on the identity's
    return tl.load(x + (t * H + i_h)[:, None] * (V - LEAD) + cols[None, :], mask=m_tv & (cols >= 0)[None, :], other=0.0)


@triton.jit
def chunk_outputs(b_q, b_k, b_g, b_gc, b_last, b_u, b_h, first, scale, F32: tl.constexpr, OUT_DOT: tl.constexpr):
    """`O = A_qk U + diag(exp(gc)) (scale Q) h` [C, BV] of one chunk and value tile from U [C, BV] and the
    entering state h [BK, BV] (both fp32); the rows from the chunk's first non-finite token `first` on are NaN.
    OUT_DOT (`FP32_DOTS`, `KernelConfig.delta_out_dot`): 0 the fp32 operands split, 2 rounded (one product each)."""
    b_att = chunk_scores(b_q, b_k, b_g, b_gc, b_last, scale, F32)  # [C, C]
    b_o = mma_fp32(b_att, b_u, b_q.dtype, F32, OUT_DOT)  # [C, C] @ [C, BV] -> [C, BV]
    b_qh = mma_right_acc(b_q, b_h, tl.zeros_like(b_u), F32, OUT_DOT)  # [C, BK] @ [BK, BV] -> [C, BV]
    b_o += b_qh * (tl.exp2(b_gc) * scale)[:, None]  # [C, BV]
    return nan_rows_from(b_o, first)  # [C, BV]


@triton.jit
def delta_states_kernel(
    q, k, v, beta, g, t_inv, firsts, seqs, cu_chunks, h0, ht, hs, us, out, scale, H, K, V,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, USE_H0: tl.constexpr,
    STORE_HT: tl.constexpr, SAVE: tl.constexpr, OUT: tl.constexpr, F32: tl.constexpr, FP32_DOT: tl.constexpr,
    OUT_DOT: tl.constexpr, LEAD: tl.constexpr,
):
    """grid: (cdiv(V, BV), N, H). The fp32 state tile [BK, BV] stays in registers for the whole
    sequence; per chunk three products on the dependent path, `K h`, `Tinv R` and `K^T U`. With SAVE
    the state entering the chunk (`hs`) and U (`us`) are stored for the backward (and for
    `delta_outputs_kernel`); with OUT the chunk's outputs are formed here, off the dependent path. LEAD: the
    state's first LEAD columns see no values (`v` has V - LEAD columns; `value_rows`).
    The chunk's rows from its first non-finite token (`firsts`, wy.py: key, beta or log-decay; or a value
    of this tile) enter R as zeros and leave a NaN state: every later output of the tile is NaN."""
    i_n, i_h, bos, eos, c0, o_k, m_k, o_v, m_v, m_s, state_tile = sequence_tile(seqs, cu_chunks, K, V, BK, BV)
    o_t = tl.arange(0, C)
    if USE_H0:
        b_h = tl.load(h0 + (i_n * H + i_h) * K * V + state_tile, mask=m_s, other=0.0)  # [BK, BV]
    else:
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
    for i in range(0, tl.cdiv(eos - bos, C)):
        t = bos + i * C + o_t
        m_t = t < eos
        if SAVE:
            tl.store(hs + ((c0 + i) * H + i_h) * K * V + state_tile, b_h, mask=m_s)
        row_k = (t * H + i_h)[:, None] * K + o_k[None, :]  # [C, BK]
        m_tk = m_t[:, None] & m_k[None, :]
        b_k = tl.load(k + row_k, mask=m_tk, other=0.0)  # [C, BK]
        row_v = (t * H + i_h)[:, None] * V + o_v[None, :]  # [C, BV]
        m_tv = m_t[:, None] & m_v[None, :]
        b_v = value_rows(v, t, H, i_h, V, o_v, m_tv, LEAD).to(tl.float32)  # [C, BV]
        b_beta = tl.load(beta + t * H + i_h, mask=m_t, other=0.0).to(tl.float32)  # [C]
        b_tinv = tl.load(t_inv + (t * H + i_h)[:, None] * C + o_t[None, :], mask=m_t[:, None], other=0.0)  # [C, C]
        b_g, b_gc, b_last = chunk_decay(g, t, m_t, H, i_h, USE_G)  # [C], [C], scalar
        first = tl.minimum(tl.load(firsts + (c0 + i) * H + i_h), first_nonfinite_row(b_v))
        b_r = b_v - mma_right_fp32(b_k, b_h, F32) * tl.exp2(b_gc)[:, None]  # [C, BK] @ [BK, BV] -> [C, BV]
        b_r = tl.where((o_t < first)[:, None], b_r * b_beta[:, None], 0.0)  # R = diag(beta) (V - diag(exp(gc)) K h)
        b_u = mma_fp32(b_tinv, b_r, b_k.dtype, F32, FP32_DOT)  # U = Tinv R: [C, C] @ [C, BV] -> [C, BV]
        if SAVE:
            tl.store(us + row_v, b_u, mask=m_tv)
        if OUT:
            b_q = tl.load(q + row_k, mask=m_tk, other=0.0)  # [C, BK]
            b_o = chunk_outputs(b_q, b_k, b_g, b_gc, b_last, b_u, b_h, first, scale, F32, OUT_DOT)  # [C, BV]
            tl.store(out + row_v, to_output(b_o, out.dtype.element_ty, F32), mask=m_tv)  # downcast: output dtype
        b_s = tl.exp2(chunk_suffix(b_g, b_gc, b_last, F32))  # [C]: exp(gc_last - gc)
        b_h = mma_right_acc(tl.trans(b_k), b_u * b_s[:, None], b_h * tl.exp2(b_last), F32, SPLIT)  # [BK, C] @ [C, BV]
        b_h += tl.where(first < C, float("nan"), 0.0)  # non-finite input: NaN from here on
    if STORE_HT:
        tl.store(ht + (i_n * H + i_h) * K * V + state_tile, b_h, mask=m_s)


@triton.jit
def delta_outputs_kernel(
    q, k, v, g, us, hs, firsts, out, chunks, scale, H, K, V,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, F32: tl.constexpr,
    OUT_DOT: tl.constexpr,
):
    """grid: (cdiv(V, BV) * num_chunks, H) (`chunk_tile_program`). `O = A_qk U + diag(exp(gc)) (scale Q) h` for
    one chunk, head and value tile, from the stored U and entering state h: every chunk in parallel; the rows
    from the chunk's first non-finite token (`firsts`, or a value of this tile) on are NaN."""
    i_v, i_ch, i_h, _, _, _, t, m_t = chunk_tile_program(chunks, tl.cdiv(V, BV), C)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    row_k = (t * H + i_h)[:, None] * K + o_k[None, :]  # [C, BK]
    m_tk = m_t[:, None] & m_k[None, :]
    b_q = tl.load(q + row_k, mask=m_tk, other=0.0)  # [C, BK]
    b_k = tl.load(k + row_k, mask=m_tk, other=0.0)  # [C, BK]
    b_g, b_gc, b_last = chunk_decay(g, t, m_t, H, i_h, USE_G)  # [C], [C], scalar
    row_v = (t * H + i_h)[:, None] * V + o_v[None, :]  # [C, BV]
    m_tv = m_t[:, None] & m_v[None, :]
    b_u = tl.load(us + row_v, mask=m_tv, other=0.0)  # [C, BV] fp32
    b_h = tl.load(hs + (i_ch * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
    first = tl.minimum(tl.load(firsts + i_ch * H + i_h), first_nonfinite_row(tl.load(v + row_v, mask=m_tv, other=0.0)))
    b_o = chunk_outputs(b_q, b_k, b_g, b_gc, b_last, b_u, b_h, first, scale, F32, OUT_DOT)  # [C, BV]
    tl.store(out + row_v, to_output(b_o, out.dtype.element_ty, F32), mask=m_tv)  # downcast: output dtype


def delta_forward_ref(q, k, v, beta, g, t_inv, seq_lens: tuple, *, scale, chunk_size, initial_state=None):
    """PyTorch twin of `delta_states_kernel` and `delta_outputs_kernel` (float64): `(o [N_tok, H, V], ht [N, H, K, V],
    hs [NC, H, K, V], us [N_tok, H, V])` from the kernel's inputs, `t_inv` included."""
    N_tok, H, K = q.shape
    V = v.shape[-1]
    q, k, v, beta, t_inv = (x.double() for x in (q, k, v, beta, t_inv))
    g = torch.zeros_like(beta) if g is None else g.double()
    o = torch.zeros(N_tok, H, V, dtype=torch.float64, device=q.device)
    us = torch.zeros_like(o)
    hs, finals, bos = [], [], 0
    for n, length in enumerate(seq_lens):
        h = torch.zeros(H, K, V, dtype=torch.float64, device=q.device) if initial_state is None else initial_state[n].double()
        for s in range(bos, bos + length, chunk_size):
            e = min(s + chunk_size, bos + length)
            qc, kc, vc = (x[s:e].transpose(0, 1) for x in (q, k, v))  # [n, H, D] -> [H, n, D]
            bc = beta[s:e].t()  # [H, n]
            gc = torch.cumsum(g[s:e].t(), -1)  # [H, n]
            tinv = t_inv[s:e, :, : e - s].transpose(0, 1)  # [H, n, n]
            hs.append(h)
            r = bc[..., None] * (vc - torch.exp(gc)[..., None] * (kc @ h))  # [H, n, V]
            u = tinv @ r  # [H, n, V]
            mask = torch.tril(torch.exp(gc[:, :, None] - gc[:, None, :]).tril())  # [H, n, n]
            att = scale * (qc @ kc.transpose(-1, -2)) * mask  # [H, n, n]
            o[s:e] = (att @ u + scale * torch.exp(gc)[..., None] * (qc @ h)).transpose(0, 1)
            us[s:e] = u.transpose(0, 1)
            last = gc[:, -1:]  # [H, 1]
            h = torch.exp(last)[..., None] * h + kc.transpose(-1, -2) @ (torch.exp(last - gc)[..., None] * u)
        finals.append(h)
        bos += length
    return o, torch.stack(finals), torch.stack(hs), us
