"""DeltaKATA's chunk-local algebra (delta.py's module docstring): from a chunk's keys, queries, β and log-decays
alone, the `[C, C]` UT inverse M and in-chunk scores A, and the rows α, ω, ρ and λ the walk weights by:

    L = I + diag(β) tril(κ̂(K, K) ⊙ D, −1),   M = L⁻¹,   A = tril(κ(scale·Q, K) ⊙ D ⊘ n)
    α = −β e^γ / n,   ω = D[C, ·] / n,   ρ = scale² e^γ,   λ = e^Γ

with γ the in-chunk cumsum of the log-decays, `D_ts = exp(γ_t − γ_s)` (s ≤ t, each a direct sum of the log-decays
in between), n the lifted keys' norms `√max(κ(k, k), ε²)` and `κ̂ = κ(K, K) ⊘ (n nᵀ)`.

`deltakata_algebra_kernel` runs one program per chunk and head: the two kernel matrices as products of the groups
in row blocks (TF32x3, about fp32's precision), L written into M's buffer, then
the unit lower-triangular inverse in place by blocks of BS = 16 rows: each diagonal block inverted by forward
substitution in registers, and block (i, j) below it as

    M_ij = −M_ii Σ_{j ≤ k < i} L_ik M_kj

block row by block row, j ascending (block (i, j) of L is read for the last time by M_ij itself), with a barrier
between rows. A non-finite token p (in k, β or g) makes L's row p and the rows after it non-finite; the sums
above enter M_ii's product with their non-finite entries as zeros, so that `0 · NaN` never reaches a row before
p (which the walk reads bit for bit as without the token), while rows from p on, which the walk treats as
non-finite anyway, come out finite but meaningless. `deltakata_algebra_grad_kernel` is the backward, formed a row
block at a time. `chunk_algebra_ref` and `chunk_algebra_backward_ref` are the PyTorch twins (a triangular solve, the
backward written out); `chunk_algebra` and `chunk_algebra_backward` the custom ops, which run the twins unless
`KernelConfig.deltakata_algebra_kernels` is on (off by default: the kernels are not yet faster, ops/kata/README.md,
"The chunk-local algebra as kernels"). Products of the kernels are TF32x3 (`fdot`).
"""
import torch
import triton
import triton.language as tl

from polyattn.ops.common import exp_segsum
from polyattn.ops.kata.feature_maps import make_feature_map
from polyattn.ops.triton.decay import exact_suffix
from polyattn.ops.triton.plan import block, get_config
from polyattn.ops.triton.precision import mma

SOLVE_BLOCK = 16  # rows of the blocked inverse's diagonal blocks
ALGEBRA_ROWS = 32  # rows of the `[R, C]` blocks in which both kernels form the chunk's matrices


@triton.jit
def fdot(x, y):
    """An fp32 product to about fp32 precision on the tensor cores (three TF32 products, `tf32x3`): an IEEE product
    of these sizes runs on the CUDA cores with whole operand rows in registers (ptxas for sm_90a: 7.9 KB of spills
    a thread in the forward kernel, none with this)."""
    return tl.dot(x, y, input_precision="tf32x3")


@triton.jit
def group_tile(x, p, r0, i, K, E, C: tl.constexpr, R: tl.constexpr, BE: tl.constexpr):
    """Rows r0 .. r0 + R of group i of chunk-head p of a chunked `[NC, H, C, K]` fp32 tensor: `[R, BE]`, 0 past E."""
    o_e = tl.arange(0, BE)
    rows = (p * C + r0 + tl.arange(0, R)).to(tl.int64)
    return tl.load(x + rows[:, None] * K + i * E + o_e[None, :], mask=(o_e < E)[None, :], other=0.0)


