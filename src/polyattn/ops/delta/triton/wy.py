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

from polyattn.ops.triton.decay import chunk_decay, exact_segsum
from polyattn.ops.triton.plan import block
from polyattn.ops.triton.precision import dot_f32, first_nonfinite_row, mma, mma_left_fp32, split_halves, zero_rows_from

from .forward import chunk_program


@triton.jit
def fp32_dot(x, y):
    return tl.dot(x, y, input_precision="ieee")


@triton.jit
def invert_unit_lower(b_a):
    """`(I + A)^{-1}` of strictly lower `A: [NB, 16, 16]` (fp32, NB blocks at once). A is nilpotent
    (A^16 = 0), so `(I + A)^{-1} = (I - A)(I + A^2)(I + A^4)(I + A^8)`: three squarings and three
    products, each a batched [16, 16] @ [16, 16] fp32 product, instead of 15 dependent substitution steps."""
    o = tl.arange(0, 16)
    eye = tl.where(o[:, None] == o[None, :], 1.0, 0.0)[None, :, :]  # [1, 16, 16]
    a2 = fp32_dot(b_a, b_a)
    a4 = fp32_dot(a2, a2)
    a8 = fp32_dot(a4, a4)
    b_t = fp32_dot(eye - b_a, eye + a2)
    b_t = fp32_dot(b_t, eye + a4)
    return fp32_dot(b_t, eye + a8)


@triton.jit
def block_offsets(t_inv, bos, eos, H, i_h, r0, c0, STEP: tl.constexpr, NB: tl.constexpr, S: tl.constexpr, C: tl.constexpr):
    """Pointers and row mask of NB square blocks `[S, S]` of one chunk's rows of `t_inv [N_tok, H, C]`:
    block b has rows `r0 + b·STEP + [0, S)` and columns `c0 + b·STEP + [0, S)` of the chunk's C × C matrix."""
    o_b = tl.arange(0, NB) * STEP
    o_s = tl.arange(0, S)
    rows = bos + r0 + o_b[:, None, None] + o_s[None, :, None]  # [NB, S, 1]
    cols = c0 + o_b[:, None, None] + o_s[None, None, :]  # [NB, 1, S]
    return t_inv + (rows * H + i_h) * C + cols, rows < eos  # [NB, S, S], [NB, S, 1]


@triton.jit
def load_blocks(t_inv, bos, eos, H, i_h, r0, c0, STEP: tl.constexpr, NB: tl.constexpr, S: tl.constexpr, C: tl.constexpr):
    """`[NB, S, S]` fp32 blocks of `block_offsets`, rows past the chunk's end 0."""
    ptrs, m = block_offsets(t_inv, bos, eos, H, i_h, r0, c0, STEP, NB, S, C)
    return tl.load(ptrs, mask=m, other=0.0)


@triton.jit
def store_blocks(t_inv, bos, eos, H, i_h, r0, c0, b_x, STEP: tl.constexpr, C: tl.constexpr):
    """Stores `b_x [NB, S, S]` into the blocks of `block_offsets`, rows past the chunk's end left alone."""
    ptrs, m = block_offsets(t_inv, bos, eos, H, i_h, r0, c0, STEP, b_x.shape[0], b_x.shape[1], C)
    tl.store(ptrs, b_x, mask=m)


