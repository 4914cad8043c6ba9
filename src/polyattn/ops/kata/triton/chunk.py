"""KATA's chunked lifted-state form on the GPU (PSD maps): chunk states, their read, the quadratic kernel
inside each chunk; for the backward, the same states kernel walking the state gradient in reverse and the
lift gradient of a read (ops/kata/README.md, "Chunked backward").

Every sequence is cut into *state chunks* of CS tokens (`KernelConfig.kata_chunk_size`; the last one
shorter). With `[S | z]` the augmented state `[P, V + 1]` (ops/kata/state.py), G the inclusive cumsum of g
in the sequence and `cs` the first token of t's chunk c (ops/kata/README.md, "Chunked Triton kernel"):

    [S | z]_c = the state after token cs - 1 (the initial state for a sequence's first chunk)
    prior_t   = exp(G_t - G_{cs-1}) ψ(scale·q_t)ᵀ [S | z]_c                  the read of everything before c
    o_t       = (num_t + prior_t[:V]) / max(den_t + prior_t[V], eps)       num, den: keys of chunk c only

so the part inside the chunk is forward.py's quadratic kernel on the chunks as sequences of their own, with
the read as its prior. Two kernels compute the rest:

- `kata_states_kernel` walks a sequence in sub-tiles of BS tokens with one block of BP lifted features of
  the state on chip (`[BP, V]` fp32 and the normaliser's `[BP]`), storing the state entering every chunk:
  per sub-tile `S = exp(γ) S + Yᵀ V`, `z = exp(γ) z + Yᵀ 1` with `Y = diag(w) ψ(K)` `[BS, BP]` built in
  registers, `w_s` the decay from s to the sub-tile's end and γ the sub-tile's log-decay;
- `kata_read_kernel` forms prior for a tile of BT tokens of one chunk as the bilinear form, row block by row
  block of the state (ψ(q) is never built), then the per-row weight `scale² exp(G_t - G_{cs-1})`.

A block of lifted features is `(e, f)` for e in `[e0, e0 + BE)` and every f, in one slot (the group for
KATA-Mg; KATA-Σg has one slot that every group writes): `ψ_(e,f)(u) = u_e u_f` (Σg: `Σ_i u_ie u_if`),
state row `slot·E² + e·E + f`; E is a power of two. A product of two bf16/fp16 values is exact in fp32, so
ψ(k) is exact; the decayed `Y` and the fp32 state enter the tensor cores split in two halves (precision.py),
q and v as they are. `kata_states_ref`, `kata_read_ref`, `kata_state_grads_ref` and `kata_lift_grad_ref` are
the PyTorch twins.
"""
import torch
import triton
import triton.language as tl

from polyattn.ops.common import suffix_sum
from polyattn.ops.kata.state import with_ones
from polyattn.ops.triton.decay import chunk_decay, chunk_suffix, reset_limit_ref, reset_limited
from polyattn.ops.triton.precision import LOG2E, mma_fp32, mma_left_acc, mma_right_fp32


@triton.jit
def lifted_rows(slot, e0, E, BE: tl.constexpr, BF: tl.constexpr):
    """State rows `slot·E² + e·E + f` of the feature block `(slot, e0)`: with `BF = E` (a power of two) a
    contiguous run of `BE·E` rows from `(slot·E + e0)·E` (written as one: index arithmetic by `//` and `%`, or
    an index grid reshaped to 1D, had the H200's stores misaligned at some value widths and warp counts)."""
    return (slot * E + e0) * E + tl.arange(0, BE * BF)


@triton.jit
def group_outer(x, row, m_t, E, group, e0, BE: tl.constexpr, BF: tl.constexpr):
    """`x_e x_f` of one group for rows `row` (flat offsets of `x`'s rows), e in `[e0, e0 + BE)`: `[R, BE, BF]` fp32."""
    p_x = x + row[:, None] + group * E
    x_e = tl.load(p_x + e0 + tl.arange(0, BE)[None, :], mask=m_t[:, None], other=0.0)  # [R, BE]
    x_f = tl.load(p_x + tl.arange(0, BF)[None, :], mask=m_t[:, None], other=0.0)  # [R, BF]
    return x_e.to(tl.float32)[:, :, None] * x_f.to(tl.float32)[:, None, :]  # [R, BE, 1] * [R, 1, BF]


