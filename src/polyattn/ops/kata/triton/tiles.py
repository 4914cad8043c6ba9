"""Tile stages shared by KATA's quadratic kernels: grouped loads, squared group scores, their gradient, decay tiles.

A program owns a *row tile* of R rows (queries in the forward and dq kernels, keys in the dk/dv
kernel) and loops over *column tiles* of the other side. Heads are split into G groups of width E
(K = G·E); a group-major row tile `[G·R, BE]` holds row `t` of group `i` at `i·R + t`, so one
`[G·R, BE] @ [BE, G·C]` product gives every group pair's dot product: KATA-Σg uses them all,
KATA-Mg the block diagonal, the pairs within a group (the other blocks are zeroed):

    Mg:  κ[t, s] = Σ_i u_i[t, s]²,       u_i = q_i k_iᵀ           (G products of width E)
    Σg:  κ[t, s] = Σ_{i,j} u_ij[t, s]²,  u_ij = q_i k_jᵀ          (G² products of width E)

(G = 1 is both). For a score gradient `w = ∂L/∂κ` the dot products' gradient is `2 w ⊙ u` per group
(pair), and the row gradient is that times the other side's groups (`group_grad`, `grad_dot`).

Decay tiles (log2, ops/triton/decay.py's conventions): the weight from key s to query t >= s is
`exp2(Σ_{s<u<=t} g_u · log2 e)`. On the diagonal, where the column tile lies inside the row tile,
it is a difference of the row tile's in-tile cumsums of the g's (raised to the core's RESET_LIMIT,
so a reset or a huge log-decay stays a weight of 0 and cancels nothing), and with EXACT (fp32
inputs) a masked cumsum of the g's in between (`query_diagonal_decay`, `key_diagonal_decay`). Off the
diagonal the tiles are disjoint and the log-weight is a sum of parts that are each ≤ 0, never a
difference: the query's in-tile cumsum + the tiles in between + the key's in-tile suffix sum.
"""
import torch
import triton
import triton.language as tl

from polyattn.ops.triton.decay import chunk_decay, chunk_suffix, reset_limit_ref
from polyattn.ops.triton.plan import block
from polyattn.ops.triton.precision import LOG2E, mma, mma_left_fp32, to_output


@triton.jit
def load_rows(x, base, end, H, i_h, D, R: tl.constexpr, BD: tl.constexpr):
    """Rows `base .. base + R` of head `i_h` of a `[N_tok, H, D]` tensor as `[R, BD]` (0 past `end`, past D)."""
    t = base + tl.arange(0, R)
    o_d = tl.arange(0, BD)
    p = x + (t.to(tl.int64) * H + i_h)[:, None] * D + o_d[None, :]
    return tl.load(p, mask=(t < end)[:, None] & (o_d < D)[None, :], other=0.0)