@triton.jit
def kernel_matrix(x, y, p, r0, K, E, scale, C: tl.constexpr, R: tl.constexpr, BE: tl.constexpr, G: tl.constexpr,
                  SUM: tl.constexpr):
    """κ(scale·X, Y) of rows r0 .. r0 + R of X against all C rows of Y, one chunk, as an fp32 `[R, C]` tile:
    Σ_i (X_i Y_iᵀ)² (Mg) or Σ_{i,j} (X_i Y_jᵀ)² (Σg) over the G groups of width E, one group product at a time."""
    acc = tl.zeros([R, C], dtype=tl.float32)
    for i in tl.static_range(G):
        b_x = scale * group_tile(x, p, r0, i, K, E, C, R, BE)
        for j in tl.static_range(G if SUM else 1):
            u = fdot(b_x, tl.trans(group_tile(y, p, 0, j if SUM else i, K, E, C, C, BE)))
            acc += u * u
    return acc


@triton.jit
def kernel_diagonal(x, p, K, E, C: tl.constexpr, BE: tl.constexpr, G: tl.constexpr, SUM: tl.constexpr):
    """κ(x_t, x_t) of a chunk's rows, `[C]`, from the groups' row dots."""
    acc = tl.zeros([C], dtype=tl.float32)
    for i in tl.static_range(G):
        b_i = group_tile(x, p, 0, i, K, E, C, C, BE)
        for j in tl.static_range(G if SUM else 1):
            d = tl.sum(b_i * group_tile(x, p, 0, j if SUM else i, K, E, C, C, BE), axis=1)
            acc += d * d
    return acc


@triton.jit
def chunk_vectors(kc, gc, p, K, E, eps, C: tl.constexpr, BE: tl.constexpr, G: tl.constexpr, SUM: tl.constexpr):
    """The chunk's per-token vectors both kernels start from, `[C]` each: `(g, e^γ, κ(k_t, k_t), n, D[C, ·])`."""
    t = tl.arange(0, C)
    b_g = tl.load(gc + p * C + t)
    b_sq = kernel_diagonal(kc, p, K, E, C, BE, G, SUM)
    b_last = tl.exp2(exact_suffix(b_g))  # D[C, s] = exp(Σ_{u > s} g_u)
    return b_g, tl.exp(tl.cumsum(b_g, axis=0)), b_sq, tl.sqrt(tl.maximum(b_sq, eps * eps)), b_last


@triton.jit
def scatter_rows(v, r, t):
    """A row block's `[R]` vector `v` (rows `r`) as a chunk's `[C]` vector (rows `t`), 0 elsewhere."""
    return tl.sum(tl.where(r[:, None] == t[None, :], v[:, None], 0.0), axis=0)


@triton.jit
def unit_lower_inverse(b_l, BS: tl.constexpr):
    """The inverse of `I + b_l` for a strictly lower `[BS, BS]` tile, row by row (forward substitution):
    row r is `e_r − Σ_{j<r} L_rj M_j`; a row reads only the rows before it, and the upper triangle is exact zeros
    (a non-finite row would fill its own with NaN)."""
    o_b = tl.arange(0, BS)
    b_m = (o_b[:, None] == o_b[None, :]).to(tl.float32)
    for r in range(1, BS):
        l_r = tl.sum(tl.where(o_b[:, None] == r, b_l, 0.0), axis=0)  # [BS]: row r of L
        row = tl.where(o_b == r, 1.0, 0.0) - tl.sum(l_r[:, None] * b_m, axis=0)  # [BS]
        b_m = tl.where(o_b[:, None] == r, row[None, :], b_m)
    return tl.where(o_b[:, None] >= o_b[None, :], b_m, 0.0)


@triton.jit
def row_values(v, r, t):
    """The entries of a chunk's `[C]` vector `v` (rows `t`) at a row block's rows `r`: `[R]`."""
    return tl.sum(tl.where(r[:, None] == t[None, :], v[None, :], 0.0), axis=1)


