"""The forward of log-linear Gated DeltaNet (`beta` given) on Triton: the delta rule's WY factors, then
two kernels.

Per chunk of C = 2^c tokens (ops/loglinear/chunk.py has the PyTorch form), with `A = scale Q K^T ⊙ exp(D)`
(causal, diagonal included), `Tinv = M^{-1}` and the WY factors `W = Tinv diag(β exp(gc)) K`,
`Ū = Tinv diag(β) V` of the delta rule (ops/delta/triton/wy.py):

    intra  O = ((A Tinv diag(β)) ⊙ lam[t, level(i, j)]) V          the level-masked attention of the chunk
    query  q̃ = diag(exp(gc)) scale Q - A W                           what reads a state entering the chunk

Between chunks, chunk-level `ell` (pairs of chunks `m < n` in the same aligned block of `2^(ell+1)`
chunks, `m` in its first half, `n` in its second; ops/loglinear/README.md, "Chunk factorisation") is a
delta rule of its own over the whole sequence: its state `h` restarts at each block, every chunk applies
its transition, the first half's chunks write and the second half's read,

    read   O += lam[t, c + 1 + ell] (q̃ h)                            where bit ell of the chunk index is 1
    carry  h <- exp(gc_last) h + K̃^T (Ū [bit ell is 0] - W h),      K̃_s = exp(g_{s+1} + ... + g_last) k_s

(the transition of every token applies to every state alive across it, written or not). So the levels
are `L - c - 1` delta rules sharing their inputs and W, Ū: `gdn_chunk_kernel` forms the intra block
and q̃ for every chunk in parallel, `gdn_levels_kernel` walks each sequence's chunks once per value
tile, every level in turn, its states in a global fp32 buffer (`[N, H, NLC, K, V]`, L2-resident) since
Triton cannot index registers by level, and adds the reads to the intra block in registers: one output
store per chunk, no atomics, the same bits every run. The buffer enters holding the initial chunk-level
states (function.py, `fenwick_to_blocks`) and leaves holding each level's state after the last chunk, the
level pass's `R` (level_pass.py), from which function.py forms the final state. Chunks lie on the absolute
grid of each sequence's start position (`plan.grid_chunk_table`).

A NaN or Inf in a token's k, v, β or g (the WY stage's `firsts`) makes every later output NaN and no
earlier one (the intra rows from it on are NaN, the states after its chunk are NaN); one in q reaches
only its own row. The PyTorch twins: `gdn_chunk_locals` (the WY stage and `gdn_chunk_kernel`, every chunk at
once) and `gdn_levels_ref` (the walk).

The backward (function.py) reruns the walk storing the level states entering every S-th chunk
(`checkpoint_plan`), then takes blocks of S chunks last to first, one round per block: `gdn_levels_chain_kernel`
recomputes a block's entering states from its checkpoint (with what each level writes, `x`) and, in programs of
its own, walks its chunks in reverse (a program per level and part), per level the delta rule's adjoint `dh = exp(gc_last) dh' - W^T K̃ dh'
[+ q̃^T diag(lam) dO]` (zero into the chunk before a block's first), storing the states, their gradients, x and
`dx = K̃ dh'`; `gdn_levels_grads_kernel` forms from them the
gradients of q̃, W, Ū, K̃ and the chunk's state factor `exp(gc_last)`, a program per chunk and value tile (twin of
both: `gdn_levels_backward_ref`; the value tiles' shares of the [C, K] gradients meet by fp32 atomic adds unless
`torch.use_deterministic_algorithms` is on); then
three kernels take those through the chunk-local stage, every chunk in parallel (gdn_grads.py).
"""
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from polyattn.ops.chunked import delta_rule_system
from polyattn.ops.common.fenwick import level_table
from polyattn.ops.common.segsum import causal_scores, suffix_sum
from polyattn.ops.delta.triton.forward import chunk_program, chunk_scores, sequence_tile, sequence_tile_of
from polyattn.ops.delta.triton.wy import wy_factors, wy_solve
from polyattn.ops.triton.decay import chunk_decay, chunk_suffix
from polyattn.ops.triton.plan import block, get_config, grid_chunk_table, segment_table, sequence_starts
from polyattn.ops.triton.precision import (
    SPLIT, dot_f32, fp32_dot_mode, mma_fp32, mma_left_fp32, mma_halves, mma_mixed, mma_right_acc, mma_right_fp32,
    interpreting, nan_rows_from, split_halves, to_output, zero_rows_from,
)

from .level_pass import bit_length, intra_levels


