"""One *level pass* of chunked log-linear attention (Mamba-2 base): the intra-chunk level-masked block
and every inter-chunk level, fused in one sequential walk over a sequence's chunks.

A pass over flattened tokens with `a, b: [N_tok, H, DA]`, `c: [N_tok, H, DC]`, log-decay `g` and level
weights `lam: [N_tok, H, L]`, at absolute positions `P + j` (`P` = the sequence's start position):

    causal      out_t = scale * sum_{s <= t} lam[t, level(t, s)] exp(G_t - G_s) (a_t . b_s) c_s
    anticausal  out_s = scale * sum_{t >= s} lam[t, level(t, s)] exp(G_t - G_s) (a_s . b_t) c_t

The weight always belongs to the later position `t` (the query of the forward): on the output row
of a causal pass, on the input row of an anticausal one. The forward is the causal pass
`(q, k, v)`, dq the causal pass `(do, v, k)`, dv and dk the anticausal passes `(k, q, do)` and
`(v, do, q)`, walked as one (`anticausal_pair`: the second's states are the first's transposed; function.py).

Chunks of `C = 2^c` tokens sit on the absolute grid. Inside a chunk the level is `bit_length(i ^ j)`
of the in-chunk offsets (levels `0..c`); between chunks `n > m` it is `c + 1 + ell` with
`ell = bit_length(n ^ m) - 1`: `m` lies in the first half and `n` in the second half of the same
aligned block of `2^(ell+1)` chunks. So chunk-level `ell` is a block-masked linear attention, and
one state per chunk-level suffices (ops/loglinear/README.md, "Triton kernels"):

    R[ell] = sum of the contributions of the chunks of the current block's first half seen so far

Causal walk, chunk `n`: for every `ell` with bit `ell` of `n` set, read `R[ell]` (weighted by
`lam[t, c+1+ell]`). Where bit `ell` is set, `R[ell]` is a whole aligned block of `2^ell` chunks, and the weight
sits on the reader, so the causal walk keeps only those: a binary counter over the chunk index. Moving to
`n + 1`, the chunk's contribution `b^T (decayed c)` and the blocks of `n`'s trailing set bits merge into the
block of its lowest unset bit `j` (one product and about one state load per chunk, instead of a product per unset
bit); the levels below `j` empty. The carry is formed inside the level loop, at `ell = j` after the reads below it,
as the anticausal adds are: formed after the loop, its product read shared memory out of bounds at 16-column tiles
on an H100 (Triton 3.6), which passed under the interpreter. Anticausal walk (chunks from last to first; levels are symmetric,
`level(t, s) = bit_length(t ^ s)`): read where bit `ell` is 0, add where it is 1 (weighted by
`lam[t, c+1+ell]` of the adding rows, one product per level), empty after the block's first chunk.

The states live in a global fp32 buffer the program owns (`state [N, H, NLC, DA, DC]`, its
`[DA, BC]` tile per level: a few MB per program wave, L2-resident), not in registers: a chunk
touches every level once (a read or an add), and Triton cannot index a register array by level.
Decay is lazy: a level that is only read keeps a pending log2-decay `p[ell]` (a register vector)
instead of being rescaled, an add materialises it; `p = -inf` marks an empty level. The buffer
enters holding the initial per-level states (or nothing) and leaves holding the states after the
last chunk (no reset there), decayed to the sequence's end: the pass's final state. A causal walk reads only
what entered at the first chunk's set bits and at its carry's target `j0`, which holds (function.py,
`fenwick_to_blocks`) the blocks of the lower set bits and the chunk's keys before the sequence's start, so that
first carry merges `j0` alone; it leaves the blocks of the last chunk's set bits (the other levels empty).
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from polyattn.ops.common.fenwick import level_table
from polyattn.ops.linear.triton.chunk_states import add_keys_times_values, update_dot
from polyattn.ops.triton.decay import chunk_decay, chunk_segsum, chunk_side_decays, select_scores
from polyattn.ops.triton.plan import KernelConfig, block, get_config, narrow_block, num_sms, segment_table, state_tile
from polyattn.ops.triton.precision import (
    dot_f32, first_nonfinite_row, mma, mma_left_fp32, mma_right_acc, mma_right_fp32, mma_right_halves, nan_rows_from,
    split_halves, to_output, zero_rows_from,
)


@triton.jit
def bit_length(x):
    """`bit_length` of a non-negative scalar integer."""
    n = x * 0
    while x > 0:
        n += 1
        x = x >> 1
    return n


@triton.jit
def load_state(p, mask, EVEN: tl.constexpr):
    """The `[BA, BC]` state tile at `p`, unmasked where the tiles cover the states exactly (EVEN): the mask need not
    stay live through the walk."""
    if EVEN:
        x = tl.load(p)
    else:
        x = tl.load(p, mask=mask, other=0.0)
    return x


@triton.jit
def store_state(p, x, mask, EVEN: tl.constexpr):
    """`load_state`'s store."""
    if EVEN:
        tl.store(p, x)
    else:
        tl.store(p, x, mask=mask)