@triton.jit
def wy_kernel(
    k, beta, g, t_inv, firsts, chunks, H, K,
    C: tl.constexpr, BK: tl.constexpr, USE_G: tl.constexpr, F32: tl.constexpr,
):
    """grid: (num_chunks, H); one program per chunk and head, C = 64. A is one `[C, BK] @ [BK, C]`
    product, masked by the direct-sum decays `exp2(Σ_{j<s<=i} g_s)` below the diagonal, and is stored in
    the chunk's rows of `t_inv`; the inverse is then built there in place, in three stages that read their
    blocks back (a barrier between stages, the blocks cached on chip): the four diagonal 16 × 16 blocks
    of `I + A` inverted at once (`invert_unit_lower`), the two 32 × 32 diagonal blocks completed by
    `Tinv_10 = -Tinv_11 A_10 Tinv_00` (both in one batch), then the 64 × 64 by the same formula on
    32 × 32 blocks; fp32 products throughout. A token whose key or beta is not finite, or whose log-decay
    is NaN, changes no earlier row: the chunk's rows from the first such token on enter as zeros, and its
    row is stored in `firsts [num_chunks, H]` (C when none) for the later stages, which make the outputs
    from it on NaN."""
    i_ch, i_h, bos, eos, o_t, t, m_t = chunk_program(chunks, C)
    o_k = tl.arange(0, BK)
    b_k = tl.load(k + (t * H + i_h)[:, None] * K + o_k[None, :], mask=m_t[:, None] & (o_k < K)[None, :], other=0.0)  # [C, BK]
    b_beta = tl.load(beta + t * H + i_h, mask=m_t, other=0.0).to(tl.float32)  # [C]
    if USE_G:
        b_g = tl.load(g + t * H + i_h, mask=m_t, other=0.0).to(tl.float32)  # [C]
    else:
        b_g = tl.zeros([C], dtype=tl.float32)
    bad = (b_beta - b_beta != 0) | (b_g != b_g)  # [C]: beta not finite or log-decay NaN (-inf is a reset)
    first = tl.minimum(first_nonfinite_row(b_k), tl.min(tl.where(bad, o_t, C), axis=0))
    tl.store(firsts + i_ch * H + i_h, first)
    keep = o_t < first  # [C]
    b_k = zero_rows_from(b_k, first)
    b_g = tl.where(keep, b_g, 0.0)
    b_a = mma(b_k, tl.trans(b_k), F32) * tl.where(keep, b_beta, 0.0)[:, None]  # [C, BK] @ [BK, C] -> [C, C]
    b_d = exact_segsum(b_g, False)  # [C, C] log2-decays
    b_a = tl.where(o_t[:, None] > o_t[None, :], b_a * tl.exp2(b_d), 0.0)
    tl.store(t_inv + (t * H + i_h)[:, None] * C + o_t[None, :], b_a, mask=m_t[:, None])
    tl.debug_barrier()
    b_a_diag = load_blocks(t_inv, bos, eos, H, i_h, 0, 0, 16, 4, 16, C)  # A_00, A_11, A_22, A_33
    b_a_sub = load_blocks(t_inv, bos, eos, H, i_h, 16, 0, 32, 2, 16, C)  # A_10, A_32
    b_a_low = load_blocks(t_inv, bos, eos, H, i_h, 32, 0, 0, 1, 32, C)  # the lower-left 32 × 32 block
    store_blocks(t_inv, bos, eos, H, i_h, 0, 0, invert_unit_lower(b_a_diag), 16, C)
    tl.debug_barrier()
    b_t_lo = load_blocks(t_inv, bos, eos, H, i_h, 0, 0, 32, 2, 16, C)  # Tinv_00, Tinv_22
    b_t_hi = load_blocks(t_inv, bos, eos, H, i_h, 16, 16, 32, 2, 16, C)  # Tinv_11, Tinv_33
    store_blocks(t_inv, bos, eos, H, i_h, 16, 0, -fp32_dot(b_t_hi, fp32_dot(b_a_sub, b_t_lo)), 32, C)
    tl.debug_barrier()
    b_t_lo = load_blocks(t_inv, bos, eos, H, i_h, 0, 0, 0, 1, 32, C)  # the upper-left 32 × 32 inverse
    b_t_hi = load_blocks(t_inv, bos, eos, H, i_h, 32, 32, 0, 1, 32, C)  # the lower-right one
    store_blocks(t_inv, bos, eos, H, i_h, 32, 0, -fp32_dot(b_t_hi, fp32_dot(b_a_low, b_t_lo)), 0, C)


def wy_solve(k, beta, g, *, chunk_size: int, chunks, num_warps: int = 4):
    """Launch `wy_kernel`. k: [N_tok, H, K]; beta, g: [N_tok, H] (g may be None); chunks: the
    chunk table (ops/triton/plan.py). Returns `(t_inv [N_tok, H, C] fp32, firsts [num_chunks, H]
    int32)`: each chunk's first row with a non-finite key, beta or log-decay (C when none)."""
    N_tok, H, K = k.shape
    table, _, NC = chunks
    if chunk_size != 64:
        raise ValueError(f"expected chunk_size 64 for the delta rule kernels (blocks of 16 and 32), got {chunk_size}")
    t_inv = torch.empty(N_tok, H, chunk_size, dtype=torch.float32, device=k.device)
    firsts = torch.empty(NC, H, dtype=torch.int32, device=k.device)
    wy_kernel[(NC, H)](
        k, beta, g, t_inv, firsts, table, H, K,
        C=chunk_size, BK=block(K), USE_G=g is not None, F32=dot_f32(k.dtype), num_warps=num_warps,
    )
    return t_inv, firsts


@triton.jit
def factor_tiles(
    x, b_left, out, out_lo, t, m_t, H, i_h, D, first, C: tl.constexpr, BD: tl.constexpr, F32: tl.constexpr,
    CUT: tl.constexpr, CHECK: tl.constexpr,
):
    """`out = b_left @ x` over the rows `t` of one chunk, in [C, BD] column tiles of the D columns
    (`b_left` fp32 [C, C], `x` in the input dtype; `out` fp32, or of the input dtype and then the result's two
    halves in `out` and `out_lo`: `precision.split_halves`). CUT: x's rows from chunk row `first` on enter as zeros,
    and with CHECK from a tile's first non-finite row on too. Returns the first row so cut (`first` without
    CHECK)."""
    for i_d in range(0, tl.cdiv(D, BD)):
        o_d = i_d * BD + tl.arange(0, BD)
        rows = (t * H + i_h)[:, None] * D + o_d[None, :]  # [C, BD]
        m = m_t[:, None] & (o_d < D)[None, :]
        b_x = tl.load(x + rows, mask=m, other=0.0)  # [C, BD]
        if CUT:
            if CHECK:
                first = tl.minimum(first, first_nonfinite_row(b_x))
            b_x = zero_rows_from(b_x, first)  # [C, BD]
        b_out = mma_left_fp32(b_left, b_x, F32)  # [C, C] @ [C, BD] -> [C, BD]
        if out.dtype.element_ty != tl.float32:
            b_hi, b_lo = split_halves(b_out, out.dtype.element_ty, F32)
            tl.store(out + rows, b_hi, mask=m)
            tl.store(out_lo + rows, b_lo, mask=m)
        else:
            tl.store(out + rows, b_out, mask=m)
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
    factor_tiles(k, b_tb * tl.where(keep, tl.exp2(b_gc), 0.0)[None, :], w, w, t, m_t, H, i_h, K, first, C, BD, F32, True, False)
    first = factor_tiles(v, b_tb, u_bar, u_bar, t, m_t, H, i_h, V, first, C, BD, F32, True, True)
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
