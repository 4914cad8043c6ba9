"""Stage 1 of the delta rule: the per-chunk UT solve, every chunk in parallel.

`wy_kernel` implements, for one chunk of C = 64 tokens of one head (ops/delta/README.md, "Chunk form"),

    A    = strict_lower(diag(beta) (K K^T ⊙ Γ))       Γ[i, j] = exp(gc_i - gc_j)
    Tinv = (I + A)^{-1}                                 unit lower triangular, fp32

and stores row i of `Tinv` at token i: `t_inv: [N_tok, H, C]` fp32. The chunk's pseudo-values
then follow from the entering state h as `U = Tinv diag(beta) (V - diag(exp(gc)) K h)`, which
the sequential stage (forward.py) applies. `wy_ref` is the PyTorch twin.
"""
import torch
import triton
import triton.language as tl

from polyattn.ops.triton.plan import block
from polyattn.ops.triton.precision import LOG2E, dot_f32, mma


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
def block_rows(k, beta, g, bos, eos, i_b, H, i_h, K, offset, BT: tl.constexpr, BK: tl.constexpr, USE_G: tl.constexpr):
    """Rows `[i_b * BT, (i_b + 1) * BT)` of the chunk: keys [BT, BK], beta [BT], the log2-decay
    cumsum [BT] continued from `offset` (the chunk's sum before the block) and the new offset."""
    t = bos + i_b * BT + tl.arange(0, BT)
    m_t = t < eos
    o_k = tl.arange(0, BK)
    b_k = tl.load(k + (t * H + i_h)[:, None] * K + o_k[None, :], mask=m_t[:, None] & (o_k < K)[None, :], other=0.0)
    b_beta = tl.load(beta + t * H + i_h, mask=m_t, other=0.0).to(tl.float32)  # [BT]
    if USE_G:
        b_g = tl.load(g + t * H + i_h, mask=m_t, other=0.0).to(tl.float32)  # [BT]
        b_gc = offset + tl.cumsum(b_g, axis=0) * LOG2E  # [BT]
        return b_k, b_beta, b_gc, offset + tl.sum(b_g, axis=0) * LOG2E
    return b_k, b_beta, tl.zeros([BT], dtype=tl.float32) + offset, offset


@triton.jit
def gram_block(b_ki, b_beta_i, b_gc_i, b_kj, b_gc_j, STRICT: tl.constexpr, F32: tl.constexpr):
    """The [BT, BT] block `diag(beta_i) (K_i K_j^T ⊙ exp2(gc_i - gc_j))` of A (strictly lower
    on a diagonal block)."""
    b_a = mma(b_ki, tl.trans(b_kj), F32) * b_beta_i[:, None]  # [BT, BK] @ [BK, BT] -> [BT, BT]
    o = tl.arange(0, b_a.shape[0])
    if STRICT:
        keep = o[:, None] > o[None, :]
        return tl.where(keep, b_a * tl.exp2(tl.where(keep, b_gc_i[:, None] - b_gc_j[None, :], 0.0)), 0.0)
    return b_a * tl.exp2(b_gc_i[:, None] - b_gc_j[None, :])


@triton.jit
def store_block(t_inv, bos, eos, i_b, j_b, b_x, H, i_h, C: tl.constexpr, BT: tl.constexpr):
    t = bos + i_b * BT + tl.arange(0, BT)
    cols = j_b * BT + tl.arange(0, BT)
    tl.store(t_inv + (t * H + i_h)[:, None] * C + cols[None, :], b_x, mask=(t < eos)[:, None])


@triton.jit
def wy_kernel(
    k, beta, g, t_inv, chunks, H, K,
    C: tl.constexpr, BK: tl.constexpr, USE_G: tl.constexpr, F32: tl.constexpr,
):
    """grid: (num_chunks, H); one program per chunk and head, C = 64 as four row blocks of
    BT = 16. Blocks of A come from `[BT, BK] @ [BK, BT]` products; the diagonal blocks of
    `I + A` are inverted by `invert_unit_lower` and the blocks below by
    `Tinv_ij = -Tinv_ii sum_{m=j}^{i-1} A_im Tinv_mj` (fp32 products); blocks above are 0."""
    BT: tl.constexpr = 16
    i_ch, i_h = tl.program_id(0), tl.program_id(1)
    bos = tl.load(chunks + i_ch * 4).to(tl.int64)
    eos = tl.load(chunks + i_ch * 4 + 1).to(tl.int64)
    zero = tl.sum(tl.zeros([BT], dtype=tl.float32), axis=0)
    k0, b0, gc0, off = block_rows(k, beta, g, bos, eos, 0, H, i_h, K, zero, BT, BK, USE_G)
    k1, b1, gc1, off = block_rows(k, beta, g, bos, eos, 1, H, i_h, K, off, BT, BK, USE_G)
    k2, b2, gc2, off = block_rows(k, beta, g, bos, eos, 2, H, i_h, K, off, BT, BK, USE_G)
    k3, b3, gc3, off = block_rows(k, beta, g, bos, eos, 3, H, i_h, K, off, BT, BK, USE_G)
    t00 = invert_unit_lower(gram_block(k0, b0, gc0, k0, gc0, True, F32))  # [BT, BT] each
    t11 = invert_unit_lower(gram_block(k1, b1, gc1, k1, gc1, True, F32))
    t22 = invert_unit_lower(gram_block(k2, b2, gc2, k2, gc2, True, F32))
    t33 = invert_unit_lower(gram_block(k3, b3, gc3, k3, gc3, True, F32))
    a10 = gram_block(k1, b1, gc1, k0, gc0, False, F32)
    a20 = gram_block(k2, b2, gc2, k0, gc0, False, F32)
    a21 = gram_block(k2, b2, gc2, k1, gc1, False, F32)
    a30 = gram_block(k3, b3, gc3, k0, gc0, False, F32)
    a31 = gram_block(k3, b3, gc3, k1, gc1, False, F32)
    a32 = gram_block(k3, b3, gc3, k2, gc2, False, F32)
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


def wy_solve(k, beta, g, seq_lens: tuple, *, chunk_size: int, chunks, num_warps: int = 4):
    """Launch `wy_kernel`. k: [N_tok, H, K]; beta, g: [N_tok, H] (g may be None); chunks: the
    chunk table (ops/triton/plan.py). Returns `t_inv: [N_tok, H, C]` fp32."""
    N_tok, H, K = k.shape
    table, _, NC = chunks
    if chunk_size != 64:
        raise ValueError(f"expected chunk_size 64 for the delta rule kernels (four blocks of 16), got {chunk_size}")
    t_inv = torch.empty(N_tok, H, chunk_size, dtype=torch.float32, device=k.device)
    wy_kernel[(NC, H)](
        k, beta, g, t_inv, table, H, K,
        C=chunk_size, BK=block(K), USE_G=g is not None, F32=dot_f32(k.dtype), num_warps=num_warps,
    )
    return t_inv


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
