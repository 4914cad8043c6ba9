"""Stage 1 of the delta rule: the per-chunk UT solve and the WY factors, every chunk in parallel.

`wy_kernel` implements, for one chunk of C = 64 tokens of one head (ops/delta/README.md, "Chunk form"),

    A    = strict_lower(diag(beta) (K K^T ⊙ Γ))       Γ[i, j] = exp(gc_i - gc_j)
    Tinv = (I + A)^{-1}                                 unit lower triangular, fp32

and stores row i of `Tinv` at token i: `t_inv: [N_tok, H, C]` fp32. The delta rule's recurrence
(forward.py) applies Tinv itself, `U = Tinv diag(beta) (V - diag(exp(gc)) K h)`. Log-linear Gated
DeltaNet (ops/loglinear/triton/gdn.py), whose level walks read U under several states, takes the two
state-independent factors that `wy_factors_kernel` forms,

    W = Tinv diag(beta exp(gc)) K    [C, K] fp32,      Ū = Tinv diag(beta) V    [C, V] fp32,

so that `U = Ū - W h` is one product per state. `wy_ref` and `wy_factors_ref` are the PyTorch twins.
"""
import torch
import triton
import triton.language as tl

from polyattn.ops.triton.decay import chunk_decay, exact_segsum, exact_suffix
from polyattn.ops.triton.plan import block
from polyattn.ops.triton.precision import LOG2E, dot_f32, first_nonfinite_row, mma, mma_left_fp32, zero_rows_from

from .forward import chunk_program


@triton.jit
def fp32_dot(x, y):
    return tl.dot(x, y, input_precision="ieee")


@triton.jit
def invert_unit_lower(b_a):
    """`(I + A)^{-1}` of a strictly lower `A: [16, 16]` (fp32). A is nilpotent (A^16 = 0), so
    `(I + A)^{-1} = (I - A)(I + A^2)(I + A^4)(I + A^8)`: three squarings and three products,
    each a [16, 16] @ [16, 16] fp32 product, instead of 15 dependent substitution steps."""
    o = tl.arange(0, 16)
    eye = tl.where(o[:, None] == o[None, :], 1.0, 0.0)  # [16, 16]
    a2 = fp32_dot(b_a, b_a)
    a4 = fp32_dot(a2, a2)
    a8 = fp32_dot(a4, a4)
    b_t = fp32_dot(eye - b_a, eye + a2)
    b_t = fp32_dot(b_t, eye + a4)
    return fp32_dot(b_t, eye + a8)


@triton.jit
def block_rows(k, beta, g, bos, eos, i_b, H, i_h, K, BT: tl.constexpr, BK: tl.constexpr, USE_G: tl.constexpr):
    """Rows `[i_b * BT, (i_b + 1) * BT)` of the chunk: keys [BT, BK], beta [BT], and the block's
    log-decays [BT] (0 past the end, or without decay)."""
    t = bos + i_b * BT + tl.arange(0, BT)
    m_t = t < eos
    o_k = tl.arange(0, BK)
    b_k = tl.load(k + (t * H + i_h)[:, None] * K + o_k[None, :], mask=m_t[:, None] & (o_k < K)[None, :], other=0.0)
    b_beta = tl.load(beta + t * H + i_h, mask=m_t, other=0.0).to(tl.float32)  # [BT]
    if USE_G:
        b_g = tl.load(g + t * H + i_h, mask=m_t, other=0.0).to(tl.float32)  # [BT]
    else:
        b_g = tl.zeros([BT], dtype=tl.float32)
    return b_k, b_beta, b_g


@triton.jit
def gram_block(b_ki, b_beta_i, b_kj, b_d, F32: tl.constexpr):
    """The [BT, BT] block `diag(beta_i) (K_i K_j^T ⊙ exp2(D))` of A for the log2-decays `D`
    between its rows and columns (-inf where the block is not below the diagonal)."""
    b_a = mma(b_ki, tl.trans(b_kj), F32) * b_beta_i[:, None]  # [BT, BK] @ [BK, BT] -> [BT, BT]
    return tl.where(b_d > float("-inf"), b_a * tl.exp2(b_d), 0.0)


