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
enter the tensor cores split in two input-dtype halves (`mma_left_fp32`, `mma_right_fp32`).
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
from polyattn.ops.triton.plan import chunk_tokens, state_tile
from polyattn.ops.triton.precision import (
    first_nonfinite_row, mma, mma_left_fp32, mma_right_fp32, nan_rows_from, to_output, zero_rows_from,
)

from .chunk_states import add_keys_times_values, flag_nonfinite


@triton.jit
def segment_outputs(
    a, b, c, g, out, s_in, h0, dot_x, rowdot, s_h0n, s_h0h, s_h0a, s_h0c,
    scale, N_tok, H, DA, DC, bos, eos, i_n, i_s, i_c, i_h,
    C: tl.constexpr, BA: tl.constexpr, BC: tl.constexpr,
    REVERSE: tl.constexpr, USE_G: tl.constexpr, SPLIT: tl.constexpr, USE_H0: tl.constexpr,
    ROWDOT: tl.constexpr, F32: tl.constexpr, UPDATE_DOT: tl.constexpr, GUARD: tl.constexpr,
):
    """The loop of `chunk_outputs_kernel` over one segment's chunks for one DC tile: writes the
    outputs (and rowdot) and returns the state that leaves the segment ([BA, BC] fp32)."""
    o_a, o_c, m_a, m_c, m_s = state_tile(i_c, DA, DC, BA, BC)
    if SPLIT:
        p_s = s_in + ((i_s * H + i_h) * DA + o_a[:, None]).to(tl.int64) * DC + o_c[None, :]
        b_s = tl.load(p_s, mask=m_s, other=0.0)
    elif USE_H0:
        p_h0 = h0 + i_n * s_h0n + i_h * s_h0h + o_a[:, None] * s_h0a + o_c[None, :] * s_h0c
        b_s = tl.load(p_h0, mask=m_s, other=0.0).to(tl.float32)
    else:
        b_s = tl.zeros([BA, BC], dtype=tl.float32)
    n_chunks = tl.cdiv(eos - bos, C)
    for i in range(0, n_chunks):
        t, m_t = chunk_tokens(bos, eos, i, n_chunks, C, REVERSE)  # [C]
        row_a = (t * H + i_h)[:, None] * DA + o_a[None, :]  # [C, BA]
        row_c = (t * H + i_h)[:, None] * DC + o_c[None, :]  # [C, BC]
        m_ta = m_t[:, None] & m_a[None, :]
        m_tc = m_t[:, None] & m_c[None, :]
        b_a = tl.load(a + row_a, mask=m_ta, other=0.0)  # [C, BA]
        b_b = tl.load(b + row_a, mask=m_ta, other=0.0)  # [C, BA]
        b_v = tl.load(c + row_c, mask=m_tc, other=0.0)  # [C, BC]
        if ROWDOT:  # loaded with the other operands: issued early, its latency hides behind the dots
            b_x = tl.load(dot_x + row_c, mask=m_tc, other=0.0)  # [C, BC]
        b_g, b_gc, b_last = chunk_decay(g, t, m_t, H, i_h, USE_G)  # [C], [C], scalar
        b_wq, b_wk = chunk_side_decays(b_g, b_gc, b_last, REVERSE, F32)  # [C], [C]
        b_wa = tl.exp2(b_wq) * scale  # [C]
        b_d = chunk_segsum(b_g, b_gc, b_last, REVERSE, F32)  # [C, C]
        b_att = mma(b_a, tl.trans(b_b), F32)  # [C, BA] @ [BA, C] -> [C, C]
        if GUARD:
            first = first_nonfinite_row(b_v)  # scalar: C when every value row is finite
            b_att = select_scores(b_att, b_d, scale)  # [C, C]
            b_o = mma_left_fp32(b_att, zero_rows_from(b_v, first), F32)  # [C, C] @ [C, BC] -> [C, BC]
        else:
            b_att = b_att * (tl.exp2(b_d) * scale)  # [C, C]
            b_o = mma_left_fp32(b_att, b_v, F32)  # [C, C] @ [C, BC] -> [C, BC]
        b_o += mma_right_fp32(b_a, b_s, F32) * b_wa[:, None]  # [C, BA] @ [BA, BC] -> [C, BC]
        if GUARD:
            b_o = nan_rows_from(b_o, first)  # [C, BC]
        b_s = add_keys_times_values(b_s * tl.exp2(b_last), b_b, b_v, b_wk, USE_G, F32, UPDATE_DOT)
        tl.store(out + row_c, to_output(b_o, out.dtype.element_ty, F32), mask=m_tc)  # downcast: output dtype
        if ROWDOT:
            tl.store(rowdot + (i_c * N_tok + t) * H + i_h, tl.sum(b_x.to(tl.float32) * b_o, axis=1), mask=m_t)
    return b_s


@triton.jit(do_not_specialize=["N_tok", "s_h0n", "s_h0h", "s_h0a", "s_h0c"])
def chunk_outputs_kernel(
    a, b, c, g, out, seg, s_in, h0, ht, dot_x, rowdot, nonfinite,
    s_h0n, s_h0h, s_h0a, s_h0c,
    scale, N_tok, H, DA, DC,
    C: tl.constexpr, BA: tl.constexpr, BC: tl.constexpr,
    REVERSE: tl.constexpr, USE_G: tl.constexpr, SPLIT: tl.constexpr, USE_H0: tl.constexpr,
    STORE_HT: tl.constexpr, ROWDOT: tl.constexpr, F32: tl.constexpr, UPDATE_DOT: tl.constexpr,
    CHECK: tl.constexpr, RERUN: tl.constexpr,
):
    """One segment's outputs for one DC tile.

    grid: (cdiv(DC, BC), num_segments, H). Tiling: a and b rows of the full DA (padded to BA),
    c / out columns [BC]; the fp32 state [BA, BC] stays in registers for the whole segment.
    Loop (`segment_outputs`): over the segment's chunks, forward (causal) or backward (anticausal);
    per chunk the products `[C, BA] @ [BA, C]` (scores), `[C, C] @ [C, BC]` (intra),
    `[C, BA] @ [BA, BC]` (inter) and the state update `[BA, C] @ [C, BC]`. The incoming state is
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
    b_s = segment_outputs(
        a, b, c, g, out, s_in, h0, dot_x, rowdot, s_h0n, s_h0h, s_h0a, s_h0c,
        scale, N_tok, H, DA, DC, bos, eos, i_n, i_s, i_c, i_h,
        C, BA, BC, REVERSE, USE_G, SPLIT, USE_H0, ROWDOT, F32, UPDATE_DOT, RERUN,
    )
    if CHECK:  # not finite when a key, value or log-decay of the segment (or the entering state) is not
        flag_nonfinite(nonfinite, b_s, program)
    if STORE_HT:
        o_a, o_c, m_a, m_c, m_s = state_tile(i_c, DA, DC, BA, BC)
        if REVERSE:
            terminal = (flags & 1) != 0
        else:
            terminal = (flags & 2) != 0
        if terminal:
            p_ht = ht + i_n * s_h0n + i_h * s_h0h + o_a[:, None] * s_h0a + o_c[None, :] * s_h0c
            tl.store(p_ht, b_s, mask=m_s)
