"""Stage 2 of a pass: outputs with the state kept on chip.

`chunk_outputs_kernel` implements `linear_attn_chunk` (ops/linear/chunk.py) for one segment:
per chunk of C tokens, with `Gc` the chunk-local inclusive cumsum of the log2-decay,

    causal      out = scale * [((a b^T) * exp2(D_ij) * [j <= i]) @ c + exp2(Gc_i) * (a @ S)]
                S   = exp2(Gc_last) S + (b * exp2(Gs_j))^T @ c
    anticausal  out = scale * [((a b^T) * exp2(D_ij) * [j >= i]) @ c + exp2(Gs_i) * (a @ R)]
                R   = exp2(Gc_last) R + (b * exp2(Gc_j))^T @ c

with `D` the in-chunk segment sums and `Gs_j` the suffix sum after row j (ops/triton/decay.py:
exact next to a huge log-decay and across a reset).

(launch.py states the pass vocabulary). Per-row factors (scale, decays of the query side) are
applied after the products, in fp32; fp32 operands (the score tile, the state, decayed keys)
enter the tensor cores split in two input-dtype halves (`mma_left_fp32`, `mma_right_acc`).
Optionally it also writes `rowdot = sum(x * out, -1)` per DC tile, the per-token term of the
log-decay gradient.

GUARD (the forward pass, launch.py `guard=True`): a token whose b or c row holds a NaN or an Inf
changes no earlier output. A non-finite b or c entry makes the state that leaves its segment not
finite (NaN and Inf survive every later product, decay and sum), so the pass runs the plain loop and
a second launch reruns, with the guarded loop, only the programs of segments marked as holding such
a row (rare: non-finite input, or an overflow), overwriting their outputs. With the segment split the
scan kernel marks a segment whose local state is not finite (chunk_states.py), off this kernel;
without it each program marks whether the state leaving its segment is finite (CHECK). The guarded
loop: masked score entries are selected to 0 rather than multiplied (0 * NaN is NaN), the intra
product runs on c with the rows from the chunk's first non-finite one on zeroed, and the outputs from
that row on are NaN; the state update takes the
rows as they are, so the NaN reaches every later chunk. Outputs before the token are bit-identical
to a clean call (the zeroed terms were exact zeros before). A non-finite a row reaches only its
own output rows and needs no rerun. (On the H200 the guarded loop inside the plain launch, even never
taken, slowed the forward by 10-17%, and the CHECK flag alone by 13%: the rerun is its own launch,
and the split pass takes its flags from the scan.)
"""
import triton
import triton.language as tl

from polyattn.ops.triton.decay import chunk_decay, chunk_segsum, chunk_side_decays, select_scores
from polyattn.ops.triton.plan import chunk_tokens
from polyattn.ops.triton.precision import (
    SPLIT as SPLIT_DOT, first_nonfinite_row, mma, mma_acc, mma_left_fp32, mma_right_acc, nan_rows_from, to_output,
    zero_rows_from,
)

from .chunk_states import add_keys_times_values, flag_nonfinite, strided_state


@triton.jit
def entering_state(s_in, h0, i_s, i_n, i_h, H, DA, DC, s_h0n, s_h0h, s_h0a, s_h0c, o_r, m_r, o_c, m_c,
                   SPLIT: tl.constexpr, USE_H0: tl.constexpr, BC: tl.constexpr):
    """Rows `o_r` of the state entering the segment, fp32 `[R, BC]`: the scan's `s_in[s]` (SPLIT), the strided
    `h0[n]` or zero."""
    m_s = m_r[:, None] & m_c[None, :]
    if SPLIT:
        return tl.load(s_in + ((i_s * H + i_h) * DA + o_r[:, None]).to(tl.int64) * DC + o_c[None, :], mask=m_s, other=0.0)
    if USE_H0:
        return tl.load(strided_state(h0, i_n, i_h, s_h0n, s_h0h, s_h0a, s_h0c, o_r, o_c), mask=m_s, other=0.0).to(tl.float32)
    return tl.zeros([o_r.shape[0], BC], dtype=tl.float32)


@triton.jit
def token_rows(x, t, m_t, H, i_h, D, o_r, m_r):
    """`x[t, i_h, o_r]`, `[C, R]` (0 outside the masks)."""
    return tl.load(x + (t * H + i_h)[:, None] * D + o_r[None, :], mask=m_t[:, None] & m_r[None, :], other=0.0)