@triton.jit
def diagonal_decay(b_g):
    """Log2-decays inside one block, strictly below the diagonal (-inf elsewhere)."""
    o = tl.arange(0, b_g.shape[0])
    return tl.where(o[:, None] > o[None, :], exact_segsum(b_g, False), float("-inf"))


@triton.jit
def cross_decay(b_gi, b_gj, between):
    """Log2-decays from the rows of an earlier block j to those of block i: the suffix of j after
    each column, the whole blocks in between, the prefix of i up to each row; direct sums only."""
    return tl.cumsum(b_gi, axis=0)[:, None] * LOG2E + between + exact_suffix(b_gj)[None, :]


@triton.jit
def store_block(t_inv, bos, eos, i_b, j_b, b_x, H, i_h, C: tl.constexpr, BT: tl.constexpr):
    t = bos + i_b * BT + tl.arange(0, BT)
    cols = j_b * BT + tl.arange(0, BT)
    tl.store(t_inv + (t * H + i_h)[:, None] * C + cols[None, :], b_x, mask=(t < eos)[:, None])


@triton.jit
def first_bad_row(b_k, b_beta, b_g, i_b, BT: tl.constexpr):
    """The chunk row of block `i_b`'s first token whose key or beta is not finite or whose log-decay is NaN
    (the chunk's 4·BT rows when none; `g = -inf` is a reset, not bad input)."""
    bad = tl.sum(tl.where(b_k - b_k == 0, 0, 1), axis=1) + tl.where((b_beta - b_beta == 0) & (b_g == b_g), 0, 1)  # [BT]
    return tl.min(tl.where(bad > 0, i_b * BT + tl.arange(0, BT), 4 * BT), axis=0)


@triton.jit
def clean_rows(b_k, b_beta, b_g, i_b, first, BT: tl.constexpr):
    """Block `i_b`'s rows with those from chunk row `first` on set to zero (key, beta, log-decay)."""
    keep = i_b * BT + tl.arange(0, BT) < first  # [BT]
    return tl.where(keep[:, None], b_k, 0.0).to(b_k.dtype), tl.where(keep, b_beta, 0.0), tl.where(keep, b_g, 0.0)