@triton.jit
def lifted_tile(x, t, m_t, H, i_h, K, E, slot, e0, G: tl.constexpr, SUM: tl.constexpr, BE: tl.constexpr, BF: tl.constexpr):
    """ψ of rows `t` of head `i_h` of a `[N_tok, H, K]` tensor, feature block `(slot, e0)`: `[R, BE·BF]` fp32,
    column `(e - e0)·E + f` holding `x_e x_f` (Mg: the slot's group; Σg: the sum over groups)."""
    row = (t.to(tl.int64) * H + i_h) * K  # [R]
    if SUM:
        outer = group_outer(x, row, m_t, E, 0, e0, BE, BF)
        for group in tl.static_range(1, G):
            outer += group_outer(x, row, m_t, E, group, e0, BE, BF)
    else:
        outer = group_outer(x, row, m_t, E, slot, e0, BE, BF)
    return tl.reshape(outer, (t.shape[0], BE * BF))  # [R, BE, BF] -> [R, BE·BF]


@triton.jit
def cotangent_rows(y, ya, yb, row, m_t, V, o_v, m_v, dtype: tl.constexpr):
    """The rows `[a_t y_t | b_t]` of the tokens `row = t·H + h` (masked by `m_t`) as their three factors
    `(y [R, BV], a [R], b [R])`: a, b fp32, y as stored when that is `dtype` (the other operand's, so y enters
    the tensor cores exact and a multiplies the product's rows), else in fp32."""
    b_y = tl.load(y + row[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)  # [R, BV]
    if b_y.dtype != dtype:
        b_y = b_y.to(tl.float32)
    return b_y, tl.load(ya + row, mask=m_t, other=0.0), tl.load(yb + row, mask=m_t, other=0.0)


@triton.jit
def kata_states_kernel(
    k, v, ya, yb, g, h0, z0, hs, zs, ht, zt, seqs, cu_chunks, H, K, V, E, P, NE,
    G: tl.constexpr, SUM: tl.constexpr, BE: tl.constexpr, BF: tl.constexpr, BS: tl.constexpr, BV: tl.constexpr,
    SUB: tl.constexpr, USE_G: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr, F32: tl.constexpr,
    REVERSE: tl.constexpr,
):
    """grid: (slots·NE, N, H), NE = E / BE. One feature block `(slot, e0)` of one sequence and head:
    the fp32 tiles `[BE·BF, BV]` (S) and `[BE·BF]` (z) stay in registers while the program walks the
    sequence in sub-tiles of BS tokens, SUB sub-tiles a chunk, storing the state entering every chunk
    (`hs [NC, H, P, V]`, `zs [NC, H, P]`) and, with STORE_HT, the final one (`ht`, `zt`, per sequence).
    `seqs` rows: `(bos, eos, ., .)` per sequence; `cu_chunks [N + 1]`: each sequence's first chunk. A
    non-finite key, value or log-decay makes the state non-finite from its sub-tile on: the states
    entering earlier chunks, stored before, are untouched.

    REVERSE: the backward's walk of the state gradient D (ops/kata/README.md, "Chunked backward"), chunks
    and sub-tiles last to first, `k` holding q and the reads' cotangents given as rows `y_t = [a_t v_t | b_t]`
    (`v [N_tok, H, V]` in any dtype, `ya`, `yb [N_tok, H]` fp32 the a and b): per sub-tile
    `D = exp(γ) D + Yᵀ y[:, :V]`, `Dz = exp(γ) Dz + Yᵀ y[:, V]` with
    `Y = diag(exp(gc)) ψ(Q)` (gc: the inclusive log-decay from the sub-tile's start), so that a chunk leaves
    `exp(γ_c) D_(c+1) + Σ_t exp(G_t - G_(cs-1)) ψ(q_t) y_tᵀ`; `hs`, `zs` get D_(c+1) (the gradient of the
    state leaving chunk c) before the chunk, `h0`, `z0` the gradient of the final state, `ht`, `zt` that
    of the initial one. The row weights a_t join Y (`diag(exp(gc) a) ψ(Q)`, fp32, split in halves) and v
    enters exact: two products, as the forward's."""
    i_p, i_n, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = i_p // NE
    e0 = (i_p % NE) * BE
    bos = tl.load(seqs + i_n * 4).to(tl.int64)
    eos = tl.load(seqs + i_n * 4 + 1).to(tl.int64)
    c0 = tl.load(cu_chunks + i_n).to(tl.int64)
    rows = lifted_rows(slot, e0, E, BE, BF)  # [BE·BF]
    o_v = tl.arange(0, BV)
    m_v = o_v < V
    m_s = (rows >= 0)[:, None] & m_v[None, :]  # [BE·BF, BV]: every row of the block is a state row
    state = rows[:, None] * V + o_v[None, :]  # [BE·BF, BV] offsets inside one [P, V] state
    if USE_H0:
        b_h = tl.load(h0 + (i_n * H + i_h).to(tl.int64) * P * V + state, mask=m_s, other=0.0)  # [BE·BF, BV]
        b_z = tl.load(z0 + (i_n * H + i_h).to(tl.int64) * P + rows)  # [BE·BF]
    else:
        b_h = tl.zeros([BE * BF, BV], dtype=tl.float32)
        b_z = tl.zeros([BE * BF], dtype=tl.float32)
    o_t = tl.arange(0, BS)
    n_chunks = tl.cdiv(eos - bos, SUB * BS)
    for cc in range(0, n_chunks):
        c = n_chunks - 1 - cc if REVERSE else cc
        i_c = (c0 + c) * H + i_h
        tl.store(hs + i_c * P * V + state, b_h, mask=m_s)
        tl.store(zs + i_c * P + rows, b_z)
        for jj in range(0, SUB):
            j = SUB - 1 - jj if REVERSE else jj
            t = bos + (c * SUB + j) * BS + o_t
            m_t = t < eos
            b_y = lifted_tile(k, t, m_t, H, i_h, K, E, slot, e0, G, SUM, BE, BF)  # [BS, BE·BF]
            if REVERSE:  # [BS, BV] (k's dtype or fp32), [BS], [BS] fp32
                b_v, b_a, b_b = cotangent_rows(v, ya, yb, t.to(tl.int64) * H + i_h, m_t, V, o_v, m_v, k.dtype.element_ty)
            else:
                b_v = tl.load(v + (t.to(tl.int64) * H + i_h)[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)  # [BS, BV]
            if USE_G:
                b_g, b_gc, b_last = chunk_decay(g, t, m_t, H, i_h, True)  # [BS], [BS], scalar
                b_h = b_h * tl.exp2(b_last)
                b_z = b_z * tl.exp2(b_last)
                if REVERSE:  # decayed from the sub-tile's start
                    b_w = tl.exp2(b_gc)  # [BS]
                    b_a = b_a * b_w
                    b_b = b_b * b_w
                else:  # decayed to the sub-tile's end
                    b_y = b_y * tl.exp2(chunk_suffix(b_g, b_gc, b_last, F32))[:, None]  # [BS, BE·BF]
            if REVERSE:
                b_z += tl.sum(b_y * b_b[:, None], axis=0)  # [BE·BF]
                b_y = b_y * b_a[:, None]  # [BS, BE·BF]
            else:
                b_z += tl.sum(b_y, axis=0)  # [BE·BF]: the ones column (rows past the end are zero)
            b_h = mma_left_acc(tl.trans(b_y), b_v, b_h, F32)  # [BE·BF, BS] @ [BS, BV] -> [BE·BF, BV]
    if STORE_HT:
        tl.store(ht + (i_n * H + i_h).to(tl.int64) * P * V + state, b_h, mask=m_s)
        tl.store(zt + (i_n * H + i_h).to(tl.int64) * P + rows, b_z)


@triton.jit
def read_tile(tiles, V, BF: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr):
    """This program's tile in a (tiles, H) grid over the state chunks: `(i_h, t0, i_c, t, m_t, o_f, o_v, m_v)`,
    the tile's tokens `t = t0 + arange(BT)` masked by `m_t`, `i_c` its chunk, the feature and value offsets."""
    i_m, i_h = tl.program_id(0), tl.program_id(1)
    t0 = tl.load(tiles + i_m * 4).to(tl.int64)
    t1 = tl.load(tiles + i_m * 4 + 1).to(tl.int64)
    t = t0 + tl.arange(0, BT)
    o_v = tl.arange(0, BV)
    return i_h, t0, tl.load(tiles + i_m * 4 + 2).to(tl.int64), t, t < t1, tl.arange(0, BF), o_v, o_v < V


@triton.jit
def kata_read_kernel(
    q, g, hs, zs, prior, tiles, starts, scale2, H, K, V, E, P,
    G: tl.constexpr, SUM: tl.constexpr, BF: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, F32: tl.constexpr,
):
    """grid: (tiles, H). `prior [N_tok, H, V + 1]` fp32 for one tile of BT tokens of one chunk and head,
    the bilinear form read row block by row block of the state: for every group i reading a slot and every
    e < E, `Σ_f q_if S_(e,f) = Q_i [S | z]_e` (`[BT, BF] @ [BF, V]`, BF = E padded to at least 16 for the
    tensor cores, the fp32 rows split in two halves, q exact), weighted by the column `q_ie`, then the rows
    by `scale² exp(G_t - G_{cs-1})`; ψ is never built.
    `tiles` rows: `(t0, t1, chunk, .)`, the chunk indexing `hs`, `zs` and `starts` (its first token)."""
    i_h, t0, i_c, t, m_t, o_f, o_v, m_v = read_tile(tiles, V, BF, BT, BV)
    b_w = tl.full([BT], scale2, dtype=tl.float32)
    if USE_G:  # log-decay from the chunk's start: direct sums of the chunk's earlier tiles, then the tile's cumsum
        b_prev = tl.sum(tl.zeros([BT], dtype=tl.float32), axis=0)
        for u0 in range(tl.load(starts + i_c).to(tl.int64), t0, BT):
            u = u0 + tl.arange(0, BT)
            b_prev += tl.sum(reset_limited(tl.load(g + u * H + i_h, mask=u < t0, other=0.0).to(tl.float32)), axis=0)
        _, b_gc, _ = chunk_decay(g, t, m_t, H, i_h, True)  # [BT]
        b_w = b_w * tl.exp2(b_prev * LOG2E + b_gc)
    p_h = hs + (i_c * H + i_h) * P * V
    p_z = zs + (i_c * H + i_h) * P
    row = (t * H + i_h) * K  # [BT]
    b_num = tl.zeros([BT, BV], dtype=tl.float32)
    b_den = tl.zeros([BT], dtype=tl.float32)
    m_f = o_f < E
    for i in range(0, G):  # group i reads slot 0 (Σg) or its own (Mg)
        slot = 0 if SUM else i
        b_q = tl.load(q + row[:, None] + i * E + o_f[None, :], mask=m_t[:, None] & m_f[None, :], other=0.0)  # [BT, BF]
        for e in range(0, E):
            rows = (slot * E + e) * E + o_f  # [BF]
            b_s = tl.load(p_h + rows[:, None] * V + o_v[None, :], mask=m_f[:, None] & m_v[None, :], other=0.0)  # [BF, BV]
            b_qe = tl.load(q + row + i * E + e, mask=m_t, other=0.0).to(tl.float32)  # [BT]: the column q_ie
            b_num += mma_right_fp32(b_q, b_s, F32) * b_qe[:, None]  # [BT, BF] @ [BF, BV] -> [BT, BV]
            b_den += tl.sum(b_q.to(tl.float32) * tl.load(p_z + rows, mask=m_f, other=0.0)[None, :], axis=1) * b_qe  # [BT]
    out = (t * H + i_h) * (V + 1)  # [BT]
    tl.store(prior + out[:, None] + o_v[None, :], b_num * b_w[:, None], mask=m_t[:, None] & m_v[None, :])
    tl.store(prior + out + V, b_den * b_w, mask=m_t)


@triton.jit
def kata_lift_grad_kernel(
    x, y, ya, yb, hs, zs, dx, dr, tiles, H, K, V, E, P,
    G: tl.constexpr, SUM: tl.constexpr, BF: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, F32: tl.constexpr,
    ACCUMULATE: tl.constexpr, READ: tl.constexpr,
):
    """grid: (tiles, H). The gradient of `ψ(x_t)ᵀ [S | z]_c y_t` with respect to x_t, for one tile of BT
    tokens of chunk c and head: with `U_t = [S | z]_c y_t` read as one E×E matrix per slot,
    `dx_i = (U + Uᵀ) x_i` for every group i reading the slot (ψ_(e,f)(x) = x_e x_f). Row block e of the
    slot gives row e of U for every token, `U_e = diag(a) v S_eᵀ + b z_eᵀ` (`[BT, V] @ [V, E]`, v exact, the
    fp32 state split in halves, then the rows weighted), which adds `Σ_f U_e[t, f] x_if` to column e and
    `U_e[t, f] x_ie` to column f of each group. The groups of a slot are one `[BT, GS, E]` tile (Σg: all G
    share slot 0, so U_e is formed once for them; Mg: one group a slot). `dx [N_tok, H, K]` fp32 is written,
    or with ACCUMULATE added to (every token belongs to one tile); the rows `y_t = [a_t v_t | b_t]` as
    `kata_states_kernel`'s reverse walk takes them (`y [N_tok, H, V]` in x's dtype, entering exact, or fp32, split
    in halves like the state; `ya`, `yb [N_tok, H]` fp32);
    `tiles` and BF as `kata_read_kernel`'s. READ: the same pass also adds the read `a_t (ψ(x_t)ᵀ S_c)` into
    `dr [N_tok, H, V]` fp32 (the backward's dv: x = k, the rows' a its weight), its products
    `X_i S_e` (`[BT·GS, E] @ [E, V]`) on the state rows just loaded, weighted by `x_ie` and summed over i."""
    GS: tl.constexpr = G if SUM else 1  # groups reading one slot
    i_h, t0, i_c, t, m_t, o_f, o_v, m_v = read_tile(tiles, V, BF, BT, BV)
    b_y, b_ya, b_yz = cotangent_rows(y, ya, yb, t * H + i_h, m_t, V, o_v, m_v, x.dtype.element_ty)  # [BT, BV], [BT], [BT]
    p_h = hs + (i_c * H + i_h) * P * V
    p_z = zs + (i_c * H + i_h) * P
    row = (t * H + i_h) * K  # [BT]
    o_g = tl.arange(0, GS)
    m_f = o_f < E
    b_read = tl.zeros([BT, BV], dtype=tl.float32)
    for slot in range(0, G // GS):
        groups = (slot * GS + o_g) * E  # [GS]: the first column of each group reading the slot
        cols = row[:, None, None] + groups[None, :, None] + o_f[None, None, :]  # [BT, GS, BF]
        m_x = m_t[:, None, None] & m_f[None, None, :]
        b_xr = tl.load(x + cols, mask=m_x, other=0.0)  # [BT, GS, BF]
        b_x = b_xr.to(tl.float32)
        b_dx = tl.zeros([BT, GS, BF], dtype=tl.float32)
        for e in range(0, E):
            rows = (slot * E + e) * E + o_f  # [BF]
            b_s = tl.load(p_h + rows[:, None] * V + o_v[None, :], mask=m_f[:, None] & m_v[None, :], other=0.0)  # [BF, BV]
            if b_y.dtype == x.dtype.element_ty:  # [BT, BV] @ [BV, E]: y exact, the state split
                b_u = mma_right_fp32(b_y, tl.trans(b_s), F32)
            else:  # fp32 rows with low-precision x: both split, three products
                b_u = mma_fp32(b_y, tl.trans(b_s), x.dtype.element_ty, F32, 0)
            b_u = b_u * b_ya[:, None] + b_yz[:, None] * tl.load(p_z + rows, mask=m_f, other=0.0)[None, :]
            b_xe = tl.load(x + row[:, None] + groups[None, :] + e, mask=m_t[:, None], other=0.0).to(tl.float32)  # [BT, GS]: columns x_ie
            b_row = tl.sum(b_u[:, None, :] * b_x, axis=2)  # [BT, GS]: Σ_f U_e[t, f] x_if
            b_dx += b_u[:, None, :] * b_xe[:, :, None] + tl.where(o_f[None, None, :] == e, b_row[:, :, None], 0.0)
            if READ:
                b_r = mma_right_fp32(tl.reshape(b_xr, (BT * GS, BF)), b_s, F32)  # [BT·GS, E] @ [E, BV]
                b_read += tl.sum(tl.reshape(b_r, (BT, GS, BV)) * b_xe[:, :, None], axis=1)  # [BT, BV]
        if ACCUMULATE:
            b_dx += tl.load(dx + cols, mask=m_x, other=0.0)
        tl.store(dx + cols, b_dx, mask=m_x)
    if READ:
        m_tv = m_t[:, None] & m_v[None, :]
        p_r = dr + ((t * H + i_h) * V)[:, None] + o_v[None, :]  # [BT, BV]
        tl.store(p_r, tl.load(p_r, mask=m_tv, other=0.0) + b_read * b_ya[:, None], mask=m_tv)


def chunk_lengths(seq_lens: tuple, chunk_size: int) -> tuple:
    """Lengths of the state chunks, sequence after sequence: every sequence is cut into pieces of
    `chunk_size` tokens (the last shorter), an empty one into one empty piece, as `plan.chunk_table`."""
    out = []
    for n in seq_lens:
        out += [min(chunk_size, n - s) for s in range(0, n, chunk_size)] or [0]
    return tuple(out)


def kata_states_ref(k, v, g, initial_state, seq_lens: tuple, chunk_size: int, fmap):
    """Twin of `kata_states_kernel` in float64 on flattened tokens (`k [N_tok, H, K]`, `v [N_tok, H, V]`,
    `g [N_tok, H]` or None, `initial_state [N, H, P, V + 1]` augmented or None): `(states [NC, H, P, V + 1]
    entering every chunk, finals [N, H, P, V + 1])`, each chunk's write a direct sum of decayed keys."""
    N_tok, H, _ = k.shape
    values = with_ones(v.double())  # [N_tok, H, V + 1]
    g = torch.zeros(N_tok, H, dtype=torch.float64, device=k.device) if g is None else reset_limit_ref(g.double())
    states, finals, bos = [], [], 0
    for n, length in enumerate(seq_lens):
        S = (torch.zeros(H, fmap.dim(), values.shape[-1], dtype=torch.float64, device=k.device)
             if initial_state is None else initial_state[n].double())
        for size in chunk_lengths((length,), chunk_size):
            states.append(S)
            gc = g[bos:bos + size].t()  # [H, n]
            w = torch.exp(suffix_sum(gc))  # [H, n]: exp(Σ_{u > s} g_u), direct sums
            S = torch.exp(gc.sum(-1))[:, None, None] * S + fmap.write(
                k[bos:bos + size].double().transpose(0, 1), w[..., None] * values[bos:bos + size].transpose(0, 1))
            bos += size
        finals.append(S)
    return torch.stack(states), torch.stack(finals)


def kata_read_ref(q, g, states, seq_lens: tuple, chunk_size: int, fmap, scale: float):
    """Twin of `kata_read_kernel` in float64: `prior [N_tok, H, V + 1] = exp(G_t - G_{cs-1}) ψ(scale·q_t)ᵀ
    states[c]` for every token t of chunk c (`states` as `kata_states_ref` returns them)."""
    N_tok, H, _ = q.shape
    g = torch.zeros(N_tok, H, dtype=torch.float64, device=q.device) if g is None else reset_limit_ref(g.double())
    prior = torch.zeros(N_tok, H, states.shape[-1], dtype=torch.float64, device=q.device)
    bos = 0
    for c, size in enumerate(chunk_lengths(seq_lens, chunk_size)):
        w = torch.exp(torch.cumsum(g[bos:bos + size].t(), -1))  # [H, n]
        read = fmap.read(scale * q[bos:bos + size].double().transpose(0, 1), states[c])  # [H, n, K], [H, P, W] -> [H, n, W]
        prior[bos:bos + size] = (w[..., None] * read).transpose(0, 1)
        bos += size
    return prior


def kata_state_grads_ref(q, y, g, final_grad, seq_lens: tuple, chunk_size: int, fmap):
    """Twin of `kata_states_kernel` with REVERSE in float64: `(grads [NC, H, P, V + 1], initial [N, H, P, V + 1])`,
    the gradient of the state leaving every chunk and of the initial state, from the reads' cotangents
    `y [N_tok, H, V + 1]` (their weights from the chunk's start applied here) and `final_grad [N, H, P, V + 1]` or None."""
    N_tok, H, _ = q.shape
    g = torch.zeros(N_tok, H, dtype=torch.float64, device=q.device) if g is None else reset_limit_ref(g.double())
    grads, initial, bos = [], [], sum(seq_lens)
    for n in reversed(range(len(seq_lens))):
        length = seq_lens[n]
        bos -= length
        D = (torch.zeros(H, fmap.dim(), y.shape[-1], dtype=torch.float64, device=q.device)
             if final_grad is None else final_grad[n].double())
        sizes = chunk_lengths((length,), chunk_size)
        ends = [bos + sum(sizes[:i + 1]) for i in range(len(sizes))]
        for size, end in zip(reversed(sizes), reversed(ends)):
            grads.append(D)
            gc = g[end - size:end].t()  # [H, n]
            w = torch.exp(torch.cumsum(gc, -1))  # [H, n]: exp(G_t - G_(cs-1))
            D = torch.exp(gc.sum(-1))[:, None, None] * D + fmap.write(
                q[end - size:end].double().transpose(0, 1), w[..., None] * y[end - size:end].double().transpose(0, 1))
        initial.append(D)
    return torch.stack(grads[::-1]), torch.stack(initial[::-1])


def kata_lift_grad_ref(x, y, states, seq_lens: tuple, chunk_size: int, fmap):
    """Twin of `kata_lift_grad_kernel` in float64: `∇_x Σ_t ψ(x_t)ᵀ states[c(t)] y_t`, `[N_tok, H, K]`."""
    x = x.double().detach().requires_grad_()
    total, bos = 0.0, 0
    for c, size in enumerate(chunk_lengths(seq_lens, chunk_size)):
        read = fmap.read(x[bos:bos + size].transpose(0, 1), states[c].double())  # [H, n, V + 1]
        total = total + (read * y[bos:bos + size].double().transpose(0, 1)).sum()
        bos += size
    return torch.autograd.grad(total, x)[0]


__all__ = [
    "chunk_lengths", "kata_lift_grad_kernel", "kata_lift_grad_ref", "kata_read_kernel", "kata_read_ref", "kata_state_grads_ref",
    "kata_states_kernel", "kata_states_ref",
]