@triton.jit
def segment_outputs(
    a, b, c, g, out, s_in, h0, dot_x, rowdot, s_h0n, s_h0h, s_h0a, s_h0c,
    scale, N_tok, H, DA, DC, bos, eos, i_n, i_s, i_c, i_h,
    C: tl.constexpr, BA: tl.constexpr, R: tl.constexpr, BC: tl.constexpr,
    REVERSE: tl.constexpr, USE_G: tl.constexpr, SPLIT: tl.constexpr, USE_H0: tl.constexpr,
    ROWDOT: tl.constexpr, F32: tl.constexpr, UPDATE_DOT: tl.constexpr, GUARD: tl.constexpr,
):
    """The loop of `chunk_outputs_kernel` over one segment's chunks for one DC tile: writes the
    outputs (and rowdot) and returns the state that leaves the segment as its two tiles of R rows
    (`launch.state_rows`; the second a placeholder when R = BA), fp32 `[R, BC]` each."""
    TWO: tl.constexpr = R < BA
    o_r = tl.arange(0, R)
    o_c = i_c * BC + tl.arange(0, BC)
    m_r0, m_r1, m_c = o_r < DA, o_r + R < DA, o_c < DC
    b_s0 = entering_state(s_in, h0, i_s, i_n, i_h, H, DA, DC, s_h0n, s_h0h, s_h0a, s_h0c, o_r, m_r0, o_c, m_c, SPLIT, USE_H0, BC)
    if TWO:
        b_s1 = entering_state(s_in, h0, i_s, i_n, i_h, H, DA, DC, s_h0n, s_h0h, s_h0a, s_h0c, o_r + R, m_r1, o_c, m_c,
                              SPLIT, USE_H0, BC)
    else:
        b_s1 = tl.zeros([16, BC], dtype=tl.float32)  # unused
    n_chunks = tl.cdiv(eos - bos, C)
    for i in range(0, n_chunks):
        t, m_t = chunk_tokens(bos, eos, i, n_chunks, C, REVERSE)  # [C]
        row_c = (t * H + i_h)[:, None] * DC + o_c[None, :]  # [C, BC]
        m_tc = m_t[:, None] & m_c[None, :]
        b_a0 = token_rows(a, t, m_t, H, i_h, DA, o_r, m_r0)  # [C, R]
        b_b0 = token_rows(b, t, m_t, H, i_h, DA, o_r, m_r0)  # [C, R]
        if TWO:
            b_a1 = token_rows(a, t, m_t, H, i_h, DA, o_r + R, m_r1)  # [C, R]
            b_b1 = token_rows(b, t, m_t, H, i_h, DA, o_r + R, m_r1)  # [C, R]
        b_v = tl.load(c + row_c, mask=m_tc, other=0.0)  # [C, BC]
        if ROWDOT:  # loaded with the other operands: issued early, its latency hides behind the dots
            b_x = tl.load(dot_x + row_c, mask=m_tc, other=0.0)  # [C, BC]
        b_g, b_gc, b_last = chunk_decay(g, t, m_t, H, i_h, USE_G)  # [C], [C], scalar
        b_wq, b_wk = chunk_side_decays(b_g, b_gc, b_last, REVERSE, F32)  # [C], [C]
        b_wa = tl.exp2(b_wq) * scale  # [C]
        b_d = chunk_segsum(b_g, b_gc, b_last, REVERSE, F32)  # [C, C]
        b_att = mma(b_a0, tl.trans(b_b0), F32)  # [C, R] @ [R, C] -> [C, C]
        if TWO:
            b_att = mma_acc(b_a1, tl.trans(b_b1), b_att, F32)  # [C, C]
        if GUARD:
            first = first_nonfinite_row(b_v)  # scalar: C when every value row is finite
            b_att = select_scores(b_att, b_d, scale)  # [C, C]
            b_o = mma_left_fp32(b_att, zero_rows_from(b_v, first), F32)  # [C, C] @ [C, BC] -> [C, BC]
        else:
            b_att = b_att * (tl.exp2(b_d) * scale)  # [C, C]
            b_o = mma_left_fp32(b_att, b_v, F32)  # [C, C] @ [C, BC] -> [C, BC]
        b_in = mma_right_acc(b_a0, b_s0, tl.zeros([C, BC], dtype=tl.float32), F32, SPLIT_DOT)  # [C, R] @ [R, BC]
        if TWO:
            b_in = mma_right_acc(b_a1, b_s1, b_in, F32, SPLIT_DOT)  # [C, BC]
        b_o += b_in * b_wa[:, None]  # [C, BC]
        if GUARD:
            b_o = nan_rows_from(b_o, first)  # [C, BC]
        b_s0 = add_keys_times_values(b_s0 * tl.exp2(b_last), b_b0, b_v, b_wk, USE_G, F32, UPDATE_DOT)  # [R, BC]
        if TWO:
            b_s1 = add_keys_times_values(b_s1 * tl.exp2(b_last), b_b1, b_v, b_wk, USE_G, F32, UPDATE_DOT)  # [R, BC]
        tl.store(out + row_c, to_output(b_o, out.dtype.element_ty, F32), mask=m_tc)  # downcast: output dtype
        if ROWDOT:
            tl.store(rowdot + (i_c * N_tok + t) * H + i_h, tl.sum(b_x.to(tl.float32) * b_o, axis=1), mask=m_t)
    return b_s0, b_s1