@triton.jit
def intra_levels(C: tl.constexpr, LOG_C: tl.constexpr, off):
    """The [C, C] level table of in-chunk offsets `off + i`, `bit_length((off + i) ^ (off + j))`
    (symmetric; causality is the segment-sum mask's; rows past the chunk are masked by the caller)."""
    o_t = off + tl.arange(0, C)
    x = o_t[:, None] ^ o_t[None, :]
    lev = tl.zeros([C, C], dtype=tl.int32)
    for b in tl.static_range(LOG_C):
        lev += ((x >> b) > 0).to(tl.int32)
    return lev


@triton.jit(do_not_specialize=["N_tok"])
def level_pass_kernel(
    a, b, c, a2, g, lam, out, out2, seg, pos, state, dot_x, rowdot, dlam,
    scale, N_tok, H, DA, DC, L, NLC,
    C: tl.constexpr, LOG_C: tl.constexpr, BA: tl.constexpr, BC: tl.constexpr, BL: tl.constexpr, BLV: tl.constexpr,
    REVERSE: tl.constexpr, USE_G: tl.constexpr, USE_H0: tl.constexpr, ROWDOT: tl.constexpr,
    DLAM: tl.constexpr, F32: tl.constexpr, GUARD: tl.constexpr, UPDATE_DOT: tl.constexpr, ATOMIC: tl.constexpr,
    EVEN: tl.constexpr,
):
    """One sequence, one head, one DC tile.

    grid: (cdiv(DC, BC), N, H). Tiling: a, b rows of the full DA (padded to BA); c / out columns
    [BC]; per chunk the products `[C, BA] @ [BA, C]` (scores), `[C, C] @ [C, BC]` (intra),
    `[C, BA] @ [BA, BC]` per level read and `[BA, C] @ [C, BC]` per add.
    REVERSE runs the anticausal pair: besides `out` (the pass `(a, b, c)`), `out2 [N_tok, H, DA]` = the pass
    `(a2, c, b)` (`a2: [N_tok, H, DC]`), whose states are the transposes of these: the same loads and adds serve
    both, and the chunk's reads (unweighted) are summed into one state read once per output, the second as
    `[C, BC] @ [BC, BA]`. A program holds only its DC tile of the contraction, so
    with several tiles (ATOMIC) it adds its part of out2 to an fp32 `out2` that enters zeroed; without ATOMIC it
    stores its share at `out2[i_c]` (`[n_c, N_tok, H, DA]`; one tile: the output itself).
    `seg` rows are the sequences' `(bos, eos, ., .)`, `pos [N]` their start positions. ROWDOT:
    `rowdot[i_c, t] = sum(dot_x * out, -1)` per tile (the log-decay gradient's term; REVERSE: `dot_x [N_tok, H, DA]`
    against out2); DLAM (causal
    only): `dlam[i_c, t, l]` = the tile's part of the unweighted level-l share of `out_t` dotted with
    `dot_x_t`, for the reads, and for levels `0..c` `sum_s [level = l] att_ts (dot_x_t . c_s)`.
    GUARD (the forward pass): a NaN or Inf in a row of b or c changes no earlier output, inline here
    (its cost was within noise on the H200), as in the linear kernel's guarded loop
    (ops/linear/triton/chunk_outputs.py): masked scores selected to 0, the intra product on c with the
    rows from the first such token zeroed, the outputs from it on NaN.
    UPDATE_DOT (`precision.UPDATE_DOTS`): how the adds' fp32 operand (the decayed c) enters the tensor cores on
    bf16/fp16 inputs, split (0) or rounded (2, `level_pass`'s `rounded`); the reads' states always split.
    EVEN: the state tiles cover the states exactly (`DA == BA`, `BC` divides DC): their loads and stores unmasked.
    """
    i_c, i_n, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(seg + i_n * 4).to(tl.int64)
    eos = tl.load(seg + i_n * 4 + 1).to(tl.int64)
    P = tl.load(pos + i_n).to(tl.int64)
    E = P + (eos - bos)  # absolute end (exclusive)
    n0 = P // C
    n1 = (E - 1) // C
    NL = tl.minimum(bit_length(n1), NLC)  # chunk-levels in play: no chunk index has a higher bit (NLC: lam too short)
    o_a, o_c, m_a, m_c, m_s = state_tile(i_c, DA, DC, BA, BC)
    o_t = tl.arange(0, C)
    o_l = tl.arange(0, BL)
    o_lv = tl.arange(0, BLV)  # in-chunk levels 0..c, padded
    lut = intra_levels(C, LOG_C, 0)  # [C, C]
    # the level states at a scalar base plus int32 offsets: a [BA, BC] pointer tensor held two registers an element
    # through the walk (ptxas, 64 columns, 8 warps: forward / dq / pair 128 / 288 / 584 -> 44 / 180 / 464 bytes spilled)
    p_seq = state + ((i_n * H + i_h) * NLC * DA).to(tl.int64) * DC  # scalar: the sequence's and head's levels
    off_s = o_a[:, None] * DC + o_c[None, :]  # [BA, BC]
    b_p = tl.full([BL], float("-inf"), dtype=tl.float32)
    if USE_H0:  # anticausal: every level holds what entered; causal: the first chunk's set bits and its carry's target
        live = o_l < NLC
        if not REVERSE:
            live = live & ((((n0 >> o_l) & 1) == 1) | (o_l == bit_length(n0 ^ (n0 + 1)) - 1))
        b_p = tl.where(live, 0.0, b_p)
    n_chunks = n1 - n0 + 1
    for i in range(0, n_chunks):
        if REVERSE:
            n = n1 - i
        else:
            n = n0 + i
        inner = i < n_chunks - 1  # the last chunk of the walk empties no level: its states leave the pass
        tpos = n * C + o_t  # absolute positions of the chunk's rows
        t = bos + (tpos - P)  # token rows
        m_t = (tpos >= P) & (tpos < E)
        row_a = (t * H + i_h)[:, None] * DA + o_a[None, :]  # [C, BA]
        row_c = (t * H + i_h)[:, None] * DC + o_c[None, :]  # [C, BC]
        m_ta = m_t[:, None] & m_a[None, :]
        m_tc = m_t[:, None] & m_c[None, :]
        row_l = (t * H + i_h) * L  # [C]
        b_a = tl.load(a + row_a, mask=m_ta, other=0.0)  # [C, BA]
        b_b = tl.load(b + row_a, mask=m_ta, other=0.0)  # [C, BA]
        b_v = tl.load(c + row_c, mask=m_tc, other=0.0)  # [C, BC]
        b_g, b_gc, b_last = chunk_decay(g, t, m_t, H, i_h, USE_G)  # [C], [C], scalar
        b_wq, b_wk = chunk_side_decays(b_g, b_gc, b_last, REVERSE, F32)  # [C], [C]
        b_d = chunk_segsum(b_g, b_gc, b_last, REVERSE, F32)  # [C, C]

        # intra-chunk: the score block weighted by lam[t, level(i, j)] (t = row causal, column anticausal)
        b_att = mma(b_a, tl.trans(b_b), F32)  # [C, BA] @ [BA, C] -> [C, C]
        if GUARD:
            first = first_nonfinite_row(b_v)  # scalar: C when every value row is finite
            b_att = select_scores(b_att, b_d, scale)  # [C, C]
            b_vi = zero_rows_from(b_v, first)  # [C, BC]: the intra product's values
        else:
            b_att = b_att * (tl.exp2(b_d) * scale)  # [C, C]
            b_vi = b_v
        if REVERSE:  # the chunk's in-chunk-level weights, then gathered by level
            b_lw = tl.load(lam + row_l[None, :] + o_lv[:, None], mask=m_t[None, :] & (o_lv[:, None] < L), other=0.0)  # [BLV, C]
            b_w = tl.gather(b_lw.to(tl.float32), lut, 0)  # [C, C]: lam[j, lut[i, j]], the column's row
        else:
            b_lw = tl.load(lam + row_l[:, None] + o_lv[None, :], mask=m_t[:, None] & (o_lv[None, :] < L), other=0.0)  # [C, BLV]
            b_w = tl.gather(b_lw.to(tl.float32), lut, 1)  # [C, C]: lam[i, lut[i, j]]
        b_o = mma_left_fp32(b_att * b_w, b_vi, F32)  # [C, C] @ [C, BC] -> [C, BC]
        if REVERSE:  # the transposed pass: scores (a2 . c) over the tile's columns (a part of them), on b's rows
            b_a2 = tl.load(a2 + row_c, mask=m_tc, other=0.0)  # [C, BC]
            b_att2 = mma(b_a2, tl.trans(b_v), F32) * (tl.exp2(b_d) * scale) * b_w  # [C, BC] @ [BC, C] -> [C, C]
            b_o2 = mma_left_fp32(b_att2, b_b, F32)  # [C, C] @ [C, BA] -> [C, BA]
        if DLAM:
            b_x = tl.load(dot_x + row_c, mask=m_tc, other=0.0)  # [C, BC]
            b_xc = mma(b_x, tl.trans(b_v), F32) * b_att  # [C, BC] @ [BC, C] -> [C, C]
            p_dl = dlam + (i_c * N_tok + t) * H * L + i_h * L  # [C]
            for lv in tl.static_range(LOG_C + 1):
                tl.store(p_dl + lv, tl.sum(tl.where(lut == lv, b_xc, 0.0), axis=1), mask=m_t & (o_t * 0 + lv < L))

        # inter-chunk: causal, a read per set bit of n; anticausal, a read or an add per chunk-level
        b_wa = tl.exp2(b_wq) * scale  # [C]
        b_added = tl.zeros([BL], dtype=tl.int32)  # the levels the chunk added to, current at its end
        if not REVERSE:  # the carry to n + 1 at level j, n's lowest unset bit; at the walk's first chunk what entered
            # at j already holds the blocks below it (and the chunk's keys before the sequence's start: function.py,
            # fenwick_to_blocks)
            j = bit_length(n ^ (n + 1)) - 1
            lo = tl.where(i == 0, j, 0)
        else:  # the reads carry no level weight: the read states, each at its pending decay, summed for one product
            b_rs = tl.zeros([BA, BC], dtype=tl.float32)  # [BA, BC]
            n_rs = tl.full([], 0, tl.int32)
        for ell in range(0, NL):
            bit = (n >> ell) & 1
            p_ell = tl.sum(tl.where(o_l == ell, b_p, 0.0), axis=0)
            p_s = (p_seq + ell * DA * DC) + off_s
            if REVERSE:
                reads = bit == 0
            else:
                reads = bit == 1
            if reads:
                if p_ell > float("-inf"):
                    b_s = load_state(p_s, m_s, EVEN)  # [BA, BC]
                    if REVERSE:
                        b_rs += b_s * tl.exp2(p_ell)
                        n_rs += 1
                    else:
                        b_r = mma_right_fp32(b_a, b_s, F32) * (b_wa * tl.exp2(p_ell))[:, None]  # [C, BA] @ [BA, BC] -> [C, BC]
                        b_lam = tl.load(lam + row_l + (LOG_C + 1 + ell), mask=m_t, other=0.0).to(tl.float32)  # [C]
                        b_o += b_r * b_lam[:, None]
                        if DLAM:
                            tl.store(p_dl + (LOG_C + 1 + ell), tl.sum(b_x.to(tl.float32) * b_r, axis=1), mask=m_t)
                if REVERSE:
                    if (n % (2 << ell) == 0) & inner:  # the level's block starts here, walked last: the level empties
                        p_ell = tl.full([], float("-inf"), tl.float32)
            elif REVERSE:  # the weight is the adding rows': one product per chunk-level
                b_lam = tl.load(lam + row_l + (LOG_C + 1 + ell), mask=m_t, other=0.0).to(tl.float32)  # [C]
                b_wv = b_v.to(tl.float32) * (tl.exp2(b_wk) * b_lam)[:, None]  # [C, BC]
                b_add = mma_right_acc(tl.trans(b_b), b_wv, tl.zeros([BA, BC], dtype=tl.float32), F32, UPDATE_DOT)
                if p_ell > float("-inf"):
                    b_add += load_state(p_s, m_s, EVEN) * tl.exp2(p_ell + b_last)
                store_state(p_s, b_add, m_s, EVEN)
                p_ell = tl.full([], 0.0, tl.float32)
                b_added = tl.where(o_l == ell, 1, b_added)
            elif inner & (ell == j):  # the carry: the chunk and the blocks of n's trailing set bits (read above)
                b_add = tl.zeros([BA, BC], dtype=tl.float32)  # become the block of level j; the loaded blocks first,
                for e in range(lo, ell + 1):  # as the product's accumulator (a separate sum spilled: ptxas, forward)
                    p_e = tl.sum(tl.where(o_l == e, b_p, 0.0), axis=0)
                    if p_e > float("-inf"):
                        b_add += load_state((p_seq + e * DA * DC) + off_s, m_s, EVEN) * tl.exp2(p_e + b_last)
                b_add = add_keys_times_values(b_add, b_b, b_v, b_wk, USE_G, F32, UPDATE_DOT)  # [BA, C] @ [C, BC] -> [BA, BC]
                store_state(p_s, b_add, m_s, EVEN)
                p_ell = tl.full([], 0.0, tl.float32)
                b_added = tl.where(o_l == ell, 1, b_added)
            b_p = tl.where(o_l == ell, p_ell, b_p)
            if REVERSE:  # after the last level (inside the loop, as the causal carry: see above), the summed reads
                if (ell == NL - 1) & (n_rs > 0):
                    b_hi, b_lo = split_halves(b_rs, b_a.dtype, F32)  # [BA, BC] x 2: one split for both reads
                    b_o += mma_right_halves(b_a, b_hi, b_lo, F32) * b_wa[:, None]  # [C, BA] @ [BA, BC] -> [C, BC]
                    b_o2 += mma_right_halves(b_a2, tl.trans(b_hi), tl.trans(b_lo), F32) * b_wa[:, None]  # [C, BC] @ [BC, BA] -> [C, BA]
        b_p = tl.where(b_added == 1, b_p, b_p + b_last)  # the other states decay through the chunk (empty ones stay empty)

        if GUARD:
            b_o = nan_rows_from(b_o, first)  # [C, BC]
        tl.store(out + row_c, to_output(b_o, out.dtype.element_ty, F32), mask=m_tc)  # downcast: output dtype
        if REVERSE:
            if ATOMIC:  # the tile's part of out2
                tl.atomic_add(out2 + row_a, b_o2, mask=m_ta, sem="relaxed")
            else:
                p_o2 = out2 + (i_c * N_tok).to(tl.int64) * H * DA + row_a  # [C, BA]: the tile's share
                tl.store(p_o2, to_output(b_o2, out2.dtype.element_ty, F32), mask=m_ta)  # downcast: output dtype
        if ROWDOT:
            if REVERSE:
                b_x2 = tl.load(dot_x + row_a, mask=m_ta, other=0.0)  # [C, BA]
                tl.store(rowdot + (i_c * N_tok + t) * H + i_h, tl.sum(b_x2.to(tl.float32) * b_o2, axis=1), mask=m_t)
            else:
                if not DLAM:
                    b_x = tl.load(dot_x + row_c, mask=m_tc, other=0.0)  # [C, BC]
                tl.store(rowdot + (i_c * N_tok + t) * H + i_h, tl.sum(b_x.to(tl.float32) * b_o, axis=1), mask=m_t)

        if not REVERSE:
            if inner:  # the levels below the carry's target empty
                b_p = tl.where(o_l < j, float("-inf"), b_p)

    # the final state: every level decayed to the sequence's end, zero where empty
    for ell in range(0, NLC):
        p_ell = tl.sum(tl.where(o_l == ell, b_p, 0.0), axis=0)
        p_s = (p_seq + ell * DA * DC) + off_s
        if p_ell == float("-inf"):
            store_state(p_s, tl.zeros([BA, BC], dtype=tl.float32), m_s, EVEN)
        elif p_ell < 0.0:
            store_state(p_s, load_state(p_s, m_s, EVEN) * tl.exp2(p_ell), m_s, EVEN)