@triton.jit
def group_offsets(base, end, H, i_h, K, E, G: tl.constexpr, R: tl.constexpr, BE: tl.constexpr):
    """Offsets and mask of a group-major `[G·R, BE]` tile of a `[N_tok, H, K]` tensor."""
    o_r = tl.arange(0, G * R)
    t = base + o_r % R
    o_e = tl.arange(0, BE)
    offsets = (t.to(tl.int64) * H + i_h)[:, None] * K + ((o_r // R) * E)[:, None] + o_e[None, :]
    return offsets, (t < end)[:, None] & (o_e < E)[None, :]


@triton.jit
def load_groups(x, base, end, H, i_h, K, E, G: tl.constexpr, R: tl.constexpr, BE: tl.constexpr):
    """Group-major `[G·R, BE]` tile of rows `base .. base + R` (0 past `end`)."""
    offsets, mask = group_offsets(base, end, H, i_h, K, E, G, R, BE)
    return tl.load(x + offsets, mask=mask, other=0.0)


@triton.jit
def store_groups(x, value, base, end, H, i_h, K, E, G: tl.constexpr, R: tl.constexpr, BE: tl.constexpr, F32: tl.constexpr):
    """Store a group-major `[G·R, BE]` tile (downcast: x's dtype)."""
    offsets, mask = group_offsets(base, end, H, i_h, K, E, G, R, BE)
    tl.store(x + offsets, to_output(value, x.dtype.element_ty, F32), mask=mask)


@triton.jit
def group_rowdot(x, y, G: tl.constexpr, R: tl.constexpr):
    """`Σ_{i, e} x[i·R + t, e] y[i·R + t, e]` for group-major fp32 tiles: `[G·R, BE] -> [R]`."""
    rows = tl.sum(x * y, axis=1)  # [G·R]
    if G == 1:
        return rows
    return tl.sum(tl.reshape(rows, (G, R)), axis=0)


@triton.jit
def pair_dots(a, b, G: tl.constexpr, SUM: tl.constexpr, F32: tl.constexpr):
    """Group dot products of two group-major tiles `a: [G·R, BE]`, `b: [G·C, BE]` as one
    `[G·R, G·C]` fp32 tile (block `(i, j)`: `u_ij = a_i b_jᵀ`): every block for Σg, the block
    diagonal for Mg (the others 0). One 2D tensor-core product either way: a batched `[G, R, BE]`
    product runs far slower on the H200, and the masked blocks cost G times the Mg FLOPs."""
    u = mma(a, tl.trans(b), F32)  # [G·R, BE] @ [BE, G·C] -> [G·R, G·C]
    if not SUM:
        if G > 1:
            rows = tl.arange(0, a.shape[0]) // (a.shape[0] // G)  # group of each row
            cols = tl.arange(0, b.shape[0]) // (b.shape[0] // G)  # group of each column
            u = tl.where(rows[:, None] == cols[None, :], u, 0.0)
    return u


@triton.jit
def square_sum(u, G: tl.constexpr, SUM: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    """κ = the sum of the squared group dot products of `pair_dots`: `[G·R, G·C] -> [R, C]`."""
    if G == 1:
        a = u * u
    else:
        a = tl.sum(tl.sum(tl.reshape(u * u, (G, R, G, C)), axis=2), axis=0)  # [G, R, G, C] -> [R, C]
    return a


@triton.jit
def group_grad(u, w, mask, G: tl.constexpr, SUM: tl.constexpr, MASKED: tl.constexpr):
    """The dot products' gradient `w ⊙ u` per group pair (0 where u is, Mg's off-diagonal
    blocks), `w: [R, C]` broadcast over the blocks of `u: [G·R, G·C]` (the factor 2 of the square
    is in w); with MASKED, exactly 0 where `mask: [R, C]` is false (selected, so that a non-finite
    score there cannot leak)."""
    R: tl.constexpr = w.shape[0]
    C: tl.constexpr = w.shape[1]
    if G == 1:
        du = u * w
        if MASKED:
            du = tl.where(mask, du, 0.0)
    else:
        du = tl.reshape(u, (G, R, G, C)) * w[None, :, None, :]  # [G, R, G, C]
        if MASKED:
            du = tl.where(mask[None, :, None, :], du, 0.0)
        du = tl.reshape(du, (G * R, G * C))
    return du


@triton.jit
def score_values(a, v, SPLIT: tl.constexpr, F32: tl.constexpr):
    """`a @ v` for an fp32 tile `a` (scores, or score gradients; `[R, C]` or batched `[G, R, C]`)
    and `v` in the input dtype: with SPLIT, a enters in two halves (precision.mma_left_fp32: ~16
    mantissa bits, two tensor-core products); else a is rounded to v's dtype (one product, as flash
    attention does)."""
    if SPLIT:
        return mma_left_fp32(a, v, F32)
    return mma(to_output(a, v.dtype, F32), v, F32)


@triton.jit
def grad_dot(du, b, G: tl.constexpr, SUM: tl.constexpr, SPLIT: tl.constexpr, F32: tl.constexpr):
    """Row gradient `du @ b` of a group-major tile: `[G·R, G·C] @ [G·C, BE] -> [G·R, BE]` fp32 (du
    entering as in `score_values`)."""
    return score_values(du, b, SPLIT, F32)


@triton.jit
def query_diagonal_decay(b_g, b_h, t, s, b_hs, EXACT: tl.constexpr):
    """`[R, C]` log2-decay `Σ_{s<u<=t} g_u` from keys `s` (a column tile inside the row tile) to
    queries `t` (the row tile), -inf where s > t. `b_g`, `b_h`: the row tile's g and its
    log2-prescaled inclusive cumsum from its first row; `b_hs` the same
    cumsum at the key rows. `b_h[t] - b_hs[s]`; EXACT: masked cumsum over the query rows."""
    m = t[:, None] >= s[None, :]
    if EXACT:
        b_d = tl.cumsum(tl.where(t[:, None] > s[None, :], b_g[:, None], 0.0), axis=0) * LOG2E
    else:
        b_d = b_h[:, None] - b_hs[None, :]
    return tl.where(m, b_d, float("-inf"))


@triton.jit
def key_diagonal_decay(b_gn, b_h, s, t, b_ht, EXACT: tl.constexpr):
    """`[R, C]` log2-decay `Σ_{s<u<=t} g_u` from keys `s` (the row tile) to queries `t` (a column
    tile inside it), -inf where t < s. `b_gn[s] = g_{s+1}` inside the row tile (0 at its last row),
    `b_h` the row tile's log2 inclusive cumsum, `b_ht` the same cumsum at the
    query rows. `b_ht[t] - b_h[s]`; EXACT: reverse masked cumsum of `g_{u+1}` over key rows."""
    m = s[:, None] <= t[None, :]
    if EXACT:
        b_d = tl.cumsum(tl.where(s[:, None] < t[None, :], b_gn[:, None], 0.0), axis=0, reverse=True) * LOG2E
    else:
        b_d = b_ht[None, :] - b_h[:, None]
    return tl.where(m, b_d, float("-inf"))


@triton.jit
def query_tile(q, g, tiles, starts, H, K, E, G: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, USE_G: tl.constexpr):
    """The query tile of this program of a query-major kernel (grid: (query tiles, H), the last tiles,
    which have the most key tiles, first): `(i_h, t0, t1, bos, t, m_t, b_q [G·BM, BE], b_gq, b_hq)`,
    with the tile's g and its log2 inclusive cumsum (ops/triton/decay.chunk_decay)."""
    i_m = tl.num_programs(0) - 1 - tl.program_id(0)
    i_h = tl.program_id(1)
    t0 = tl.load(tiles + i_m * 4)
    t1 = tl.load(tiles + i_m * 4 + 1)
    bos = tl.load(starts + tl.load(tiles + i_m * 4 + 2))
    t = t0 + tl.arange(0, BM)
    m_t = t < t1
    b_q = load_groups(q, t0, t1, H, i_h, K, E, G, BM, BE)  # [G*BM, BE]
    b_gq, b_hq, _ = chunk_decay(g, t, m_t, H, i_h, USE_G)  # [BM], [BM]
    return i_h, t0, t1, bos, t, m_t, b_q, b_gq, b_hq


@triton.jit
def key_tile(
    k, v, g, s0, end, t, b_gq, b_hq, b_log, H, i_h, K, V, E,
    G: tl.constexpr, BN: tl.constexpr, BE: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, DIAGONAL: tl.constexpr, EXACT: tl.constexpr,
):
    """Key tile `s0 .. s0 + BN` (rows before `end`) for the query rows `t`: `(b_k [G·BN, BE], b_v [BN, BV],
    b_d [BM, BN], mask, k_last)`. b_d is the decay tile `exp2(log2-decay)` (ones without g), mask the
    causal mask (all true off the diagonal), k_last the key tile's log2-decay. `b_log`: on the diagonal
    the log2-decay from the query tile's start to s0; off it the log2-decay of the key tiles between
    this one and the query tile."""
    s = s0 + tl.arange(0, BN)
    b_k = load_groups(k, s0, end, H, i_h, K, E, G, BN, BE)  # [G*BN, BE]
    b_v = load_rows(v, s0, end, H, i_h, V, BN, BV)  # [BN, BV]
    mask = t[:, None] >= s[None, :]
    k_last = 0.0
    if USE_G:
        b_gk, b_hk, k_last = chunk_decay(g, s, s < end, H, i_h, True)
        if DIAGONAL:
            b_d = tl.exp2(query_diagonal_decay(b_gq, b_hq, t, s, b_hk + b_log, EXACT))
        else:
            b_d = tl.exp2(b_hq[:, None] + (chunk_suffix(b_gk, b_hk, k_last, EXACT) + b_log)[None, :])
    else:
        b_d = tl.full([t.shape[0], BN], 1.0, tl.float32)
    return b_k, b_v, b_d, mask, k_last


def diagonal_decay_ref(g: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, query_rows: bool) -> torch.Tensor:
    """Twin of `query_diagonal_decay` (`query_rows`) and `key_diagonal_decay` for one sequence's
    `g: [T]` and tile positions `rows: [R]`, `cols: [C]`: the direct sums of the reset-limited g times log2 e,
    -inf off the triangle."""
    g = reset_limit_ref(g.double())
    out = torch.full((rows.numel(), cols.numel()), float("-inf"), dtype=torch.float64, device=g.device)
    for a, r in enumerate(rows.tolist()):
        for b, c in enumerate(cols.tolist()):
            t, s = (r, c) if query_rows else (c, r)
            if s <= t:
                out[a, b] = g[s + 1:t + 1].sum()
    return (out * LOG2E.value).float()


def block_sizes(K: int, V: int, groups: int) -> tuple[int, int, int]:
    """`(E, BE, BV)`: group width, its power-of-two tile, the value tile (whole V per program)."""
    E = K // groups
    return E, block(E), block(V)


__all__ = [
    "block_sizes", "diagonal_decay_ref", "grad_dot", "group_grad", "group_rowdot", "key_diagonal_decay", "key_tile",
    "load_groups", "load_rows", "pair_dots", "query_diagonal_decay", "query_tile", "score_values", "square_sum", "store_groups",
]