@triton.jit
def wy_kernel(
    k, beta, g, t_inv, firsts, chunks, H, K,
    C: tl.constexpr, BK: tl.constexpr, USE_G: tl.constexpr, F32: tl.constexpr,
):
    """grid: (num_chunks, H); one program per chunk and head, C = 64 as four row blocks of
    BT = 16. Blocks of A come from `[BT, BK] @ [BK, BT]` products; the diagonal blocks of
    `I + A` are inverted by `invert_unit_lower` and the blocks below by
    `Tinv_ij = -Tinv_ii sum_{m=j}^{i-1} A_im Tinv_mj` (fp32 products); blocks above are 0.
    A token whose key or beta is not finite, or whose log-decay is NaN, changes no earlier row: the chunk's rows
    from the first such token on enter as zeros, and its row is stored in `firsts [num_chunks, H]`
    (C when none) for the later stages, which make the outputs from it on NaN."""
    BT: tl.constexpr = 16
    i_ch, i_h = tl.program_id(0), tl.program_id(1)
    bos = tl.load(chunks + i_ch * 4).to(tl.int64)
    eos = tl.load(chunks + i_ch * 4 + 1).to(tl.int64)
    k0, b0, g0 = block_rows(k, beta, g, bos, eos, 0, H, i_h, K, BT, BK, USE_G)
    k1, b1, g1 = block_rows(k, beta, g, bos, eos, 1, H, i_h, K, BT, BK, USE_G)
    k2, b2, g2 = block_rows(k, beta, g, bos, eos, 2, H, i_h, K, BT, BK, USE_G)
    k3, b3, g3 = block_rows(k, beta, g, bos, eos, 3, H, i_h, K, BT, BK, USE_G)
    first = tl.minimum(tl.minimum(first_bad_row(k0, b0, g0, 0, BT), first_bad_row(k1, b1, g1, 1, BT)),
                       tl.minimum(first_bad_row(k2, b2, g2, 2, BT), first_bad_row(k3, b3, g3, 3, BT)))
    tl.store(firsts + i_ch * H + i_h, first)
    k0, b0, g0 = clean_rows(k0, b0, g0, 0, first, BT)
    k1, b1, g1 = clean_rows(k1, b1, g1, 1, first, BT)
    k2, b2, g2 = clean_rows(k2, b2, g2, 2, first, BT)
    k3, b3, g3 = clean_rows(k3, b3, g3, 3, first, BT)
    s1 = tl.sum(g1, axis=0) * LOG2E  # whole-block log2-decays between non-adjacent blocks
    s2 = tl.sum(g2, axis=0) * LOG2E
    t00 = invert_unit_lower(gram_block(k0, b0, k0, diagonal_decay(g0), F32))  # [BT, BT] each
    t11 = invert_unit_lower(gram_block(k1, b1, k1, diagonal_decay(g1), F32))
    t22 = invert_unit_lower(gram_block(k2, b2, k2, diagonal_decay(g2), F32))
    t33 = invert_unit_lower(gram_block(k3, b3, k3, diagonal_decay(g3), F32))
    a10 = gram_block(k1, b1, k0, cross_decay(g1, g0, 0.0), F32)
    a20 = gram_block(k2, b2, k0, cross_decay(g2, g0, s1), F32)
    a21 = gram_block(k2, b2, k1, cross_decay(g2, g1, 0.0), F32)
    a30 = gram_block(k3, b3, k0, cross_decay(g3, g0, s1 + s2), F32)
    a31 = gram_block(k3, b3, k1, cross_decay(g3, g1, s2), F32)
    a32 = gram_block(k3, b3, k2, cross_decay(g3, g2, 0.0), F32)
    t10 = -fp32_dot(t11, fp32_dot(a10, t00))
    t21 = -fp32_dot(t22, fp32_dot(a21, t11))
    t20 = -fp32_dot(t22, fp32_dot(a20, t00) + fp32_dot(a21, t10))
    t32 = -fp32_dot(t33, fp32_dot(a32, t22))
    t31 = -fp32_dot(t33, fp32_dot(a31, t11) + fp32_dot(a32, t21))
    t30 = -fp32_dot(t33, fp32_dot(a30, t00) + fp32_dot(a31, t10) + fp32_dot(a32, t20))
    b_zero = tl.zeros([BT, BT], dtype=tl.float32)
    store_block(t_inv, bos, eos, 0, 0, t00, H, i_h, C, BT)
    store_block(t_inv, bos, eos, 0, 1, b_zero, H, i_h, C, BT)
    store_block(t_inv, bos, eos, 0, 2, b_zero, H, i_h, C, BT)
    store_block(t_inv, bos, eos, 0, 3, b_zero, H, i_h, C, BT)
    store_block(t_inv, bos, eos, 1, 0, t10, H, i_h, C, BT)
    store_block(t_inv, bos, eos, 1, 1, t11, H, i_h, C, BT)
    store_block(t_inv, bos, eos, 1, 2, b_zero, H, i_h, C, BT)
    store_block(t_inv, bos, eos, 1, 3, b_zero, H, i_h, C, BT)
    store_block(t_inv, bos, eos, 2, 0, t20, H, i_h, C, BT)
    store_block(t_inv, bos, eos, 2, 1, t21, H, i_h, C, BT)
    store_block(t_inv, bos, eos, 2, 2, t22, H, i_h, C, BT)
    store_block(t_inv, bos, eos, 2, 3, b_zero, H, i_h, C, BT)
    store_block(t_inv, bos, eos, 3, 0, t30, H, i_h, C, BT)
    store_block(t_inv, bos, eos, 3, 1, t31, H, i_h, C, BT)
    store_block(t_inv, bos, eos, 3, 2, t32, H, i_h, C, BT)
    store_block(t_inv, bos, eos, 3, 3, t33, H, i_h, C, BT)