def _launch(a, b, c, a2, g, lam, position, seq_lens, *, scale, reverse, initial_state, dot_x, want_dlam, out_dtype,
            chunk_size, guard, rounded, config):
    """Launch `level_pass_kernel` (the arguments of `level_pass` and `anticausal_pair`): `(out, out2 or None, state,
    rowdot or None, dlam or None)`."""
    config = config or get_config()
    N_tok, H, DA = a.shape
    DC, L = c.shape[-1], lam.shape[-1]
    N = len(seq_lens)
    C = chunk_size or config.chunk_size
    LOG_C = C.bit_length() - 1
    NLC = max(L - LOG_C - 1, 1)
    BA = block(DA)
    target = config.level_programs_per_sm * num_sms(a.device)  # few sequences x heads: narrower value tiles while
    BC = narrow_block(min(block(DC), config.block_c), DC, N * H, target - 1)  # the programs number fewer than this
    n_c = triton.cdiv(DC, BC)
    F32 = dot_f32(a.dtype)
    seg = segment_table(seq_lens, 1, C, a.device)[0]
    if initial_state is not None:
        state = initial_state.to(torch.float32, copy=True).contiguous()
    else:
        state = torch.empty(N, H, NLC, DA, DC, dtype=torch.float32, device=a.device)
    out = torch.empty_like(c, dtype=out_dtype or c.dtype)
    # the tiles' parts of out2 meet in fp32, by atomic adds into zeros: two addends onto zero commute exactly, so two
    # tiles give the same bits on every run; more, under torch.use_deterministic_algorithms, store shares summed after
    atomic = n_c == 2 or (n_c > 2 and not torch.are_deterministic_algorithms_enabled())
    out2 = None
    if reverse and atomic:
        out2 = torch.zeros_like(b, dtype=torch.float32)
    elif reverse:
        out2 = torch.empty(n_c, *b.shape, dtype=out_dtype or b.dtype if n_c == 1 else torch.float32, device=a.device)
    rowdot = torch.empty(n_c, N_tok, H, dtype=torch.float32, device=a.device) if dot_x is not None else None
    dlam = torch.zeros(n_c, N_tok, H, L, dtype=torch.float32, device=a.device) if want_dlam else None
    # the pair holds out2's [C, DA] fp32 sum beside its tile at every width (ptxas, sm_90a, 32 columns: 732 bytes a
    # thread spilled at 4 warps, 104 at 8); a causal pass's narrowed tiles ran faster at 4
    warps = config.level_wide_warps if BC >= 64 or reverse else config.num_warps
    level_pass_kernel[(n_c, N, H)](
        a, b, c, a2, g, lam, out, out2, seg, position, state, dot_x, rowdot, dlam,
        scale, N_tok, H, DA, DC, L, NLC,
        C=C, LOG_C=LOG_C, BA=BA, BC=BC, BL=triton.next_power_of_2(NLC), BLV=triton.next_power_of_2(LOG_C + 1),
        REVERSE=reverse, USE_G=g is not None, USE_H0=initial_state is not None,
        ROWDOT=dot_x is not None, DLAM=want_dlam, F32=F32, GUARD=guard, UPDATE_DOT=update_dot(config, rounded),
        ATOMIC=atomic, EVEN=DA == BA and DC % BC == 0, num_warps=warps, num_stages=config.num_stages,
    )
    if reverse and not atomic:
        out2 = out2.sum(0) if n_c > 1 else out2[0]  # [n_c, N_tok, H, DA] -> [N_tok, H, DA]
    if rowdot is not None:
        rowdot = rowdot.sum(0)  # [n_c, N_tok, H] -> [N_tok, H]
    if dlam is not None:
        dlam = dlam.sum(0)  # [n_c, N_tok, H, L] -> [N_tok, H, L]
    return out, out2, state, rowdot, dlam