@triton.jit(do_not_specialize=["N_tok", "s_h0n", "s_h0h", "s_h0a", "s_h0c"])
def chunk_outputs_kernel(
    a, b, c, g, out, seg, s_in, h0, ht, dot_x, rowdot, nonfinite,
    s_h0n, s_h0h, s_h0a, s_h0c,
    scale, N_tok, H, DA, DC,
    C: tl.constexpr, BA: tl.constexpr, R: tl.constexpr, BC: tl.constexpr,
    REVERSE: tl.constexpr, USE_G: tl.constexpr, SPLIT: tl.constexpr, USE_H0: tl.constexpr,
    STORE_HT: tl.constexpr, ROWDOT: tl.constexpr, F32: tl.constexpr, UPDATE_DOT: tl.constexpr,
    CHECK: tl.constexpr, RERUN: tl.constexpr,
):
    """One segment's outputs for one DC tile.

    grid: (cdiv(DC, BC), num_segments, H). Tiling: a and b rows of the full DA (padded to BA),
    c / out columns [BC]; the fp32 state [BA, BC] stays in registers for the whole segment, as two
    `[R, BC]` tiles when R = BA / 2 (from BA = 128 on, `launch.state_rows`), a and b loaded as two column halves
    to match.
    Loop (`segment_outputs`): over the segment's chunks, forward (causal) or backward (anticausal);
    per chunk the products `[C, BA] @ [BA, C]` (scores), `[C, C] @ [C, BC]` (intra),
    `[C, BA] @ [BA, BC]` (inter) and the state update `[BA, C] @ [C, BC]`, each state product one per tile. The incoming state is
    `s_in[s]` (SPLIT: written by `segment_scan_kernel`) or `h0[n]` (strided) or zero; the segment
    that ends its sequence in the pass direction stores its final state to `ht[n]` (strided like h0).
    CHECK (a pass without segment split; with it the scan kernel flags the segments): write
    `nonfinite[program]` = whether the state leaving the segment is not finite.
    RERUN: only the programs so marked run, with the guarded loop (the GUARD paragraph above).
    """
    i_c, i_s, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    program = (i_h * tl.num_programs(1) + i_s) * tl.num_programs(0) + i_c
    if RERUN:
        if tl.load(nonfinite + program) == 0:
            return
    bos = tl.load(seg + i_s * 4).to(tl.int64)
    eos = tl.load(seg + i_s * 4 + 1).to(tl.int64)
    i_n = tl.load(seg + i_s * 4 + 2).to(tl.int64)
    flags = tl.load(seg + i_s * 4 + 3)
    b_s0, b_s1 = segment_outputs(
        a, b, c, g, out, s_in, h0, dot_x, rowdot, s_h0n, s_h0h, s_h0a, s_h0c,
        scale, N_tok, H, DA, DC, bos, eos, i_n, i_s, i_c, i_h,
        C, BA, R, BC, REVERSE, USE_G, SPLIT, USE_H0, ROWDOT, F32, UPDATE_DOT, RERUN,
    )
    if CHECK:  # not finite when a key, value or log-decay of the segment (or the entering state) is not
        if R < BA:
            flag_nonfinite(nonfinite, b_s0 + b_s1, program)
        else:
            flag_nonfinite(nonfinite, b_s0, program)
    if STORE_HT:
        if REVERSE:
            terminal = (flags & 1) != 0
        else:
            terminal = (flags & 2) != 0
        if terminal:
            o_r = tl.arange(0, R)
            o_c = i_c * BC + tl.arange(0, BC)
            m_c = o_c < DC
            tl.store(strided_state(ht, i_n, i_h, s_h0n, s_h0h, s_h0a, s_h0c, o_r, o_c), b_s0, mask=(o_r < DA)[:, None] & m_c[None, :])
            if R < BA:
                tl.store(strided_state(ht, i_n, i_h, s_h0n, s_h0h, s_h0a, s_h0c, o_r + R, o_c), b_s1,
                         mask=(o_r + R < DA)[:, None] & m_c[None, :])
