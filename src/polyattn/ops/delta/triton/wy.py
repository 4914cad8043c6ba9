"""Stage 1 of the delta rule: the per-chunk UT solve, every chunk in parallel.

`wy_kernel` implements, for one chunk of C tokens of one head (ops/delta/README.md, "Chunk form"),

    A    = strict_lower(diag(beta) (K K^T ⊙ Γ))       Γ[i, j] = exp(gc_i - gc_j)
    Tinv = (I + A)^{-1}                                 unit lower triangular, fp32

and stores row i of `Tinv` at token i: `t_inv: [N_tok, H, C]` fp32. The chunk's pseudo-values
then follow from the entering state h as `U = Tinv diag(beta) (V - diag(exp(gc)) K h)`, which
the sequential stage (forward.py) applies. `wy_ref` is the PyTorch twin.
"""
import torch
import triton
import triton.language as tl

from polyattn.ops.triton.decay import chunk_decay, chunk_segsum
from polyattn.ops.triton.plan import block
from polyattn.ops.triton.precision import dot_f32, mma


@triton.jit
def solve_unit_lower(b_a):
    """`(I + A)^{-1}` of a strictly lower `A: [C, C]` (fp32) by forward substitution:
    row i of the inverse is `e_i - A[i, :] @ Tinv`, rows above i being final."""
    C: tl.constexpr = b_a.shape[0]
    o = tl.arange(0, C)
    b_t = tl.where(o[:, None] == o[None, :], 1.0, 0.0)  # [C, C] identity
    for i in range(1, C):
        a_i = tl.sum(tl.where(o[:, None] == i, b_a, 0.0), axis=0)  # [C, C] -> [C]: row i of A
        row = tl.sum(a_i[:, None] * b_t, axis=0)  # [C, 1] * [C, C] -> [C]: sum_j A[i, j] Tinv[j, :]
        b_t = tl.where(o[:, None] == i, b_t - row[None, :], b_t)  # row i was e_i
    return b_t


@triton.jit
def wy_kernel(
    k, beta, g, t_inv, chunks, H, K,
    C: tl.constexpr, BK: tl.constexpr, USE_G: tl.constexpr, F32: tl.constexpr,
):
    """grid: (num_chunks, H); one program per chunk and head. `K K^T` accumulates over key
    tiles of BK, then the decay, beta and the strict mask are applied in fp32 and the [C, C]
    system is solved in registers."""
    i_ch, i_h = tl.program_id(0), tl.program_id(1)
    bos = tl.load(chunks + i_ch * 4).to(tl.int64)
    eos = tl.load(chunks + i_ch * 4 + 1).to(tl.int64)
    o_t = tl.arange(0, C)
    t = bos + o_t
    m_t = t < eos
    b_kk = tl.zeros([C, C], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        p_k = k + (t * H + i_h)[:, None] * K + o_k[None, :]
        b_k = tl.load(p_k, mask=m_t[:, None] & (o_k < K)[None, :], other=0.0)  # [C, BK]
        b_kk += mma(b_k, tl.trans(b_k), F32)  # [C, BK] @ [BK, C] -> [C, C]
    b_beta = tl.load(beta + t * H + i_h, mask=m_t, other=0.0).to(tl.float32)  # [C]
    b_g, b_gc, _ = chunk_decay(g, t, m_t, H, i_h, USE_G)  # [C], [C]
    b_d = chunk_segsum(b_g, b_gc, False, F32)  # [C, C]
    strict = o_t[:, None] > o_t[None, :]
    b_a = tl.where(strict, b_kk * tl.exp2(b_d) * b_beta[:, None], 0.0)  # [C, C]
    b_inv = solve_unit_lower(b_a)  # [C, C]
    tl.store(t_inv + (t * H + i_h)[:, None] * C + o_t[None, :], b_inv, mask=m_t[:, None])


def wy_solve(k, beta, g, seq_lens: tuple, *, chunk_size: int, chunks, num_warps: int = 4):
    """Launch `wy_kernel`. k: [N_tok, H, K]; beta, g: [N_tok, H] (g may be None); chunks: the
    chunk table (ops/triton/plan.py). Returns `t_inv: [N_tok, H, C]` fp32."""
    N_tok, H, K = k.shape
    table, _, NC = chunks
    t_inv = torch.empty(N_tok, H, chunk_size, dtype=torch.float32, device=k.device)
    wy_kernel[(NC, H)](
        k, beta, g, t_inv, table, H, K,
        C=chunk_size, BK=min(block(K), 64), USE_G=g is not None, F32=dot_f32(k.dtype), num_warps=num_warps,
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