def wy_solve(k, beta, g, *, chunk_size: int, chunks, num_warps: int = 4):
    """Launch `wy_kernel`. k: [N_tok, H, K]; beta, g: [N_tok, H] (g may be None); chunks: the
    chunk table (ops/triton/plan.py). Returns `(t_inv [N_tok, H, C] fp32, firsts [num_chunks, H]
    int32)`: each chunk's first row with a non-finite key, beta or log-decay (C when none)."""
    N_tok, H, K = k.shape
    table, _, NC = chunks
    if chunk_size != 64:
        raise ValueError(f"expected chunk_size 64 for the delta rule kernels (four blocks of 16), got {chunk_size}")
    t_inv = torch.empty(N_tok, H, chunk_size, dtype=torch.float32, device=k.device)
    firsts = torch.empty(NC, H, dtype=torch.int32, device=k.device)
    wy_kernel[(NC, H)](
        k, beta, g, t_inv, firsts, table, H, K,
        C=chunk_size, BK=block(K), USE_G=g is not None, F32=dot_f32(k.dtype), num_warps=num_warps,
    )
    return t_inv, firsts


@triton.jit
def factor_tiles(
    x, b_left, out, t, m_t, H, i_h, D, first, C: tl.constexpr, BD: tl.constexpr, F32: tl.constexpr,
    CUT: tl.constexpr, CHECK: tl.constexpr,
):
    """`out = b_left @ x` over the rows `t` of one chunk, in [C, BD] column tiles of the D columns
    (`b_left` fp32 [C, C], `x` in the input dtype, `out` fp32). CUT: x's rows from chunk row `first`
    on enter as zeros, and with CHECK from a tile's first non-finite row on too. Returns the first
    row so cut (`first` without CHECK)."""
    for i_d in range(0, tl.cdiv(D, BD)):
        o_d = i_d * BD + tl.arange(0, BD)
        rows = (t * H + i_h)[:, None] * D + o_d[None, :]  # [C, BD]
        m = m_t[:, None] & (o_d < D)[None, :]
        b_x = tl.load(x + rows, mask=m, other=0.0)  # [C, BD]
        if CUT:
            if CHECK:
                first = tl.minimum(first, first_nonfinite_row(b_x))
            b_x = zero_rows_from(b_x, first)  # [C, BD]
        tl.store(out + rows, mma_left_fp32(b_left, b_x, F32), mask=m)  # [C, C] @ [C, BD] -> [C, BD]
    return first


@triton.jit
def wy_factors_kernel(
    k, v, beta, g, t_inv, w, u_bar, firsts, chunks, H, K, V,
    C: tl.constexpr, BD: tl.constexpr, USE_G: tl.constexpr, F32: tl.constexpr,
):
    """grid: (num_chunks, H). `W = (Tinv diag(beta exp(gc))) K` and `Ū = (Tinv diag(beta)) V`:
    the fp32 left factors scale Tinv's columns, the products keep them split in two halves. The rows
    from the chunk's first non-finite token (`firsts`, lowered here by a non-finite value row) enter
    as zeros."""
    i_ch, i_h, _, _, o_t, t, m_t = chunk_program(chunks, C)
    first = tl.load(firsts + i_ch * H + i_h)
    keep = o_t < first  # [C]
    b_tinv = tl.load(t_inv + (t * H + i_h)[:, None] * C + o_t[None, :], mask=m_t[:, None], other=0.0)  # [C, C]
    b_beta = tl.load(beta + t * H + i_h, mask=m_t, other=0.0).to(tl.float32)  # [C]
    _, b_gc, _ = chunk_decay(g, t, m_t, H, i_h, USE_G)  # [C]
    b_tb = b_tinv * tl.where(keep, b_beta, 0.0)[None, :]  # Tinv diag(beta): [C, C]
    factor_tiles(k, b_tb * tl.where(keep, tl.exp2(b_gc), 0.0)[None, :], w, t, m_t, H, i_h, K, first, C, BD, F32, True, False)
    first = factor_tiles(v, b_tb, u_bar, t, m_t, H, i_h, V, first, C, BD, F32, True, True)
    tl.store(firsts + i_ch * H + i_h, first)