def level_pass(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, g: torch.Tensor | None, lam: torch.Tensor,
    position: torch.Tensor, seq_lens: tuple, *, scale: float, initial_state: torch.Tensor | None = None,
    dot_x: torch.Tensor | None = None, want_dlam: bool = False, out_dtype: torch.dtype | None = None,
    chunk_size: int | None = None, guard: bool = False, rounded: bool = False, config: KernelConfig | None = None,
):
    """Run one causal level pass over flattened tokens (the forward, dq).

    a, b: [N_tok, H, DA]; c, dot_x: [N_tok, H, DC]; g: [N_tok, H] or None; lam: [N_tok, H, L]; all
    contiguous. position: [N] int64 start positions; seq_lens: host lengths (each >= 1).
    initial_state: [N, H, NLC, DA, DC] fp32 per-level states at the first chunk's start
    (`fenwick_to_blocks`), NLC = max(L - c - 1, 1).
    chunk_size: default the config's. out_dtype: default c's dtype (fp32 when more terms are added to `out` before one rounding).
    guard: keep a non-finite row of b or c out of every earlier output (the forward pass).
    rounded: the adds' decayed c may enter the tensor cores rounded to the input dtype (`chunk_states.update_dot`,
    `KernelConfig.decay_update_dot`): for a forward whose leaving states nobody reads. The reads' states stay split:
    rounded too, o's error at fp16 rose to 1.7x the split's (0.86 of the tests' bound) under the interpreter at
    T = 200, against 1.04x with the adds alone rounded.
    Returns `(out [N_tok, H, DC] in out_dtype, state [N, H, NLC, DA, DC] fp32 (the states leaving
    the pass), rowdot [N_tok, H] fp32 or None, dlam [N_tok, H, L] fp32 or None)`.
    """
    out, _, state, rowdot, dlam = _launch(
        a, b, c, None, g, lam, position, seq_lens, scale=scale, reverse=False, initial_state=initial_state, dot_x=dot_x,
        want_dlam=want_dlam, out_dtype=out_dtype, chunk_size=chunk_size, guard=guard, rounded=rounded, config=config,
    )
    return out, state, rowdot, dlam