@triton.jit
def decay_rows(gc, p, r, t, base, C: tl.constexpr):
    """Rows r of the chunk's decays D: `exp(Σ_{s<u≤r} g_u)` for s ≤ r, each a direct sum (the block's masked cumsum
    on `base`, the sums `Σ_{s<u<r0} g_u` over the blocks above); `(D rows [R, C], base for the next block)`."""
    inc = tl.where(r[:, None] > t[None, :], tl.load(gc + p * C + r)[:, None], 0.0)  # [R, C]: g_u for u > s
    b_d = tl.where(r[:, None] >= t[None, :], tl.exp(base[None, :] + tl.cumsum(inc, axis=0)), 0.0)
    return b_d, base + tl.sum(inc, axis=0)


@triton.jit
def deltakata_algebra_kernel(
    kc, qc, bc, gc, m, a, alpha, omega, rho, lam, K, E, scale, eps,
    C: tl.constexpr, R: tl.constexpr, BE: tl.constexpr, G: tl.constexpr, SUM: tl.constexpr, BS: tl.constexpr,
):
    """grid: (NC·H,). Chunk-head p of chunked fp32 `kc, qc [NC, H, C, K]`, `bc, gc [NC, H, C]` (padded rows zero):
    `m, a [NC, H, C, C]` (M, A), `alpha, omega, rho [NC, H, C]`, `lam [NC, H]` as the module docstring says; L and
    A formed in row blocks of R, then the inverse in place."""
    p = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, C)
    b_g, b_e, _, b_n, b_last = chunk_vectors(kc, gc, p, K, E, eps, C, BE, G, SUM)  # [C]
    tl.store(alpha + p * C + t, -tl.load(bc + p * C + t) * b_e / b_n)
    tl.store(omega + p * C + t, b_last / b_n)
    tl.store(rho + p * C + t, scale * scale * b_e)
    tl.store(lam + p, tl.exp(tl.sum(b_g, axis=0)))
    base = tl.zeros([C], dtype=tl.float32)
    for i in tl.static_range(C // R):
        r = i * R + tl.arange(0, R)
        b_d, base = decay_rows(gc, p, r, t, base, C)
        b_l = kernel_matrix(kc, kc, p, i * R, K, E, 1.0, C, R, BE, G, SUM) / row_values(b_n, r, t)[:, None] / b_n[None, :] * b_d
        out = p * C * C + r[:, None] * C + t[None, :]
        tl.store(m + out, tl.where(r[:, None] > t[None, :], b_l * tl.load(bc + p * C + r)[:, None], 0.0))  # L − I
        b_s = kernel_matrix(qc, kc, p, i * R, K, E, scale, C, R, BE, G, SUM)  # κ(scale·Q, K) rows
        tl.store(a + out, tl.where(r[:, None] >= t[None, :], b_s * b_d / b_n[None, :], 0.0))
    tl.debug_barrier()  # the solve reads what every thread wrote
    o_b = tl.arange(0, BS)
    blk = m + p * C * C + o_b[:, None] * C + o_b[None, :]  # block (0, 0); block (i, j) at + (i·C + j)·BS
    for i in tl.static_range(C // BS):
        b_mii = unit_lower_inverse(tl.load(blk + i * BS * (C + 1)), BS)
        for j in range(0, i):
            acc = tl.zeros([BS, BS], dtype=tl.float32)
            for k in range(j, i):
                acc += mma(tl.load(blk + (i * C + k) * BS), tl.load(blk + (k * C + j) * BS), True)  # L_ik M_kj
            acc = tl.where(acc - acc == 0, acc, 0.0)  # a later non-finite row must not reach earlier ones as 0 · NaN
            tl.store(blk + (i * C + j) * BS, -mma(b_mii, acc, True))
        tl.store(blk + i * BS * (C + 1), b_mii)
        tl.debug_barrier()  # the next block row reads this one


@triton.jit
def group_vjp(x, y, w, p, r0, K, E, acc, into, scale, C: tl.constexpr, R: tl.constexpr, BE: tl.constexpr, G: tl.constexpr,
              SUM: tl.constexpr):
    """The gradient of `Σ w ⊙ κ(scale·X, Y)` (`w [R, C]`, X rows r0 .. r0 + R, Y all C rows, the factor 2 of the
    square in w): the group dot products u enter as `w ⊙ u`. Y's part is added to `acc [G, C, BE]` (group-major
    columns) and returned; X's part (times scale) is stored to the block's rows of `into` (`[NC, H, C, K]`)."""
    o_g = tl.arange(0, G)
    o_e = tl.arange(0, BE)
    rows = (p * C + r0 + tl.arange(0, R)).to(tl.int64)
    for i in tl.static_range(G):
        b_x = scale * group_tile(x, p, r0, i, K, E, C, R, BE)
        b_dx = tl.zeros([R, BE], dtype=tl.float32)
        for j in tl.static_range(G if SUM else 1):
            jj = j if SUM else i
            b_y = group_tile(y, p, 0, jj, K, E, C, C, BE)
            b_w = w * fdot(b_x, tl.trans(b_y))  # [R, C]
            b_dx += fdot(b_w, b_y)  # [R, BE]
            acc += tl.where(o_g[:, None, None] == jj, fdot(tl.trans(b_w), b_x)[None, :, :], 0.0)  # [C, BE] into group jj
        tl.store(into + rows[:, None] * K + i * E + o_e[None, :], scale * b_dx, mask=(o_e < E)[None, :])
    return acc


@triton.jit
def deltakata_algebra_grad_kernel(
    dm, da, dalpha, domega, drho, dlam, kc, qc, bc, gc, m, dk, dq, dbeta, dg, K, E, scale, eps,
    C: tl.constexpr, R: tl.constexpr, BE: tl.constexpr, G: tl.constexpr, SUM: tl.constexpr,
):
    """grid: (NC·H,). `chunk_algebra_backward` for chunk-head p: `dk, dq [NC, H, C, K]`, `dbeta, dg [NC, H, C]` (fp32)
    from the cotangents `dm, da [NC, H, C, C]`, `dalpha, domega, drho [NC, H, C]`, `dlam [NC, H]`, the inputs and M,
    in row blocks of R: each block's `[R, C]` rows of dL, D, κ̂ and the scores, its row sums kept, its column sums
    summed over the blocks (the formulas: `chunk_algebra`'s docstring)."""
    p = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, C)
    _, b_e, b_sq, b_n, b_last = chunk_vectors(kc, gc, p, K, E, eps, C, BE, G, SUM)  # [C]
    b_dal = tl.load(dalpha + p * C + t)
    b_dom = tl.load(domega + p * C + t)
    b_alpha = -tl.load(bc + p * C + t) * b_e / b_n
    d_beta = -b_dal * b_e / b_n
    d_gam = b_dal * b_alpha + tl.load(drho + p * C + t) * (scale * scale) * b_e + tl.where(t == C - 1, tl.load(dlam + p) * b_e, 0.0)
    d_n = -(b_dal * b_alpha + b_dom * b_last / b_n) / b_n
    base = tl.zeros([C], dtype=tl.float32)  # Σ_{s < u < r0} g_u: the decays' sums over the blocks above
    acc = tl.zeros([G, C, BE], dtype=tl.float32)  # dk, group-major
    p_mt = m + p * C * C + t[None, :] * C + t[:, None]  # Mᵀ
    for i in tl.static_range(C // R):
        r = i * R + tl.arange(0, R)
        b_d, base = decay_rows(gc, p, r, t, base, C)  # [R, C]: D rows
        b_nr = row_values(b_n, r, t)  # [R]: n of the rows
        b_br = tl.load(bc + p * C + r)
        # the solve: dL = −tril(Mᵀ dM Mᵀ, −1), L_ts = β_t κ̂_ts D_ts
        b_x = fdot(tl.load(m + p * C * C + t[None, :] * C + r[:, None]), tl.load(dm + p * C * C + t[:, None] * C + t[None, :]))
        b_dl = tl.where(r[:, None] > t[None, :], -fdot(b_x, tl.load(p_mt)), 0.0)  # [R, C]
        b_kh = kernel_matrix(kc, kc, p, i * R, K, E, 1.0, C, R, BE, G, SUM) / b_nr[:, None] / b_n[None, :]  # κ̂ rows
        b_ed = b_dl * b_kh * b_d  # dL ⊙ κ̂ ⊙ D
        d_beta += scatter_rows(tl.sum(b_ed, axis=1), r, t)
        b_ed *= b_br[:, None]  # E: dD ⊙ D
        b_dkh = b_dl * b_d * b_br[:, None]  # dκ̂
        b_ed += tl.where(r[:, None] == C - 1, (b_dom / b_n * b_last)[None, :], 0.0)  # ω = D[C, ·] / n
        # the scores, A = tril(κ(sQ, K) ⊙ D ⊘ n)
        b_ds = tl.where(r[:, None] >= t[None, :], tl.load(da + p * C * C + r[:, None] * C + t[None, :]), 0.0) / b_n[None, :]
        b_sa = kernel_matrix(qc, kc, p, i * R, K, E, scale, C, R, BE, G, SUM) * b_ds * b_d  # tril(dA) ⊙ A
        d_n -= tl.sum(b_sa, axis=0) / b_n
        b_ed += b_sa
        b_ds *= b_d  # dκ(sQ, K)
        # the normalised Gram, κ̂ = κ(K, K) ⊘ (n nᵀ)
        b_kk = b_kh * b_dkh
        d_n -= (scatter_rows(tl.sum(b_kk, axis=1), r, t) + tl.sum(b_kk, axis=0)) / b_n
        b_dkh = b_dkh / b_nr[:, None] / b_n[None, :]  # dκ(K, K)
        d_gam += scatter_rows(tl.sum(b_ed, axis=1), r, t) - tl.sum(b_ed, axis=0)
        acc = group_vjp(qc, kc, 2.0 * b_ds, p, i * R, K, E, acc, dq, scale, C, R, BE, G, SUM)
        acc = group_vjp(kc, kc, 2.0 * b_dkh, p, i * R, K, E, acc, dk, 1.0, C, R, BE, G, SUM)  # dk's rows: their first write
    tl.store(dbeta + p * C + t, d_beta)
    tl.store(dg + p * C + t, tl.cumsum(d_gam, axis=0, reverse=True))
    # the norms, n = √max(κ(k, k), ε²): ∂κ(k, k)/∂k_i = 4 Σ_j (k_i·k_j) k_j over the groups j paired with i
    b_s = tl.where(b_sq >= eps * eps, d_n / (2 * b_n), 0.0)
    o_g = tl.arange(0, G)
    for i in tl.static_range(G):
        b_i = group_tile(kc, p, 0, i, K, E, C, C, BE)
        for j in tl.static_range(G if SUM else 1):
            b_j = group_tile(kc, p, 0, j if SUM else i, K, E, C, C, BE)
            acc += tl.where(o_g[:, None, None] == i, (4.0 * b_s * tl.sum(b_i * b_j, axis=1))[None, :, None] * b_j[None, :, :], 0.0)
    o_e = tl.arange(0, BE)
    cols = (p * C + t)[None, :, None] * K + (o_g * E)[:, None, None] + o_e[None, None, :]  # [G, C, BE]
    tl.debug_barrier()  # the rows' parts, stored by other threads
    tl.store(dk + cols, tl.load(dk + cols, mask=(o_e < E)[None, None, :], other=0.0) + acc, mask=(o_e < E)[None, None, :])


def _algebra_terms(kc, qc, gc, fmap, scale: float, eps: float) -> dict:
    """The chunk-local algebra's shared terms from chunked keys, queries `[NC, H, C, K]` and log-decays
    `[NC, H, C]` (no graph): the lifted keys' squared norms κ(k, k) and norms n, D, the normalised Gram κ̂(K, K),
    e^γ and the scores before their decay, κ(scale·Q, K)."""
    square = fmap.kernel(kc[..., None, :], kc[..., None, :])[..., 0, 0]  # κ(k_t, k_t): [NC, H, C]
    norm = square.clamp_min(eps**2).sqrt()  # n_t
    return dict(square=square, norm=norm, D=exp_segsum(gc), exp=torch.exp(torch.cumsum(gc, -1)), scores=fmap.kernel(scale * qc, kc),
                gram=fmap.kernel(kc, kc).div_(norm[..., :, None]).div_(norm[..., None, :]))


def chunk_algebra_ref(kc, qc, bc, gc, groups: int, combine: str, scale: float, eps: float) -> tuple:
    """Twin of `deltakata_algebra_kernel` (any float dtype, any C): `(M, A [NC, H, C, C], α, ω, ρ [NC, H, C],
    λ [NC, H])`, M by a triangular solve."""
    fmap = make_feature_map("psd", kc.shape[-1], groups, combine)
    t = _algebra_terms(kc, qc, gc, fmap, scale, eps)
    norm, D, e = t["norm"], t["D"], t["exp"]
    eye = torch.eye(kc.shape[-2], dtype=kc.dtype, device=kc.device)
    lower = t.pop("gram").mul_(D).tril_(diagonal=-1).mul_(bc[..., :, None]).add_(eye)  # in place: the buffers are large
    M = torch.linalg.solve_triangular(lower, eye.expand_as(lower), upper=False, unitriangular=True).contiguous()
    del lower
    A = t.pop("scores").mul_(D).div_(norm[..., None, :]).tril_()  # exact zeros above the diagonal, even beside a NaN
    return M, A, -bc * e / norm, D[..., -1, :] / norm, (scale * scale) * e, e[..., -1].contiguous()


def runs_kernels(kc: torch.Tensor) -> bool:
    """Whether `chunk_algebra` and its backward run the kernels on chunked `kc [NC, H, C, K]`: fp32 chunks of a power
    of two from SOLVE_BLOCK tokens with `KernelConfig.deltakata_algebra_kernels` on (else the twins)."""
    C = kc.shape[-2]
    return kc.dtype == torch.float32 and C >= SOLVE_BLOCK and C & (C - 1) == 0 and get_config().deltakata_algebra_kernels


@torch.library.custom_op("polyattn::deltakata_algebra", mutates_args=())
def chunk_algebra(
    kc: torch.Tensor, qc: torch.Tensor, bc: torch.Tensor, gc: torch.Tensor, groups: int, combine: str, scale: float, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The `[C, C]` part of the chunk-local algebra (module docstring) as a custom op, from chunked
    `kc, qc [NC, H, C, K]`, β and the log-decays `[NC, H, C]`: `(M, A [NC, H, C, C], α, ω, ρ [NC, H, C], λ [NC, H])`.
    With `KernelConfig.deltakata_algebra_kernels` (off by default), fp32 inputs with C a power of two from 16 on (the
    walk's) run `deltakata_algebra_kernel`; all others (float64: the finite-difference test of the backward) the twin. Its backward (`chunk_algebra_backward`, another custom op) is
    written out, so that only the inputs and M are kept from the forward and no `[C, C]` intermediate of autograd's:

        dL = −Mᵀ dM Mᵀ (strictly lower; L = I + diag(β) tril(κ̂ ⊙ D, −1))
        dβ_t += Σ_s dL_ts κ̂_ts D_ts,   dκ̂ = diag(β) dL ⊙ D,   dD += diag(β) dL ⊙ κ̂
        dκ(sQ, K) = tril(dA) ⊙ D ⊘ n,   dD += tril(dA) ⊙ κ(sQ, K) ⊘ n,   dn_s −= Σ_t dA_ts A_ts / n_s
        dκ(K, K) = dκ̂ ⊘ (n nᵀ),   dn_t −= Σ_s dκ̂_ts κ̂_ts / n_t + Σ_s dκ̂_st κ̂_st / n_t
        dγ_t += Σ_s dD_ts D_ts − Σ_s dD_st D_st,   dg = reverse cumsum of dγ

    with the rows' α = −β e^γ / n, ω = D[C, ·] / n, ρ = scale² e^γ, λ = e^Γ differentiated directly, and the keys'
    and queries' gradients from the feature map's `kernel_vjp`."""
    NC, H, C, K = kc.shape
    if not runs_kernels(kc):
        return chunk_algebra_ref(kc, qc, bc, gc, groups, combine, scale, eps)
    kc, qc, bc, gc = (x.contiguous() for x in (kc, qc, bc, gc))
    M, A = (kc.new_empty(NC, H, C, C) for _ in range(2))
    alpha, omega, rho = (torch.empty_like(bc) for _ in range(3))
    lam = bc.new_empty(NC, H)
    if NC * H:
        deltakata_algebra_kernel[(NC * H,)](
            kc, qc, bc, gc, M, A, alpha, omega, rho, lam, K, K // groups, scale, eps, C=C, R=min(C, ALGEBRA_ROWS),
            BE=block(K // groups), G=groups, SUM=combine == "sum", BS=SOLVE_BLOCK, num_warps=8,
        )
    return M, A, alpha, omega, rho, lam


@chunk_algebra.register_fake
def _(kc, qc, bc, gc, groups, combine, scale, eps):
    NC, H, C, _ = kc.shape
    return (kc.new_empty(NC, H, C, C), kc.new_empty(NC, H, C, C), bc.new_empty(bc.shape), bc.new_empty(bc.shape),
            bc.new_empty(bc.shape), bc.new_empty(NC, H))


def chunk_algebra_backward_ref(dM, dA, dalpha, domega, drho, dlam, kc, qc, bc, gc, M, groups: int, combine: str, scale: float,
                               eps: float) -> tuple:
    """Twin of `deltakata_algebra_grad_kernel` (any float dtype, any C): `(dk, dq, dβ, dg)` from every output's
    cotangent, the inputs and M; the terms are recomputed and the `[C, C]` buffers reused in place."""
    fmap = make_feature_map("psd", kc.shape[-1], groups, combine)
    t = _algebra_terms(kc, qc, gc, fmap, scale, eps)
    square, norm, D, gram, scores, e = t["square"], t["norm"], t["D"], t["gram"], t["scores"], t["exp"]
    alpha = -bc * e / norm
    dbeta = -dalpha * e / norm
    dgam = dalpha * alpha + drho * (scale * scale) * e
    dgam[..., -1] += dlam * e[..., -1]
    dn = -(dalpha * alpha + domega * D[..., -1, :] / norm) / norm
    # Every product below is taken in place in a [C, C] buffer and summed along its rows or columns (an einsum's
    # column sums would transpose both operands into copies). E collects dD ⊙ D, all the decays need.
    # The solve, strictly lower: dL = −Mᵀ dM Mᵀ, L_ts = β_t κ̂_ts D_ts
    dL = torch.tril((M.mT @ dM) @ M.mT, diagonal=-1).neg_()  # [NC, H, C, C]
    E = (dL * gram).mul_(D)  # dL ⊙ κ̂ ⊙ D
    dbeta += E.sum(-1)
    E.mul_(bc[..., :, None])  # E from L
    dgram = dL.mul_(D).mul_(bc[..., :, None])  # dκ̂
    E[..., -1, :] += domega / norm * D[..., -1, :]  # ω = D[C, ·] / n
    # the scores, A = tril(κ(sQ, K) ⊙ D ⊘ n)
    dscores = torch.tril(dA).div_(norm[..., None, :])
    scores.mul_(dscores).mul_(D)  # tril(dA) ⊙ A
    dn -= scores.sum(-2) / norm
    E += scores
    del scores, t
    dscores.mul_(D)  # dκ(sQ, K)
    # the normalised Gram, κ̂ = κ(K, K) ⊘ (n nᵀ)
    gram.mul_(dgram)
    dn -= (gram.sum(-1) + gram.sum(-2)) / norm
    del gram
    dgram.div_(norm[..., :, None]).div_(norm[..., None, :])  # dκ(K, K)
    # the decays, D_ts = exp(γ_t − γ_s) for s <= t, γ = cumsum(g)
    dgam += E.sum(-1) - E.sum(-2)
    del E, D
    dg = torch.flip(torch.cumsum(torch.flip(dgam, [-1]), -1), [-1])
    ds = torch.where(square >= eps**2, dn / (2 * norm), 0.0)  # n = sqrt(max(κ(k, k), eps²))
    dq, dk = fmap.kernel_vjp(scale * qc, kc, dscores)
    del dscores
    dk1, dk2 = fmap.kernel_vjp(kc, kc, dgram)
    del dgram
    dk3, dk4 = fmap.kernel_vjp(kc[..., None, :], kc[..., None, :], ds[..., None, None])
    return dk + dk1 + dk2 + (dk3 + dk4)[..., 0, :], scale * dq, dbeta, dg


@torch.library.custom_op("polyattn::deltakata_algebra_backward", mutates_args=())
def chunk_algebra_backward(
    dM: torch.Tensor, dA: torch.Tensor, dalpha: torch.Tensor, domega: torch.Tensor, drho: torch.Tensor, dlam: torch.Tensor,
    kc: torch.Tensor, qc: torch.Tensor, bc: torch.Tensor, gc: torch.Tensor, M: torch.Tensor, groups: int, combine: str,
    scale: float, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`chunk_algebra`'s backward (its docstring has the formulas): `(dk, dq, dβ, dg)` from every output's cotangent,
    the inputs and M; `deltakata_algebra_grad_kernel` where the forward runs its kernel, else the twin."""
    NC, H, C, K = kc.shape
    if not runs_kernels(kc):
        return chunk_algebra_backward_ref(dM, dA, dalpha, domega, drho, dlam, kc, qc, bc, gc, M, groups, combine, scale, eps)
    args = [x.contiguous() for x in (dM, dA, dalpha, domega, drho, dlam, kc, qc, bc, gc, M)]
    dk, dq = torch.empty_like(kc), torch.empty_like(qc)
    dbeta, dg = torch.empty_like(bc), torch.empty_like(gc)
    if NC * H:
        deltakata_algebra_grad_kernel[(NC * H,)](
            *args, dk, dq, dbeta, dg, K, K // groups, scale, eps, C=C, R=min(C, ALGEBRA_ROWS), BE=block(K // groups),
            G=groups, SUM=combine == "sum", num_warps=8,
        )
    return dk, dq, dbeta, dg


@chunk_algebra_backward.register_fake
def _(dM, dA, dalpha, domega, drho, dlam, kc, qc, bc, gc, M, groups, combine, scale, eps):
    return kc.new_empty(kc.shape), qc.new_empty(qc.shape), bc.new_empty(bc.shape), gc.new_empty(gc.shape)


def _algebra_setup_context(ctx, inputs, output):
    kc, qc, bc, gc, groups, combine, scale, eps = inputs
    ctx.save_for_backward(kc, qc, bc, gc, output[0])
    ctx.options = (groups, combine, scale, eps)


def _algebra_backward(ctx, *grads):
    kc, qc, bc, gc, M = ctx.saved_tensors
    outs = (M, M, bc, bc, bc, gc[..., 0])  # an unused output's cotangent may arrive as None: zeros of its shape
    grads = [torch.zeros_like(x) if d is None else d.contiguous() for d, x in zip(grads, outs)]
    return (*chunk_algebra_backward(*grads, kc, qc, bc, gc, M, *ctx.options), None, None, None, None)


chunk_algebra.register_autograd(_algebra_backward, setup_context=_algebra_setup_context)
