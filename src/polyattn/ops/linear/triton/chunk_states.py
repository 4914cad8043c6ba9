"""Stage 1 of a pass: each segment's local end state, then the per-sequence combine.

`segment_states_kernel` implements, for one segment of one sequence, the end state that
`linear_attn_chunk` (ops/linear/chunk.py) carries from chunk to chunk, started from zero:

    causal      S = sum_j exp(g_{j+1} + ... + g_last) b_j c_j^T         [DA, DC]
    anticausal  R = sum_j exp(g_first + ... + g_j) b_j c_j^T

and the segment's total log2-decay. `segment_scan_kernel` turns local states into each
segment's incoming state by the sequential form of `ops.common.scan.combine_decayed`.
"""
import triton
import triton.language as tl

from polyattn.ops.triton.decay import chunk_decay, chunk_side_decays
from polyattn.ops.triton.plan import chunk_tokens
from polyattn.ops.triton.precision import UPDATE_DOTS, fp32_dot_mode, mma_acc, mma_right_acc


@triton.jit
def add_keys_times_values(b_s, b_b, b_v, b_wk, USE_G: tl.constexpr, F32: tl.constexpr, UPDATE_DOT: tl.constexpr):
    """The state `b_s` plus the chunk's contribution `b^T @ (c * exp2(wk))`, with `wk` the key-side
    log2-decay of the pass (`chunk_side_decays`): [BA, BC] + [BA, C] @ [C, BC], fp32, the products
    accumulated into the state. Without decay b and c enter the tensor cores as they are; the
    decayed values are fp32 ([C, BC], the smaller operand) and enter as UPDATE_DOT says
    (`update_dot`)."""
    if USE_G:
        return mma_right_acc(tl.trans(b_b), b_v.to(tl.float32) * tl.exp2(b_wk)[:, None], b_s, F32, UPDATE_DOT)
    return mma_acc(tl.trans(b_b), b_v, b_s, F32)


def update_dot(config, rounded: bool) -> int:
    """The UPDATE_DOT of a pass (`precision.UPDATE_DOTS`): `config.decay_update_dot` where the caller allows
    `rounded` updates, else split. Only a forward whose final state nobody reads allows them: its outputs take
    each update through one more product and one rounding. Where an fp32 result keeps every update's rounding
    the split stays: on the H200 at 4K tokens in bf16, rounded values took the final state's error from 4e-6
    to 2.5e-3 and dg's to 3.3x the split's, and in the tests dv's past its bound (ops/linear/README.md,
    "Triton kernels")."""
    return fp32_dot_mode(config, "decay_update_dot", UPDATE_DOTS) if rounded else UPDATE_DOTS["split"]


@triton.jit
def flag_nonfinite(nonfinite, b_s, index):
    """`nonfinite[index]` = 1 where the fp32 tile `b_s` holds a NaN or an Inf (its sum is then not
    finite: `x - x` is 0 exactly for finite x), else 0."""
    total = tl.sum(tl.sum(b_s, axis=1), axis=0)
    tl.store(nonfinite + index, (total - total != 0).to(tl.int32))


@triton.jit
def segment_states_kernel(
    b, c, g, seg, states, seg_decay,
    H, DA, DC,
    C: tl.constexpr, BA: tl.constexpr, BC: tl.constexpr,
    REVERSE: tl.constexpr, USE_G: tl.constexpr, F32: tl.constexpr, UPDATE_DOT: tl.constexpr, TERMINAL: tl.constexpr,
):
    """Local end state of one segment (no incoming state).

    grid: (cdiv(DC, BC), num_segments, H). Each program owns a [BA, BC] fp32 state tile in
    registers and walks the segment's chunks of C tokens (forward for causal, backward for
    anticausal), one `[BA, C] @ [C, BC]` product per chunk. No later segment reads the state of
    the segment that ends its sequence in the pass direction (last when causal, first when
    anticausal): it is skipped unless TERMINAL, where the scan's non-finite flags need it (a guarded
    pass). Writes `states[s, h]` ([DA, DC] fp32) and `seg_decay[s, h]` (total log2-decay of the segment).
    """
    i_c, i_s, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(seg + i_s * 4).to(tl.int64)
    eos = tl.load(seg + i_s * 4 + 1).to(tl.int64)
    flags = tl.load(seg + i_s * 4 + 3)
    if REVERSE:
        terminal = (flags & 1) != 0
    else:
        terminal = (flags & 2) != 0
    if terminal and not TERMINAL:
        return
    o_a = tl.arange(0, BA)
    o_c = i_c * BC + tl.arange(0, BC)
    m_a = o_a < DA
    m_c = o_c < DC
    b_s = tl.zeros([BA, BC], dtype=tl.float32)
    b_total = tl.sum(tl.zeros([C], dtype=tl.float32), axis=0)
    n_chunks = tl.cdiv(eos - bos, C)
    for i in range(0, n_chunks):
        t, m_t = chunk_tokens(bos, eos, i, n_chunks, C, REVERSE)  # [C]
        b_b = tl.load(b + (t * H + i_h)[:, None] * DA + o_a[None, :], mask=m_t[:, None] & m_a[None, :], other=0.0)  # [C, BA]
        b_v = tl.load(c + (t * H + i_h)[:, None] * DC + o_c[None, :], mask=m_t[:, None] & m_c[None, :], other=0.0)  # [C, BC]
        b_g, b_gc, b_last = chunk_decay(g, t, m_t, H, i_h, USE_G)  # [C], [C], scalar
        _, b_wk = chunk_side_decays(b_g, b_gc, b_last, REVERSE, F32)  # [C]
        b_s = add_keys_times_values(b_s * tl.exp2(b_last), b_b, b_v, b_wk, USE_G, F32, UPDATE_DOT)
        b_total += b_last
    p_s = states + ((i_s * H + i_h) * DA + o_a[:, None]).to(tl.int64) * DC + o_c[None, :]
    tl.store(p_s, b_s, mask=m_a[:, None] & m_c[None, :])
    if i_c == 0:
        tl.store(seg_decay + i_s * H + i_h, b_total)