def anticausal_pair(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, a2: torch.Tensor, g: torch.Tensor | None, lam: torch.Tensor,
    position: torch.Tensor, seq_lens: tuple, *, scale: float, initial_state: torch.Tensor | None = None,
    dot_x: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, chunk_size: int | None = None,
    config: KernelConfig | None = None,
):
    """The anticausal passes `(a, b, c)` and `(a2, c, b)` in one walk (dv and dk: `(k, q, do)` and `(v, do, q)`).

    a, b, dot_x: [N_tok, H, DA]; c, a2: [N_tok, H, DC]; the rest as `level_pass`. initial_state: [N, H, NLC, DA, DC]
    fp32, the first pass's states at the last chunk's end (the second pass's are their transposes).
    Returns `(out [N_tok, H, DC], out2 [N_tok, H, DA] (out_dtype, or fp32 when several value tiles add their parts),
    state [N, H, NLC, DA, DC] fp32 (the first pass's states leaving it), rowdot [N_tok, H] = sum(dot_x * out2, -1)
    fp32 or None)`.
    """
    out, out2, state, rowdot, _ = _launch(
        a, b, c, a2, g, lam, position, seq_lens, scale=scale, reverse=True, initial_state=initial_state, dot_x=dot_x,
        want_dlam=False, out_dtype=out_dtype, chunk_size=chunk_size, guard=False, rounded=False, config=config,
    )
    return out, out2, state, rowdot