def wy_factors(k, v, beta, g, t_inv, firsts, *, chunks, num_warps: int = 4):
    """Launch `wy_factors_kernel`: `(w [N_tok, H, K], u_bar [N_tok, H, V])`, fp32; `firsts` (from
    `wy_solve`) lowered in place where a value row is the chunk's first non-finite one."""
    N_tok, H, K = k.shape
    V = v.shape[-1]
    w = torch.empty(N_tok, H, K, dtype=torch.float32, device=k.device)
    u_bar = torch.empty(N_tok, H, V, dtype=torch.float32, device=k.device)
    wy_factors_kernel[(chunks[2], H)](
        k, v, beta, g, t_inv, w, u_bar, firsts, chunks[0], H, K, V,
        C=t_inv.shape[-1], BD=64, USE_G=g is not None, F32=dot_f32(k.dtype), num_warps=num_warps,
    )
    return w, u_bar


def wy_factors_ref(k, v, beta, g, t_inv, seq_lens: tuple, *, chunk_size: int):
    """PyTorch twin of `wy_factors_kernel` (float64): `(w [N_tok, H, K], u_bar [N_tok, H, V])`."""
    k, v, beta, t_inv = (x.double() for x in (k, v, beta, t_inv))
    w, u_bar = torch.zeros_like(k), torch.zeros_like(v)
    bos = 0
    for length in seq_lens:
        for s in range(bos, bos + length, chunk_size):
            e = min(s + chunk_size, bos + length)
            tinv = t_inv[s:e, :, : e - s].transpose(0, 1)  # [n, H, n] -> [H, n, n]
            bc = beta[s:e].t()  # [H, n]
            gc = torch.zeros_like(bc) if g is None else torch.cumsum(g[s:e].double().t(), -1)  # [H, n]
            w[s:e] = (tinv @ ((bc * torch.exp(gc))[..., None] * k[s:e].transpose(0, 1))).transpose(0, 1)
            u_bar[s:e] = (tinv @ (bc[..., None] * v[s:e].transpose(0, 1))).transpose(0, 1)
        bos += length
    return w, u_bar


def wy_ref(k, beta, g, seq_lens: tuple, *, chunk_size: int) -> torch.Tensor:
    """PyTorch twin of `wy_kernel` (float64 inside): `t_inv: [N_tok, H, C]`."""
    N_tok, H, _ = k.shape
    out = torch.zeros(N_tok, H, chunk_size, dtype=torch.float64, device=k.device)
    bos = 0
    for length in seq_lens:
        for s in range(bos, bos + length, chunk_size):
            e = min(s + chunk_size, bos + length)
            kc = k[s:e].double().transpose(0, 1)  # [n, H, K] -> [H, n, K]
            bc = beta[s:e].double().t()  # [H, n]
            gc = torch.zeros_like(bc) if g is None else torch.cumsum(g[s:e].double().t(), -1)  # [H, n]
            gamma = torch.exp(gc[:, :, None] - gc[:, None, :])  # [H, n, n]
            a = torch.tril(bc[:, :, None] * (kc @ kc.transpose(-1, -2)) * gamma, diagonal=-1)  # [H, n, n]
            eye = torch.eye(e - s, dtype=torch.float64, device=k.device)
            inv = torch.linalg.solve_triangular(eye + a, eye.expand_as(a), upper=False, unitriangular=True)  # [H, n, n]
            out[s:e, :, : e - s] = inv.transpose(0, 1)  # [H, n, n] -> [n, H, n]
        bos += length
    return out