@triton.jit
def gdn_chunk_kernel(
    q, k, v, g, beta, lam, w, t_inv, firsts, qt, o_intra, chunks, scale, H, K, V, L,
    C: tl.constexpr, LOG_C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, F32: tl.constexpr, FP32_DOT: tl.constexpr, STORE_O: tl.constexpr,
):
    """grid: (num_chunks, H). One chunk of one head: q̃ [C, K] (stored fp32) and, with STORE_O, the intra
    block [C, V] (stored fp32, value tiles of BV in turn) from the score tile A [C, C], the chunk's rows of
    Tinv [C, C] and W [C, K]. The rows from the chunk's first non-finite token (`firsts`) on are NaN."""
    i_ch, i_h, _, _, o_t, t, m_t = chunk_program(chunks, C)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    row_k = (t * H + i_h)[:, None] * K + o_k[None, :]  # [C, BK]
    m_tk = m_t[:, None] & m_k[None, :]
    b_q = tl.load(q + row_k, mask=m_tk, other=0.0)  # [C, BK]
    b_k = tl.load(k + row_k, mask=m_tk, other=0.0)  # [C, BK]
    b_g, b_gc, b_last = chunk_decay(g, t, m_t, H, i_h, USE_G)  # [C], [C], scalar
    b_att = chunk_scores(b_q, b_k, b_g, b_gc, b_last, scale, F32)  # [C, C]: A, 0 above the diagonal
    b_w = tl.load(w + row_k, mask=m_tk, other=0.0)  # [C, BK] fp32
    b_qt = b_q.to(tl.float32) * (tl.exp2(b_gc) * scale)[:, None] - mma_fp32(b_att, b_w, b_q.dtype, F32, FP32_DOT)  # [C, C] @ [C, BK]
    tl.store(qt + row_k, b_qt, mask=m_tk)
    if STORE_O:  # the backward's rerun needs q̃ alone
        b_ti = tl.load(t_inv + (t * H + i_h)[:, None] * C + o_t[None, :], mask=m_t[:, None], other=0.0)  # [C, C] fp32, lower
        b_beta = tl.load(beta + t * H + i_h, mask=m_t, other=0.0).to(tl.float32)  # [C]
        b_wa = mma_fp32(b_att, b_ti, b_q.dtype, F32, FP32_DOT) * b_beta[None, :]  # [C, C] @ [C, C]: A Tinv diag(β)
        lut = intra_levels(C, LOG_C, tl.load(chunks + i_ch * 4 + 2))  # [C, C] at the chunk's offsets on the grid
        m_w = m_t[:, None] & (o_t[:, None] >= o_t[None, :]) & (lut < L)
        b_lam = tl.load(lam + (t * H + i_h)[:, None] * L + lut, mask=m_w, other=0.0).to(tl.float32)  # [C, C]: lam[t, level(i, j)]
        b_wa = tl.where(m_w, b_wa * b_lam, 0.0)  # [C, C]
        first = tl.load(firsts + i_ch * H + i_h)
        for i_v in range(0, tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            row_v = (t * H + i_h)[:, None] * V + o_v[None, :]  # [C, BV]
            m_tv = m_t[:, None] & (o_v < V)[None, :]
            b_v = zero_rows_from(tl.load(v + row_v, mask=m_tv, other=0.0), first)  # [C, BV]
            b_o = nan_rows_from(mma_left_fp32(b_wa, b_v, F32), first)  # [C, C] @ [C, BV] -> [C, BV]
            tl.store(o_intra + row_v, b_o, mask=m_tv)


@triton.jit
def level_chunk(chunks, row, k, g, w, u_bar, qt, o_k, m_k, o_v, m_v, H, i_h, K, V,
                C: tl.constexpr, USE_G: tl.constexpr, F32: tl.constexpr):
    """What both level walks load for the chunk at row `row` of the grid table: `(t, m_t, row_v, m_tv)` and
    the tiles W (as its two input-dtype halves, `split_halves`: split once for every level's products), q̃ [C, BK]
    fp32, K [C, BK], Ū [C, BV] fp32, with K̃'s row weights `exp(gc_last - gc)` [C] and the chunk's total
    log2-decay."""
    t = tl.load(chunks + row * 4) + tl.arange(0, C)
    m_t = t < tl.load(chunks + row * 4 + 1)
    th = (t * H + i_h).to(tl.int64)  # [C]: token-head rows (int64: offsets past 2^31 elements)
    row_k = th[:, None] * K + o_k[None, :]  # [C, BK]
    m_tk = m_t[:, None] & m_k[None, :]
    row_v = th[:, None] * V + o_v[None, :]  # [C, BV]
    m_tv = m_t[:, None] & m_v[None, :]
    b_w = tl.load(w + row_k, mask=m_tk, other=0.0)  # [C, BK] fp32
    b_qt = tl.load(qt + row_k, mask=m_tk, other=0.0)  # [C, BK] fp32
    b_k = tl.load(k + row_k, mask=m_tk, other=0.0)  # [C, BK]
    b_u = tl.load(u_bar + row_v, mask=m_tv, other=0.0)  # [C, BV] fp32
    b_g, b_gc, b_last = chunk_decay(g, t, m_t, H, i_h, USE_G)  # [C], [C], scalar
    b_wk = tl.exp2(chunk_suffix(b_g, b_gc, b_last, F32))  # [C]: exp(gc_last - gc)
    b_w_hi, b_w_lo = split_halves(b_w, b_k.dtype, F32)  # [C, BK] each
    return t, m_t, row_v, m_tv, b_w_hi, b_w_lo, b_qt, b_k, b_u, b_wk, b_last


@triton.jit
def level_x(b_h, b_w_hi, b_w_lo, b_u, read, first, F32: tl.constexpr, FP32_DOT: tl.constexpr):
    """What one level writes in the chunk, `x = -W h` [C, BV] in the block's second half (`read`) and `Ū - W h`
    in its first, `x = Ū` at the block's first chunk (`first`: h entered as zero, so `W h` is not formed)."""
    if first:
        b_x = b_u
    else:
        b_x = mma_halves(b_w_hi, b_w_lo, b_h, F32, FP32_DOT)  # [C, BK] @ [BK, BV] -> [C, BV]
        if read:
            b_x = -b_x
        else:
            b_x = b_u - b_x
    return b_x


@triton.jit
def level_carry(b_h, b_x, b_k, b_wk, b_last, bad, F32: tl.constexpr):
    """One level's state leaving the chunk, `h' = exp(gc_last) h + K̃^T x` (x: `level_x`); NaN after a chunk
    with a non-finite token."""
    b_h = mma_right_acc(tl.trans(b_k), b_x * b_wk[:, None], b_h * tl.exp2(b_last), F32, SPLIT)  # [BK, C] @ [C, BV]
    return b_h + tl.where(bad, float("nan"), 0.0)


@triton.jit
def sequence_chunks(pos, i_n, eos, bos, C: tl.constexpr, NLC):
    """Sequence i_n's chunks on the absolute grid: `(n0, n_ch, NL)`, its first chunk's absolute index, its number of
    chunks and the chunk-levels some chunk reads (`ell < bit_length(last chunk index)`, at most NLC)."""
    P = tl.load(pos + i_n).to(tl.int32)  # positions below 2^31
    n0 = P // C
    n1 = (P + (eos - bos).to(tl.int32) - 1) // C  # the last chunk's absolute index
    return n0, n1 - n0 + 1, tl.minimum(bit_length(n1), NLC)


@triton.jit
def gdn_levels_kernel(
    k, g, w, u_bar, qt, lam, firsts, o_intra, out, state, ck, cu_blocks, seqs, chunks, cu_chunks, pos,
    H, K, V, L, NLC, S,
    C: tl.constexpr, LOG_C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, F32: tl.constexpr, FP32_DOT: tl.constexpr, STORE_CK: tl.constexpr,
):
    """grid: (cdiv(V, BV), N, H). One sequence, head and value tile, the sequence starting at the
    absolute position `pos[n]`, its chunks the rows `cu_chunks[n]..` of the grid table `chunks`: per
    chunk `a` (absolute index), for each chunk-level that a chunk of the sequence can read
    (`ell < bit_length(last chunk index)`), the products `W h` [C, BK] @ [BK, BV], the read `q̃ h`
    where bit ell of `a` is set and the carry `K̃^T (.)` [BK, C] @ [C, BV] (no `W h` at the level's block's
    first chunk, where h is zero; no carry at its last unless the sequence ends there); the level's state tile
    [BK, BV] is loaded from and stored to `state` (which enters holding the initial states; zero at
    a block's first chunk after the sequence's first), the output tile (intra block + reads) stored once.
    STORE_CK (the backward's rerun): the level states entering every S-th chunk of the sequence (its chunks
    i = 0, S, 2S, ..., as the chunk used them) to the checkpoints `ck [NB, H, NLC, K, V]`, sequence n's from row
    `cu_blocks[n]` (for the backward, which recomputes the chunks in between), and no reads or outputs."""
    i_n, i_h, bos, eos, c0, o_k, m_k, o_v, m_v, m_s, state_tile = sequence_tile(seqs, cu_chunks, K, V, BK, BV)
    n0, n_ch, NL = sequence_chunks(pos, i_n, eos, bos, C, NLC)
    p_level = state + ((i_n * H + i_h) * NLC).to(tl.int64) * K * V + state_tile  # [BK, BV] of level 0
    if STORE_CK:
        cb0 = tl.load(cu_blocks + i_n)
    for i in range(0, n_ch):
        a = n0 + i
        t, m_t, row_v, m_tv, b_w_hi, b_w_lo, b_qt, b_k, b_u, b_wk, b_last = level_chunk(
            chunks, c0 + i, k, g, w, u_bar, qt, o_k, m_k, o_v, m_v, H, i_h, K, V, C, USE_G, F32,
        )
        if not STORE_CK:
            b_o = tl.load(o_intra + row_v, mask=m_tv, other=0.0)  # [C, BV] fp32
        bad = tl.load(firsts + (c0 + i) * H + i_h) < C  # a non-finite token in the chunk
        for ell in range(0, NL):
            p_s = p_level + ell * K * V
            phase = a % (2 << ell)  # the chunk's place in the level's block
            # [BK, BV]; a block's first chunk reads nothing, but the sequence's first chunk reads what entered
            # (an initial state's keys in that chunk join its writes: function.py, fenwick_to_blocks)
            m_h = m_s & (((o_k[:, None] * 0 + phase) != 0) | (i == 0))
            b_h = tl.load(p_s, mask=m_h, other=0.0)  # [BK, BV]
            if STORE_CK:
                if i % S == 0:
                    tl.store(ck + (((cb0 + i // S) * H + i_h) * NLC + ell).to(tl.int64) * K * V + state_tile, b_h, mask=m_s)
            read = ((a >> ell) & 1) == 1  # second half of the level's block
            if not STORE_CK:
                if read:
                    b_lam = tl.load(lam + (t * H + i_h) * L + (LOG_C + 1 + ell), mask=m_t, other=0.0).to(tl.float32)  # [C]
                    b_o += mma_fp32(b_qt, b_h, b_k.dtype, F32, FP32_DOT) * b_lam[:, None]  # [C, BK] @ [BK, BV]
            # after a block's last chunk the state is not read again (the next chunk starts the next block), unless
            # the sequence ends there: it leaves in `state`
            if (phase != (2 << ell) - 1) | (i == n_ch - 1):
                first = (phase == 0) & (i > 0)
                b_x = level_x(b_h, b_w_hi, b_w_lo, b_u, read, first, F32, FP32_DOT)  # [C, BV]
                tl.store(p_s, level_carry(b_h, b_x, b_k, b_wk, b_last, bad, F32), mask=m_s)
        if not STORE_CK:
            tl.store(out + row_v, to_output(b_o, out.dtype.element_ty, F32), mask=m_tv)  # downcast: output dtype


@triton.jit
def block_span(pos, i_n, eos, bos, jb, S, C: tl.constexpr, NLC):
    """The chunks of sequence i_n's round-jb block (its jb-th block of S chunks counted from its end): `(n0, n_ch,
    NL, i_lo, i_hi, live)` as `sequence_chunks`, the block's chunks i_lo <= i < i_hi, and `live` False where the
    sequence has no such block."""
    n0, n_ch, NL = sequence_chunks(pos, i_n, eos, bos, C, NLC)
    n_blocks = tl.cdiv(n_ch, S)
    i_lo = (n_blocks - 1 - jb) * S
    return n0, n_ch, NL, i_lo, tl.minimum(i_lo + S, n_ch), jb < n_blocks


@triton.jit
def gdn_levels_chain_kernel(
    k, g, w, u_bar, qt, lam, firsts, do, ck, cu_blocks, hs, xs, dhs, dxs, dstate,
    seqs, chunks, cu_chunks, pos, jb, n_v, H, K, V, L, NLC, S,
    C: tl.constexpr, LOG_C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, F32: tl.constexpr, FP32_DOT: tl.constexpr, PART: tl.constexpr,
):
    """grid: (n_v * NLC, N, H), the value tile fastest (n_v of them), then the chunk-level ell. Round jb of
    `gdn_levels_kernel`'s walk in reverse for one level: each sequence's jb-th block of S chunks from its end (a
    sequence with fewer blocks, or fewer levels, does nothing). The levels are independent delta rules and the
    two parts share no data, so each is a program of its own (a launch per PART), its state or gradient in
    registers from chunk to chunk. Part 0: the level's states entering each of the block's chunks, recomputed from the block's
    checkpoint (`ck`, stored by `gdn_levels_kernel`) and stored to `hs [N, H, S, NLC, K, V]`, with what the level
    writes, `x` (`level_x`), stored to `xs [N, H, S, NLC, C, V]` wherever its gradient dh' is not zero. Part 1:
    the block's chunks last to first, the chain of the adjoint alone, which needs no state (dx = K̃ dh'):

        dh = exp(gc_last) dh' - W^T dx [+ (diag(lam) q̃)^T dO],   zero into the chunk before a block's first

    with `dh'` (the gradient of the level's state leaving the chunk; `dstate [N, H, NLC, K, V]` holds the one
    leaving the block, entering as that of the leaving states R and leaving as that of the entering ones r0)
    stored to `dhs [N, H, S, NLC, K, V]` and dx to `dxs [N, H, S, NLC, C, V]` for `gdn_levels_grads_kernel`, which
    forms the round's gradients from the four, every chunk in parallel. At a block's first chunk h is zero and
    nothing flows back; after its last dh' is zero unless the sequence ends there (then neither x nor dx is
    stored: the gradients do not read them)."""
    i_v = tl.program_id(0) % n_v
    ell = tl.program_id(0) // n_v
    i_n, i_h, bos, eos, c0, o_k, m_k, o_v, m_v, m_s, state_tile = sequence_tile_of(
        i_v, tl.program_id(1), tl.program_id(2), seqs, cu_chunks, K, V, BK, BV,
    )
    n0, n_ch, NL, i_lo, i_hi, live = block_span(pos, i_n, eos, bos, jb, S, C, NLC)
    level = ((i_n * H + i_h) * S * NLC + ell).to(tl.int64)  # chunk 0 of the round's scratches, this level
    p_hs = hs + level * K * V + state_tile  # [BK, BV]
    p_dhs = dhs + level * K * V + state_tile
    chunk_tile = tl.arange(0, C)[:, None] * V + o_v[None, :]  # [C, BV] offsets inside one [C, V] tile of xs, dxs
    m_c = m_v[None, :] & (tl.arange(0, C) < C)[:, None]
    p_xs = xs + level * C * V + chunk_tile  # [C, BV]
    p_dxs = dxs + level * C * V + chunk_tile
    last = (2 << ell) - 1  # a chunk's phase at its level's block's last
    if PART == 0:
        if live & (ell < NL):
            p_ck = ck + ((tl.load(cu_blocks + i_n) + i_lo // S) * H * NLC + i_h * NLC + ell).to(tl.int64) * K * V + state_tile
            b_h = tl.load(p_ck, mask=m_s, other=0.0)  # [BK, BV]: the state entering the block's first chunk
            for i in range(i_lo, i_hi):  # the block's entering states, as gdn_levels_kernel formed them
                a = n0 + i
                _, _, _, _, b_w_hi, b_w_lo, _, b_k, b_u, b_wk, b_last = level_chunk(
                    chunks, c0 + i, k, g, w, u_bar, qt, o_k, m_k, o_v, m_v, H, i_h, K, V, C, USE_G, F32,
                )
                phase = a % (2 << ell)
                if (phase == 0) & (i > i_lo):  # a level's block starts: its state is zero
                    b_h = tl.zeros([BK, BV], dtype=tl.float32)
                tl.store(p_hs + ((i - i_lo) * NLC).to(tl.int64) * K * V, b_h, mask=m_s)
                if (phase != last) | (i == n_ch - 1):  # dh' not zero: the gradients read x
                    read = ((a >> ell) & 1) == 1
                    first = (phase == 0) & (i > 0)
                    b_x = level_x(b_h, b_w_hi, b_w_lo, b_u, read, first, F32, FP32_DOT)  # [C, BV]
                    tl.store(p_xs + ((i - i_lo) * NLC).to(tl.int64) * C * V, b_x, mask=m_c)
                    if (i + 1 < i_hi) & (phase != last):  # else the next chunk's state is zero or not needed here
                        bad = tl.load(firsts + (c0 + i) * H + i_h) < C
                        b_h = level_carry(b_h, b_x, b_k, b_wk, b_last, bad, F32)
    else:
        if live & (ell < NL):
            p_s = dstate + ((i_n * H + i_h) * NLC + ell).to(tl.int64) * K * V + state_tile  # [BK, BV]
            b_dh = tl.load(p_s, mask=m_s, other=0.0)  # dh' of the state leaving the block
            for j in range(0, i_hi - i_lo):
                i = i_hi - 1 - j
                a = n0 + i
                t, m_t, row_v, m_tv, b_w_hi, b_w_lo, _, b_k, _, b_wk, b_last = level_chunk(
                    chunks, c0 + i, k, g, w, u_bar, qt, o_k, m_k, o_v, m_v, H, i_h, K, V, C, USE_G, F32,
                )
                phase = a % (2 << ell)
                b_dn = tl.zeros([BK, BV], dtype=tl.float32)
                # dh' is zero after a block's last chunk (the next chunk starts the next block), unless the sequence ends there
                if (phase != last) | (i == n_ch - 1):
                    tl.store(p_dhs + ((i - i_lo) * NLC).to(tl.int64) * K * V, b_dh, mask=m_s)
                    b_dx = mma_right_fp32(b_k, b_dh, F32) * b_wk[:, None]  # [C, BK] @ [BK, BV]: K̃ dh'
                    tl.store(p_dxs + ((i - i_lo) * NLC).to(tl.int64) * C * V, b_dx, mask=m_c)
                    if (phase != 0) | (i == 0):  # else h entered as zero, and nothing flows further back
                        b_dn = b_dh * tl.exp2(b_last) - mma_halves(tl.trans(b_w_hi), tl.trans(b_w_lo), b_dx, F32, FP32_DOT)  # [BK, C] @ [C, BV]
                if ((a >> ell) & 1) == 1:  # second half: read
                    row_k = ((t * H + i_h).to(tl.int64))[:, None] * K + o_k[None, :]  # [C, BK] (int64)
                    m_tk = m_t[:, None] & m_k[None, :]
                    b_do = tl.load(do + row_v, mask=m_tv, other=0.0)  # [C, BV] in do's dtype (mma_mixed: as it is or split)
                    b_lam = tl.load(lam + (t * H + i_h) * L + (LOG_C + 1 + ell), mask=m_t, other=0.0).to(tl.float32)  # [C]
                    b_qt = tl.load(qt + row_k, mask=m_tk, other=0.0)  # [C, BK] fp32
                    b_dn += mma_mixed(tl.trans(b_qt * b_lam[:, None]), b_do, b_k.dtype, F32, FP32_DOT)  # [BK, C] @ [C, BV]: q̃^T diag(lam) dO
                b_dh = b_dn  # zero into the chunk before a block's first
            tl.store(p_s, b_dh, mask=m_s)


@triton.jit
def gdn_levels_grads_kernel(
    k, g, qt, lam, do, hs, xs, dhs, dxs, dqt, dw, dkt, du, dlast, dlam,
    seqs, chunks, cu_chunks, pos, jb, N_tok, NC, H, K, V, L, NLC, S,
    C: tl.constexpr, LOG_C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, F32: tl.constexpr, FP32_DOT: tl.constexpr, ATOMIC: tl.constexpr,
):
    """grid: (S * cdiv(V, BV), N, H), the block's chunk fastest. Round jb's gradients of one chunk of the block
    `gdn_levels_chain_kernel` walked, from its entering level states h (`hs`), what each level wrote, x (`xs`),
    the leaving states' gradients dh' (`dhs`) and dx = K̃ dh' (`dxs`), every level in turn:

        dŪ += [write] dx        dW -= dx h^T        dK̃ += x dh'^T        dlast += exp(gc_last) <h, dh'>
        read: P = dO h^T,   dq̃ += diag(lam) P,   dlam[t, c + 1 + ell] = <q̃_t, P_t>  (= <dO_t, (q̃ h)_t>)

    (h zero at a level's block's first chunk, dh' zero after its last unless the sequence ends there). dlast and
    dlam are this value tile's shares (`[n_v, ...]`, summed by the launcher), and so are the [C, K] gradients dq̃,
    dW, dK̃ unless ATOMIC, where every tile adds its share into one `[N_tok, H, K]` buffer (fp32 atomics: the
    order of the n_v additions varies from run to run); dŪ is complete per tile."""
    i_v, i_b = tl.program_id(0) // S, tl.program_id(0) % S
    i_n, i_h, bos, eos, c0, o_k, m_k, o_v, m_v, m_s, state_tile = sequence_tile_of(
        i_v, tl.program_id(1), tl.program_id(2), seqs, cu_chunks, K, V, BK, BV,
    )
    n0, n_ch, NL, i_lo, i_hi, live = block_span(pos, i_n, eos, bos, jb, S, C, NLC)
    i = i_lo + i_b
    if live & (i < i_hi):
        a = n0 + i
        row = c0 + i
        t = tl.load(chunks + row * 4) + tl.arange(0, C)
        m_t = t < tl.load(chunks + row * 4 + 1)
        _, _, b_last = chunk_decay(g, t, m_t, H, i_h, USE_G)  # the chunk's total log2-decay
        row_v = ((t * H + i_h).to(tl.int64))[:, None] * V + o_v[None, :]  # [C, BV] (int64)
        m_tv = m_t[:, None] & m_v[None, :]
        row_k = ((t * H + i_h).to(tl.int64))[:, None] * K + o_k[None, :]  # [C, BK] (int64)
        m_tk = m_t[:, None] & m_k[None, :]
        b_do = tl.load(do + row_v, mask=m_tv, other=0.0)  # [C, BV] in do's dtype (mma_mixed: as it is or split)
        chunk_tile = tl.arange(0, C)[:, None] * V + o_v[None, :]  # [C, BV] inside one [C, V] tile of xs, dxs
        m_c = m_v[None, :] & (tl.arange(0, C) < C)[:, None]
        base = ((i_n * H + i_h) * S + i_b) * NLC  # chunk i_b, level 0 of the round's scratches
        p_hs = hs + base.to(tl.int64) * K * V + state_tile  # [BK, BV]
        p_dhs = dhs + base.to(tl.int64) * K * V + state_tile
        p_xs = xs + base.to(tl.int64) * C * V + chunk_tile  # [C, BV]
        p_dxs = dxs + base.to(tl.int64) * C * V + chunk_tile
        b_dqt = tl.zeros([C, BK], dtype=tl.float32)
        b_dw = tl.zeros([C, BK], dtype=tl.float32)
        b_dkt = tl.zeros([C, BK], dtype=tl.float32)
        b_du = tl.zeros([C, BV], dtype=tl.float32)
        b_dl = tl.sum(tl.zeros([BV], dtype=tl.float32), axis=0)
        for ell in range(0, NL):
            phase = a % (2 << ell)
            first = (phase == 0) & (i > 0)  # h entered as zero
            write = ((a >> ell) & 1) == 0
            m_h = m_s & ((o_k[:, None] * 0 + phase != 0) | (o_k[:, None] * 0 + i == 0))
            b_h = tl.load(p_hs + ell * K * V, mask=m_h, other=0.0)  # [BK, BV]: the entering state
            if (phase != (2 << ell) - 1) | (i == n_ch - 1):  # else dh' is zero
                b_dh = tl.load(p_dhs + ell * K * V, mask=m_s, other=0.0)  # [BK, BV]: dh' of the leaving state
                b_dx = tl.load(p_dxs + ell * C * V, mask=m_c, other=0.0)  # [C, BV]: K̃ dh'
                b_x = tl.load(p_xs + ell * C * V, mask=m_c, other=0.0)  # [C, BV]: what the level wrote
                if not first:
                    b_dw -= mma_fp32(b_dx, tl.trans(b_h), k.dtype.element_ty, F32, FP32_DOT)  # [C, BV] @ [BV, BK]
                    b_dl += tl.sum(tl.sum(b_h * b_dh, axis=1), axis=0)
                if write:
                    b_du += b_dx
                b_dkt += mma_fp32(b_x, tl.trans(b_dh), k.dtype.element_ty, F32, FP32_DOT)  # [C, BV] @ [BV, BK]
            if ((a >> ell) & 1) == 1:  # second half: read
                b_lam = tl.load(lam + (t * H + i_h) * L + (LOG_C + 1 + ell), mask=m_t, other=0.0).to(tl.float32)  # [C]
                b_qt = tl.load(qt + row_k, mask=m_tk, other=0.0)  # [C, BK] fp32
                b_p = mma_mixed(b_do, tl.trans(b_h), k.dtype.element_ty, F32, FP32_DOT)  # [C, BV] @ [BV, BK]: dO h^T
                b_dqt += b_p * b_lam[:, None]
                tl.store(dlam + ((i_v * N_tok + t).to(tl.int64) * H + i_h) * L + (LOG_C + 1 + ell), tl.sum(b_qt * b_p, axis=1), mask=m_t)  # <dO, q̃ h>
        if ATOMIC:  # every value tile adds into one buffer
            tl.atomic_add(dqt + row_k, b_dqt, mask=m_tk, sem="relaxed")
            tl.atomic_add(dw + row_k, b_dw, mask=m_tk, sem="relaxed")
            tl.atomic_add(dkt + row_k, b_dkt, mask=m_tk, sem="relaxed")
        else:
            part_k = ((i_v * N_tok + t).to(tl.int64) * H + i_h)[:, None] * K + o_k[None, :]  # [C, BK] of this tile's share (int64)
            tl.store(dqt + part_k, b_dqt, mask=m_tk)
            tl.store(dw + part_k, b_dw, mask=m_tk)
            tl.store(dkt + part_k, b_dkt, mask=m_tk)
        tl.store(du + row_v, b_du, mask=m_tv)
        tl.store(dlast + (i_v * NC + row) * H + i_h, b_dl * tl.exp2(b_last))


class ChunkLocals(NamedTuple):
    """`gdn_chunk_locals`' result, token rows `[N_tok, H, *]` fp32 but `gc_last [NC, H]`."""

    o_intra: torch.Tensor  # [N_tok, H, V]: the level-masked chunk block
    qt: torch.Tensor  # [N_tok, H, K]: q̃
    w: torch.Tensor  # [N_tok, H, K]: W
    u_bar: torch.Tensor  # [N_tok, H, V]: Ū
    kt: torch.Tensor  # [N_tok, H, K]: K̃
    t_inv: torch.Tensor  # [N_tok, H, C]: the rows of Tinv, columns from the chunk's first token
    gc_last: torch.Tensor  # [NC, H]: each grid chunk's total log-decay


class ChunkLayout(NamedTuple):
    """Token rows of every grid chunk: `rows [NC, C]`, `real [NC, C]` (inside the chunk), `idx` (rows, 0
    outside) and the offsets `at [NC, C]` on the grid (clamped to C - 1)."""

    rows: torch.Tensor
    real: torch.Tensor
    idx: torch.Tensor
    at: torch.Tensor

    def chunked(self, x):
        """`[N_tok, H, ...]` -> `[NC, H, C, ...]` in fp32 (float64 stays), rows past the chunk zero."""
        y = x[self.idx].to(torch.promote_types(x.dtype, torch.float32))  # [NC, C, H, ...]
        return torch.where(self.real.view(*self.real.shape, *[1] * (y.dim() - 2)), y, 0.0).transpose(1, 2)

    def tokens(self, x, N_tok):
        """`[NC, H, C, D]` -> `[N_tok, H, D]` (each token's row of its chunk)."""
        x = x.transpose(1, 2)[self.real]  # [n_real, H, D]
        return x.new_zeros(N_tok, *x.shape[1:]).index_put((self.rows[self.real],), x)


def chunk_layout(table, C) -> ChunkLayout:
    j = torch.arange(C, device=table.device)
    rows = table[:, :1].long() + j  # [NC, C]
    real = rows < table[:, 1:2].long()
    return ChunkLayout(rows, real, torch.where(real, rows, 0), (table[:, 2:3].long() + j).clamp(max=C - 1))


def chunk_parts(q, k, v, g, beta, lam, layout: ChunkLayout, scale, C):
    """The padded pieces of `gdn_chunk_locals` (`[NC, H, C, *]`), shared with its backward."""
    qc, kc, vc, bc = layout.chunked(q) * scale, layout.chunked(k), layout.chunked(v), layout.chunked(beta)
    gl = layout.chunked(g) if g is not None else torch.zeros_like(bc)  # [NC, H, C]
    D, M = delta_rule_system(kc, bc, gl)  # [NC, H, C, C] each: exp of the segment sums (lower), I + strict(diag(β) KK^T ⊙ D)
    eye = torch.eye(C, dtype=qc.dtype, device=q.device)
    t_inv = torch.linalg.solve_triangular(M, eye.expand_as(M), upper=False, unitriangular=True)  # [NC, H, C, C]
    NC, H = qc.shape[:2]
    lut = level_table(C, device=q.device)[layout.at[:, :, None], layout.at[:, None, :]][:, None].expand(NC, H, C, C)  # -1 above the diagonal
    lamc = layout.chunked(lam)  # [NC, H, C, L]
    L = lamc.shape[-1]
    m_lam = (lut >= 0) & (lut < L)
    lam_in = torch.where(m_lam, torch.gather(lamc, -1, lut.clamp(0, L - 1)), 0.0)  # [NC, H, C, C]: lam[t, level(t, s)]
    return dict(qc=qc, kc=kc, vc=vc, bc=bc, gl=gl, gc=torch.cumsum(gl, -1), D=D, t_inv=t_inv, lut=lut.clamp(0, L - 1), m_lam=m_lam,
                lam_in=lam_in, lamc=lamc, scale=scale)


def gdn_chunk_locals(q, k, v, g, beta, lam, table, *, scale, C) -> ChunkLocals:
    """Everything of a chunk that needs no state, in PyTorch for every chunk of the grid table `table`
    ([NC, 4]: bos, eos, offset on the grid) at once (`[NC, H, C, *]` fp32, rows past a chunk zero): the
    WY stage, q̃, the level-masked block and K̃, as `gdn_chunk_kernel` and the WY kernels form them.
    `gdn_grads.gdn_chunk_locals_backward` is its backward."""
    N_tok = q.shape[0]
    layout = chunk_layout(table, C)
    p = chunk_parts(q, k, v, g, beta, lam, layout, scale, C)
    qc, kc, vc, bc, gc, t_inv = p["qc"], p["kc"], p["vc"], p["bc"], p["gc"], p["t_inv"]
    A = causal_scores(qc @ kc.transpose(-1, -2), p["D"])  # [NC, H, C, C]
    w = t_inv @ ((bc * torch.exp(gc))[..., None] * kc)  # [NC, H, C, K]
    u_bar = t_inv @ (bc[..., None] * vc)  # [NC, H, C, V]
    qt = torch.exp(gc)[..., None] * qc - A @ w  # [NC, H, C, K]
    kt = torch.exp(suffix_sum(p["gl"]))[..., None] * kc  # [NC, H, C, K]
    o_intra = (A @ t_inv * bc[..., None, :] * p["lam_in"]) @ vc  # [NC, H, C, V]
    tokens = lambda x: layout.tokens(x, N_tok)  # noqa: E731
    return ChunkLocals(tokens(o_intra), tokens(qt), tokens(w), tokens(u_bar), tokens(kt), tokens(t_inv), gc[..., -1])


def gdn_levels_ref(qt, w, u_bar, k, g, lam, seq_lens: tuple, positions: list, *, chunk_size, r0=None):
    """The chunk-levels of the walk in PyTorch (float64, differentiable): `(o [N_tok, H, V], R [N, H, NLC,
    K, V])`, the levels' reads and every chunk-level's state after the last chunk, from q̃, W [N_tok, H,
    K], Ū [N_tok, H, V], the keys, log-decays (or None) and level weights, sequence n starting at the
    absolute position `positions[n]` with the entering chunk-level states `r0` (or zero)."""
    N_tok, H, K = k.shape
    V, L, C = u_bar.shape[-1], lam.shape[-1], chunk_size
    c = C.bit_length() - 1
    NLC = max(L - c - 1, 1)
    qt, w, u_bar, k, lam = (x.double() for x in (qt, w, u_bar, k, lam))
    g = torch.zeros(N_tok, H, dtype=torch.float64, device=k.device) if g is None else g.double()
    outs, states, bos = [], [], 0
    for n, (length, P) in enumerate(zip(seq_lens, positions)):
        n0, n1 = P // C, (P + length - 1) // C
        NL = min(n1.bit_length(), NLC)
        zero = torch.zeros(H, K, V, dtype=torch.float64, device=k.device)
        h = [zero] * NLC if r0 is None else list(r0[n].double().unbind(1))  # NLC x [H, K, V]
        for a in range(n0, n1 + 1):
            s, e = bos + max(a * C - P, 0), bos + min((a + 1) * C - P, length)
            qc, wc, uc = (x[s:e].transpose(0, 1) for x in (qt, w, u_bar))  # [H, m, D]
            gc = torch.cumsum(g[s:e].t(), -1)  # [H, m]
            kd = torch.exp(gc[:, -1:] - gc)[..., None] * k[s:e].transpose(0, 1)  # [H, m, K]: K̃
            oc = torch.zeros(H, e - s, V, dtype=torch.float64, device=k.device)
            for ell in range(NL):
                hin = zero if a % (2 << ell) == 0 and a > n0 else h[ell]
                x = wc @ hin  # [H, m, V]
                if (a >> ell) & 1:
                    oc = oc + lam[s:e, :, c + 1 + ell].t()[..., None] * (qc @ hin)
                    x = -x
                else:
                    x = uc - x
                h[ell] = torch.exp(gc[:, -1])[:, None, None] * hin + kd.transpose(-1, -2) @ x
            outs.append(oc.transpose(0, 1))
        states.append(torch.stack(h, 1))  # [H, NLC, K, V]
        bos += length
    return torch.cat(outs), torch.stack(states)


def gdn_levels_backward_ref(qt, w, u_bar, k, g, lam, do, dR, seq_lens: tuple, positions: list, *, chunk_size, r0=None):
    """PyTorch twin of `gdn_levels_backward` (`gdn_levels_chain_kernel` and `gdn_levels_grads_kernel`; float64): the gradients of `gdn_levels_ref`'s
    `(o, R)` given `do [N_tok, H, V]` and `dR [N, H, NLC, K, V]` (or None), as `(dq̃, dW, dK̃ [N_tok, H,
    K], dŪ [N_tok, H, V], dlast [NC, H] (per row of the grid chunk table: the gradient of the chunk's
    total log-decay through its state factor exp(gc_last)), dlam [N_tok, H, L], dr0 [N, H, NLC, K, V])`,
    with K̃ = diag(exp(gc_last - gc)) K. The forward's entering states are recomputed."""
    N_tok, H, K = k.shape
    V, L, C = u_bar.shape[-1], lam.shape[-1], chunk_size
    c = C.bit_length() - 1
    NLC = max(L - c - 1, 1)
    qt, w, u_bar, k, lam, do = (x.double() for x in (qt, w, u_bar, k, lam, do))
    g = torch.zeros(N_tok, H, dtype=torch.float64, device=k.device) if g is None else g.double()
    dqt, dw, dkt = (torch.zeros(N_tok, H, K, dtype=torch.float64, device=k.device) for _ in range(3))
    du = torch.zeros(N_tok, H, V, dtype=torch.float64, device=k.device)
    dlam = torch.zeros(N_tok, H, L, dtype=torch.float64, device=k.device)
    NC = sum(-(-length // C) + 1 for length in seq_lens)
    dlast = torch.zeros(NC, H, dtype=torch.float64, device=k.device)
    dr0 = torch.zeros(len(seq_lens), H, NLC, K, V, dtype=torch.float64, device=k.device)
    bos, row0 = 0, 0
    for n, (length, P) in enumerate(zip(seq_lens, positions)):
        n0, n1 = P // C, (P + length - 1) // C
        NL = min(n1.bit_length(), NLC)
        zero = torch.zeros(H, K, V, dtype=torch.float64, device=k.device)
        h = [zero] * NLC if r0 is None else list(r0[n].double().unbind(1))
        chunks = []  # per chunk: (rows, entering states, gc)
        for a in range(n0, n1 + 1):
            s, e = bos + max(a * C - P, 0), bos + min((a + 1) * C - P, length)
            gc = torch.cumsum(g[s:e].t(), -1)  # [H, m]
            kd = torch.exp(gc[:, -1:] - gc)[..., None] * k[s:e].transpose(0, 1)  # [H, m, K]
            wc, uc = w[s:e].transpose(0, 1), u_bar[s:e].transpose(0, 1)
            entering = []
            for ell in range(NL):
                hin = zero if a % (2 << ell) == 0 and a > n0 else h[ell]
                entering.append(hin)
                x = -(wc @ hin) if (a >> ell) & 1 else uc - wc @ hin
                h[ell] = torch.exp(gc[:, -1])[:, None, None] * hin + kd.transpose(-1, -2) @ x
            chunks.append((s, e, entering, gc, kd))
        dh = [zero] * NLC if dR is None else list(dR[n].double().unbind(1))
        for i in reversed(range(n1 - n0 + 1)):
            a = n0 + i
            s, e, entering, gc, kd = chunks[i]
            qc, wc, uc, doc = (x[s:e].transpose(0, 1) for x in (qt, w, u_bar, do))  # [H, m, D]
            el = torch.exp(gc[:, -1])[:, None, None]  # [H, 1, 1]
            for ell in range(NL):
                hin, dhp = entering[ell], dh[ell]
                dx = kd @ dhp  # [H, m, V]
                read = (a >> ell) & 1
                x = -(wc @ hin) if read else uc - wc @ hin
                dw[s:e] -= (dx @ hin.transpose(-1, -2)).transpose(0, 1)
                dkt[s:e] += (x @ dhp.transpose(-1, -2)).transpose(0, 1)
                dlast[row0 + i] += (el[:, 0, 0] * (hin * dhp).sum((-1, -2)))
                dn = el * dhp - wc.transpose(-1, -2) @ dx
                if read:
                    dol = lam[s:e, :, c + 1 + ell].t()[..., None] * doc  # [H, m, V]
                    dqt[s:e] += (dol @ hin.transpose(-1, -2)).transpose(0, 1)
                    dlam[s:e, :, c + 1 + ell] = (doc * (qc @ hin)).sum(-1).t()
                    dn = dn + qc.transpose(-1, -2) @ dol
                else:
                    du[s:e] += dx.transpose(0, 1)
                dh[ell] = zero if a % (2 << ell) == 0 and a > n0 else dn
        dr0[n] = torch.stack(dh, 1)
        bos += length
        row0 += -(-length // C) + 1
    return dqt, dw, dkt, du, dlast, dlam, dr0


class GdnForward(NamedTuple):
    """What `gdn_forward` returns: `o [N_tok, H, V]` in the output dtype (None for the backward's rerun) and,
    fp32, `R [N, H, NLC, K, V]`
    (each chunk-level's state after the last chunk), the WY stage's `t_inv [N_tok, H, C]`, `w [N_tok, H,
    K]`, `u_bar [N_tok, H, V]`, `qt [N_tok, H, K]` (q̃), `firsts [NC, H]` (each chunk's first non-finite row,
    C when none), the grid chunk table it ran on
    (`plan.grid_chunk_table`'s triple, which the backward stages reuse) and, for the backward (None
    unless asked for), the checkpoints `ck [NB, H, NLC, K, V]` of `checkpoint_plan(...)` (the level states
    entering every S-th chunk of each sequence)."""

    o: torch.Tensor | None
    R: torch.Tensor
    t_inv: torch.Tensor
    w: torch.Tensor
    u_bar: torch.Tensor
    qt: torch.Tensor
    firsts: torch.Tensor
    chunks: tuple
    ck: torch.Tensor | None


def kernel_heads(K: int, V: int) -> tuple[int, int]:
    """The head widths these kernels run at, `(K', V')`: K' a power of two and V' a multiple of 32, both at
    least 64; `function.py` zero-pads narrower heads to them (exact: zero key columns add nothing to any
    product, zero value columns are cut from o and the states). Triton 3.6 miscompiles the small or partly
    masked tiles of narrower heads on the H200: at K = V = 32 in bf16 the forward's o was wrong everywhere
    (rel err 1.2) with 64-wide masked key tiles and the chunk-gradient kernel read shared memory out of
    bounds (compute-sanitizer) with 32-wide ones; at 16 `gdn_chunk_kernel` did (`Out-of-range shared or local
    address` at its product with W) and the backward faulted with 16-wide value tiles, the forward with
    32-wide ones. At 64 and 128 both passes match the spec."""
    return max(64, triton.next_power_of_2(K)), max(64, triton.cdiv(V, 32) * 32)


def value_tile(config, V: int, field: str = "gdn_block_v") -> int:
    """A value tile of these kernels: `block(V)` columns, at most the KernelConfig field `field`'s
    (`gdn_block_v`: the level walks and the chunk gradients; `gdn_grads_block_v`: the backward's per-chunk level
    gradients). ValueError for a tile below 32 on the GPU: with 16-wide tiles the compiled backward walk made an
    illegal memory access on the H100 (Triton 3.6, K = V = 128;
    `benchmarks/results/2026-12-06-h100/tune-gdn-block-v-call14.txt`); the interpreter runs any width."""
    tile = getattr(config, field)
    if tile < 32 and not interpreting():
        raise ValueError(f"KernelConfig.{field}: expected at least 32 on the GPU, got {tile}")
    return min(block(V), tile)


def checkpoint_plan(seq_lens: tuple, C: int, device) -> tuple[int, torch.Tensor, int, int]:
    """How the backward splits each sequence's walk: `(S, cu_blocks [N + 1] int32, NB, most)`, blocks of S chunks
    (`KernelConfig.gdn_state_interval`, by default the integer square root of the most grid rows a sequence owns,
    which balances the checkpoints, `NB` of them, against the 2S states and gradients a round holds per
    sequence), sequence n's first block at row `cu_blocks[n]`, `most` the most blocks a sequence has. ValueError for
    an interval below 1."""
    rows = [triton.cdiv(n, C) + 1 for n in seq_lens]  # grid rows per sequence (plan.grid_chunk_table): at least its chunks
    S = get_config().gdn_state_interval
    if S is None:
        S = max(1, math.isqrt(max(rows)))
    elif S < 1:
        raise ValueError(f"KernelConfig.gdn_state_interval: expected at least 1 or None, got {S}")
    blocks = tuple(triton.cdiv(r, S) for r in rows)
    return S, sequence_starts(blocks, device), sum(blocks), max(blocks)


def _walk_plan(seq_lens: tuple, position, L: int, chunks=None):
    """`(config, C, log2 C, N, NLC, grid chunk table, sequence table)` of a walk over `seq_lens` from `position`
    (the grid chunk table formed unless given)."""
    config = get_config()
    C = config.chunk_size
    LOG_C = C.bit_length() - 1
    chunks = grid_chunk_table(seq_lens, position, C) if chunks is None else chunks
    return config, C, LOG_C, len(seq_lens), max(L - LOG_C - 1, 1), chunks, segment_table(seq_lens, 1, C, position.device)[0]


def gdn_forward(q, k, v, g, beta, lam, seq_lens: tuple, position, *, scale, r0=None, out_dtype=None, store_ck=False) -> GdnForward:
    """The forward from flattened tokens (q, k: [N_tok, H, K]; v: [N_tok, H, V]; g, beta: [N_tok, H], g
    may be None; lam: [N_tok, H, L]; all contiguous), sequence n starting at the absolute position
    `position[n]` (device int64) with the entering chunk-level states `r0 [N, H, NLC, K, V]` fp32 (or
    none); `out_dtype` default q's. `store_ck` (the backward's rerun): the checkpoints, and no outputs (`o` is
    None; the walk skips the reads)."""
    N_tok, H, K = q.shape
    V, L = v.shape[-1], lam.shape[-1]
    config, C, LOG_C, N, NLC, chunks, seqs = _walk_plan(seq_lens, position, L)
    t_inv, firsts = wy_solve(k, beta, g, chunk_size=C, chunks=chunks, num_warps=config.num_warps)
    w, u_bar = wy_factors(k, v, beta, g, t_inv, firsts, chunks=chunks, num_warps=config.num_warps)
    BK, F32, FP32_DOT = block(K), dot_f32(q.dtype), fp32_dot_mode(config, "delta_fp32_dot")
    qt = torch.empty(N_tok, H, K, dtype=torch.float32, device=q.device)
    o_intra = None if store_ck else torch.empty(N_tok, H, V, dtype=torch.float32, device=q.device)
    gdn_chunk_kernel[(chunks[2], H)](
        q, k, v, g, beta, lam, w, t_inv, firsts, qt, o_intra, chunks[0], scale, H, K, V, L,
        C=C, LOG_C=LOG_C, BK=BK, BV=min(block(V), config.delta_out_block_v), USE_G=g is not None, F32=F32,
        FP32_DOT=FP32_DOT, STORE_O=not store_ck, num_warps=config.gdn_chunk_warps, num_stages=config.num_stages,
    )
    R = torch.zeros(N, H, NLC, K, V, dtype=torch.float32, device=q.device) if r0 is None else r0.float().contiguous().clone()
    S, cu_blocks, ck = 1, None, None
    if store_ck:
        S, cu_blocks, NB, _ = checkpoint_plan(seq_lens, C, q.device)
        ck = torch.empty(NB, H, NLC, K, V, dtype=torch.float32, device=q.device)
    out = None if store_ck else torch.empty(N_tok, H, V, dtype=out_dtype or q.dtype, device=q.device)
    BV = value_tile(config, V)
    gdn_levels_kernel[(triton.cdiv(V, BV), N, H)](
        k, g, w, u_bar, qt, lam, firsts, o_intra, out, R, ck, cu_blocks, seqs, chunks[0], chunks[1], position,
        H, K, V, L, NLC, S,
        C=C, LOG_C=LOG_C, BK=BK, BV=BV, USE_G=g is not None, F32=F32, FP32_DOT=FP32_DOT, STORE_CK=store_ck,
        num_warps=config.gdn_num_warps, num_stages=config.num_stages,
    )
    return GdnForward(out, R, t_inv, w, u_bar, qt, firsts, chunks, ck)


def gdn_levels_backward(k, g, lam, fwd: GdnForward, do, dR, seq_lens: tuple, position):
    """The chunk-levels' backward from flattened tokens as `gdn_forward` took them, its result `fwd` (with `ck`),
    the output gradient `do [N_tok, H, V]` and that of the leaving states `dR [N, H, NLC, K, V]` (or None):
    `(dq̃, dW, dK̃ [N_tok, H, K], dŪ [N_tok, H, V], dlast [NC, H], dlam [N_tok, H, L] (the chunk-level columns),
    dr0 [N, H, NLC, K, V])`, all fp32, as `gdn_levels_backward_ref` defines them. One round per block of S chunks
    from the sequences' ends (the most blocks any sequence has): `gdn_levels_chain_kernel` walks each
    sequence's block, `gdn_levels_grads_kernel` forms its gradients, a program per chunk and value tile."""
    N_tok, H, K = k.shape
    V, L = do.shape[-1], lam.shape[-1]
    config, C, LOG_C, N, NLC, chunks, seqs = _walk_plan(seq_lens, position, L, fwd.chunks)
    BK, BVG = block(K), value_tile(config, V, "gdn_grads_block_v")
    # the chain's value tile: at least 64 wide, where Triton 3.6 compiled its W^T dx ([64, 64] @ [64, 32]) to an
    # out-of-range shared-memory access on the H100 (compute-sanitizer; heads of 16 and 32 padded to 64,
    # test_gdn_triton_model_heads); at K = 128 and 32-wide tiles the same tree faulted at the standard shape (call 29)
    BV = max(value_tile(config, V), min(block(V), 64))
    n_v, n_vg, NC = triton.cdiv(V, BV), triton.cdiv(V, BVG), chunks[2]
    dstate = torch.zeros(N, H, NLC, K, V, dtype=torch.float32, device=k.device) if dR is None else dR.float().contiguous().clone()
    S, cu_blocks, _, rounds = checkpoint_plan(seq_lens, C, k.device)
    hs, dhs = (torch.empty(N, H, S, NLC, K, V, dtype=torch.float32, device=k.device) for _ in range(2))
    xs, dxs = (torch.empty(N, H, S, NLC, C, V, dtype=torch.float32, device=k.device) for _ in range(2))
    atomic = n_vg > 1 and not torch.are_deterministic_algorithms_enabled()
    parts = 1 if atomic else n_vg
    dqt, dw, dkt = ((torch.zeros if atomic else torch.empty)(parts, N_tok, H, K, dtype=torch.float32, device=k.device) for _ in range(3))
    du = torch.empty(N_tok, H, V, dtype=torch.float32, device=k.device)
    dlast = torch.zeros(n_vg, NC, H, dtype=torch.float32, device=k.device)
    dlam = torch.zeros(n_vg, N_tok, H, L, dtype=torch.float32, device=k.device)
    do = do.contiguous()
    F32, FP32_DOT = dot_f32(k.dtype), fp32_dot_mode(config, "delta_fp32_dot")
    for jb in range(rounds):
        for part in (0, 1):
            gdn_levels_chain_kernel[(n_v * NLC, N, H)](
                k, g, fwd.w, fwd.u_bar, fwd.qt, lam, fwd.firsts, do, fwd.ck, cu_blocks, hs, xs, dhs, dxs, dstate,
                seqs, chunks[0], chunks[1], position, jb, n_v, H, K, V, L, NLC, S,
                C=C, LOG_C=LOG_C, BK=BK, BV=BV, USE_G=g is not None, F32=F32, FP32_DOT=FP32_DOT, PART=part,
                num_warps=config.gdn_chain_warps, num_stages=config.num_stages,
            )
        gdn_levels_grads_kernel[(S * n_vg, N, H)](
            k, g, fwd.qt, lam, do, hs, xs, dhs, dxs, dqt, dw, dkt, du, dlast, dlam,
            seqs, chunks[0], chunks[1], position, jb, N_tok, NC, H, K, V, L, NLC, S,
            C=C, LOG_C=LOG_C, BK=BK, BV=BVG, USE_G=g is not None, F32=F32, FP32_DOT=FP32_DOT, ATOMIC=atomic,
            num_warps=config.gdn_grads_warps, num_stages=config.num_stages,
        )
    del hs, xs, dhs, dxs
    return (*(x[0] if atomic else x.sum(0) for x in (dqt, dw, dkt)), du, dlast.sum(0), dlam.sum(0), dstate)