def level_pass_ref(a, b, c, g, lam, position, seq_lens, *, scale, reverse, chunk_size, initial_state=None):
    """Twin of `level_pass` (reverse: of one pass of `anticausal_pair`), `out` and the leaving states, in float64:
    the same walks with explicit decays, one [H, DA, DC] state per chunk-level and the level table of
    `ops.common.fenwick`."""
    C = chunk_size
    c_bits = C.bit_length() - 1
    N_tok, H, DA = a.shape
    DC, L = c.shape[-1], lam.shape[-1]
    NLC = max(L - c_bits - 1, 1)
    dev = a.device
    a, b, c = (x.double() for x in (a, b, c))
    lam = F.pad(lam.double(), [0, c_bits + 1 + NLC - L]) if L < c_bits + 1 + NLC else lam.double()  # [N_tok, H, >= c+1+NLC]
    g = torch.zeros(N_tok, H, dtype=torch.float64, device=dev) if g is None else g.double()
    lut = level_table(C, device=dev)  # [C, C], -1 above the diagonal
    lut = torch.maximum(lut, lut.t())  # symmetric: bit_length(i ^ j)
    o_t = torch.arange(C, device=dev)
    tri = o_t[None, :] >= o_t[:, None] if reverse else o_t[:, None] >= o_t[None, :]  # [C, C]
    out = torch.zeros(N_tok, H, DC, dtype=torch.float64, device=dev)
    states = torch.zeros(len(seq_lens), H, NLC, DA, DC, dtype=torch.float64, device=dev)
    if initial_state is not None:
        states = initial_state.double().clone()
    bos = 0
    for i, n_len in enumerate(seq_lens):
        P = int(position[i])
        E = P + n_len
        n0, n1 = P // C, (E - 1) // C
        R = states[i]  # [H, NLC, DA, DC]
        walk = range(n1, n0 - 1, -1) if reverse else range(n0, n1 + 1)
        if not reverse:  # the causal walk keeps the blocks of n0's set bits and what enters at its carry's target
            j0 = (n0 ^ (n0 + 1)).bit_length() - 1
            kept = [(n0 >> ell) & 1 == 1 or ell == j0 for ell in range(NLC)]
            R[:, [not x for x in kept]] = 0.0
        for n in walk:
            apos = n * C + o_t
            real = (apos >= P) & (apos < E)  # [C]
            idx = torch.where(real, bos + apos - P, 0)
            A, Bm, Cm, gg, lc = (torch.where(real.view(-1, *[1] * (x.dim() - 1)), x[idx], 0.0) for x in (a, b, c, g, lam))
            Gc = torch.cumsum(gg, 0)  # [C, H]
            total = Gc[-1]  # [H]
            wq, wk = (torch.exp(total - Gc), torch.exp(Gc)) if reverse else (torch.exp(Gc), torch.exp(total - Gc))  # [C, H]
            seg = (Gc[None, :] - Gc[:, None]) if reverse else (Gc[:, None] - Gc[None, :])  # [C, C, H]
            D = torch.where(tri[..., None], torch.exp(torch.where(tri[..., None], seg, 0.0)), 0.0)  # [C, C, H]
            if reverse:
                W = torch.stack([lc[o_t[None, :].expand(C, C), h, lut] for h in range(H)], -1)  # [C, C, H]: lam[j, lut]
            else:
                W = torch.stack([lc[o_t[:, None].expand(C, C), h, lut] for h in range(H)], -1)  # [C, C, H]: lam[i, lut]
            att = torch.einsum("ihd,jhd->ijh", A, Bm) * D * W * scale  # [C, C, H]
            o = torch.einsum("ijh,jhc->ihc", att, Cm)  # [C, H, DC]
            for ell in range(n1.bit_length()):
                bit = (n >> ell) & 1
                if bit == (0 if reverse else 1):
                    r = scale * torch.einsum("ihd,hdc->ihc", A, R[:, ell]) * wq[..., None]  # [C, H, DC]
                    o = o + (r if reverse else r * lc[:, :, c_bits + 1 + ell, None])
            R.mul_(torch.exp(total)[:, None, None, None])
            if reverse:  # a weighted add per level where bit ell is 1; a level empties after its block's first chunk
                for ell in range(n1.bit_length()):
                    if (n >> ell) & 1 == 1:
                        R[:, ell] += torch.einsum("ihd,ihc->hdc", Bm * (wk * lc[:, :, c_bits + 1 + ell])[..., None], Cm)
                    if n % (2 << ell) == 0 and n != walk[-1]:
                        R[:, ell] = 0.0
            elif n != walk[-1]:  # the carry: the chunk and n's trailing set bits' blocks become the block of its lowest
                j = (n ^ (n + 1)).bit_length() - 1  # unset bit j (at the first chunk, what entered at j holds those blocks)
                lo = j if n == n0 else 0
                merged = R[:, lo : j + 1].sum(1) + torch.einsum("ihd,ihc->hdc", Bm * wk[..., None], Cm)  # [H, DA, DC]
                R[:, : j + 1] = 0.0
                if j < NLC:
                    R[:, j] = merged
            out[idx[real]] = o[real]
        bos += n_len
    return out, states


def anticausal_pair_ref(a, b, c, a2, g, lam, position, seq_lens, *, scale, chunk_size, initial_state=None):
    """Twin of `anticausal_pair` in float64: `(out, out2, state)`, its two passes walked one after the other."""
    kw = dict(scale=scale, reverse=True, chunk_size=chunk_size)
    out, state = level_pass_ref(a, b, c, g, lam, position, seq_lens, initial_state=initial_state, **kw)
    transposed = None if initial_state is None else initial_state.transpose(-1, -2)
    out2, _ = level_pass_ref(a2, c, b, g, lam, position, seq_lens, initial_state=transposed, **kw)
    return out, out2, state