@triton.jit
def strided_state(p, i_n, i_h, s_h0n, s_h0h, s_h0a, s_h0c, o_r, o_c):
    """Pointers to rows `o_r`, columns `o_c` of `p[n, h]`, a `[N, H, DA, DC]` state with the strides of h0 (h0 and
    ht share them)."""
    return p + i_n.to(tl.int64) * s_h0n + i_h * s_h0h + o_r[:, None] * s_h0a + o_c[None, :] * s_h0c


@triton.jit(do_not_specialize=["s_h0n", "s_h0h", "s_h0a", "s_h0c"])
def segment_scan_kernel(
    states, seg_decay, cu_seg, h0, nonfinite,
    s_h0n, s_h0h, s_h0a, s_h0c,
    S, H, DA, DC,
    BA: tl.constexpr, BC: tl.constexpr,
    REVERSE: tl.constexpr, USE_H0: tl.constexpr, CHECK: tl.constexpr,
):
    """Incoming state of every segment, in place over the local states.

    grid: (cdiv(DC, BC), N, H). One program per (state tile, sequence, head) walks the
    sequence's segments in pass order with an fp32 [BA, BC] carry starting from `h0[n]`
    (strided, so a transposed view works) or zero: it reads the segment's local state, writes
    the carry in its place, then `carry = exp2(decay) * carry + local`. The terminal segment's
    local state enters no carry; the outputs kernel, which ends on the true final state,
    stores `ht`. CHECK: write `nonfinite[(h * S + s) * n_c + c]` = whether segment s's local
    state is not finite (a non-finite b or c row, or log-decay, inside it), for every segment,
    the terminal one included (its local state computed: `segment_states_kernel` with TERMINAL):
    the flags of chunk_outputs.py's rerun, off its main kernel.
    """
    i_c, i_n, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    lo = tl.load(cu_seg + i_n)
    hi = tl.load(cu_seg + i_n + 1)
    o_a = tl.arange(0, BA)
    o_c = i_c * BC + tl.arange(0, BC)
    m_s = (o_a < DA)[:, None] & (o_c < DC)[None, :]
    if USE_H0:
        b_carry = tl.load(strided_state(h0, i_n, i_h, s_h0n, s_h0h, s_h0a, s_h0c, o_a, o_c), mask=m_s, other=0.0).to(tl.float32)
    else:
        b_carry = tl.zeros([BA, BC], dtype=tl.float32)
    for i in range(0, hi - lo - 1):
        if REVERSE:
            i_s = hi - 1 - i
        else:
            i_s = lo + i
        p_s = states + ((i_s * H + i_h) * DA + o_a[:, None]).to(tl.int64) * DC + o_c[None, :]
        b_local = tl.load(p_s, mask=m_s, other=0.0)
        if CHECK:
            flag_nonfinite(nonfinite, b_local, (i_h * S + i_s) * tl.num_programs(0) + i_c)
        b_decay = tl.load(seg_decay + i_s * H + i_h)
        tl.store(p_s, b_carry, mask=m_s)
        b_carry = b_carry * tl.exp2(b_decay) + b_local
    if REVERSE:
        i_s = lo
    else:
        i_s = hi - 1
    p_s = states + ((i_s * H + i_h) * DA + o_a[:, None]).to(tl.int64) * DC + o_c[None, :]
    if CHECK:
        flag_nonfinite(nonfinite, tl.load(p_s, mask=m_s, other=0.0), (i_h * S + i_s) * tl.num_programs(0) + i_c)
    tl.store(p_s, b_carry, mask=m_s)
