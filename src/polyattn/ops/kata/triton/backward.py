"""Backward kernels of KATA's quadratic form: the scores are recomputed, never stored.

With the score gradient written as `dA[t, s] = r_t (do_t · v_s) − c_t` (function.py derives r and c
from the forward's normaliser: `r = 1 / max(den, eps)`, `c = r (do · o)` where den > eps, for the
normalized read; `r = 1`, `c = 0` unnormalized) and `A = scale² κ ⊙ D`:

    dv_s = Σ_{t>=s} A[t, s] r_t do_t
    dq_t = Σ_{s<=t} 2 scale² D[t, s] dA[t, s] Σ_groups u[t, s] k_s      (u: the group dot products)
    dk_s = Σ_{t>=s} 2 scale² D[t, s] dA[t, s] Σ_groups u[t, s] q_t

Two kernels, as flash attention's Triton backward: `kata_dq_kernel` per query tile over key tiles
(like the forward), `kata_dkdv_kernel` per key tile over query tiles. Each recomputes the score
tile, which costs two more products than one pass with atomic dq updates, and in exchange needs
no fp32 atomics and gives bitwise reproducible gradients. Both also store the row dots `q·dq` and
`k·dk`: κ is homogeneous of degree 2 in q and in k, so `Σ_s dA A[t, s] = q_t·dq_t / 2` and the
log-decay gradient is `dL/dG_t = (q_t·dq_t − k_t·dk_t) / 2` (G the inclusive cumsum of g), the
per-token term of function.py's reverse cumsum. `kata_dq_ref`, `kata_dkdv_ref`: the PyTorch twins.
"""
import torch
import triton
import triton.language as tl

from polyattn.ops.triton.decay import chunk_decay, chunk_suffix, reset_limited
from polyattn.ops.triton.precision import mma, to_output

from .forward import sequence_scores
from .tiles import (
    grad_dot, group_grad, group_rowdot, key_diagonal_decay, key_tile, load_groups, load_rows, pair_dots, query_tile,
    score_values, square_sum, store_groups,
)


@triton.jit
def kata_dq_kernel(
    q, k, v, g, do, r, c, dq, qdq, tiles, starts,
    scale2, H, K, V, E,
    G: tl.constexpr, SUM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BE: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, SPLIT: tl.constexpr, F32: tl.constexpr,
):
    """dq and `q·dq` of one query tile of one head.

    grid: (query tiles, H), the last tiles first. Tiling as the forward's, with do `[BM, BV]`
    and the fp32 gradient `[G·BM, BE]` in registers; per key tile the products `q kᵀ` (groups),
    `do vᵀ` and `dU k` (groups). do: `[N_tok, H, V]`; r, c, qdq: `[N_tok, H]` fp32.
    """
    i_h, t0, t1, bos, t, m_t, b_q, b_gq, b_hq = query_tile(q, g, tiles, starts, H, K, E, G, BM, BE, USE_G)
    b_do = load_rows(do, t0, t1, H, i_h, V, BM, BV)  # [BM, BV]
    b_r = tl.load(r + t * H + i_h, mask=m_t, other=0.0)  # [BM]
    b_c = tl.load(c + t * H + i_h, mask=m_t, other=0.0)  # [BM]
    b_dq = tl.zeros([G * BM, BE], dtype=tl.float32)
    b_pre = tl.sum(tl.zeros([BN], dtype=tl.float32), axis=0)
    for s0 in range(t0, t1, BN):  # diagonal
        b_k, b_v, b_d, mask, k_last = key_tile(
            k, v, g, s0, t1, t, b_gq, b_hq, b_pre, H, i_h, K, V, E, G, BN, BE, BV, USE_G, True, F32,
        )
        if USE_G:
            b_pre += k_last
        b_da = mma(b_do, tl.trans(b_v), F32) * b_r[:, None] - b_c[:, None]  # dA: [BM, BN]
        b_du = group_grad(pair_dots(b_q, b_k, G, SUM, F32), b_da * b_d * (2.0 * scale2), mask, G, SUM, True)
        b_dq += grad_dot(b_du, b_k, G, SUM, SPLIT, F32)
    b_between = tl.sum(tl.zeros([BN], dtype=tl.float32), axis=0)
    for j in range(0, (t0 - bos) // BN):  # earlier key tiles, nearest first
        b_k, b_v, b_d, _, k_last = key_tile(
            k, v, g, t0 - (j + 1) * BN, t0, t, b_gq, b_hq, b_between, H, i_h, K, V, E, G, BN, BE, BV, USE_G, False, F32,
        )
        if USE_G:
            b_between += k_last
        b_da = mma(b_do, tl.trans(b_v), F32) * b_r[:, None] - b_c[:, None]
        b_du = group_grad(pair_dots(b_q, b_k, G, SUM, F32), b_da * b_d * (2.0 * scale2), None, G, SUM, False)
        b_dq += grad_dot(b_du, b_k, G, SUM, SPLIT, F32)
    store_groups(dq, b_dq, t0, t1, H, i_h, K, E, G, BM, BE, F32)
    tl.store(qdq + t * H + i_h, group_rowdot(b_q.to(tl.float32), b_dq, G, BM), mask=m_t)


@triton.jit
def kata_dkdv_kernel(
    q, k, v, g, do, r, c, dk, dv, kdk, tiles, starts,
    scale2, H, K, V, E,
    G: tl.constexpr, SUM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BE: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, SPLIT: tl.constexpr, F32: tl.constexpr,
):
    """dk, dv and `k·dk` of one key tile (BM rows) of one head, over the query tiles (BN rows) at
    or after it.

    grid: (key tiles, H). Tiling: k `[G·BM, BE]`, v `[BM, BV]`, fp32 gradients `[G·BM, BE]` and
    `[BM, BV]` in registers; per query tile the products `k qᵀ` (groups), `v doᵀ`, `(A r) do`
    and `dUᵀ q` (groups), all in the key-major (transposed) layout.
    """
    i_m = tl.program_id(0)
    i_h = tl.program_id(1)
    s0 = tl.load(tiles + i_m * 4)
    s1 = tl.load(tiles + i_m * 4 + 1)
    eos = tl.load(starts + tl.load(tiles + i_m * 4 + 2) + 1)
    s = s0 + tl.arange(0, BM)
    m_s = s < s1
    b_k = load_groups(k, s0, s1, H, i_h, K, E, G, BM, BE)  # [G*BM, BE]
    b_v = load_rows(v, s0, s1, H, i_h, V, BM, BV)  # [BM, BV]
    b_gk, b_hk, k_last = chunk_decay(g, s, m_s, H, i_h, USE_G)
    b_gn = tl.zeros([BM], dtype=tl.float32)
    if USE_G:
        b_gn = reset_limited(tl.load(g + (s + 1) * H + i_h, mask=s + 1 < s1, other=0.0).to(tl.float32))  # g_{s+1} in the tile
    b_dk = tl.zeros([G * BM, BE], dtype=tl.float32)
    b_dv = tl.zeros([BM, BV], dtype=tl.float32)
    b_pre = tl.sum(tl.zeros([BN], dtype=tl.float32), axis=0)
    for t0 in range(s0, s1, BN):  # diagonal: query tiles inside the key tile
        t = t0 + tl.arange(0, BN)
        mask = s[:, None] <= t[None, :]
        b_q = load_groups(q, t0, s1, H, i_h, K, E, G, BN, BE)  # [G*BN, BE]
        b_do = load_rows(do, t0, s1, H, i_h, V, BN, BV)  # [BN, BV]
        b_r = tl.load(r + t * H + i_h, mask=t < s1, other=0.0)  # [BN]
        b_c = tl.load(c + t * H + i_h, mask=t < s1, other=0.0)  # [BN]
        b_u = pair_dots(b_k, b_q, G, SUM, F32)
        b_d = tl.where(mask, 1.0, 0.0)
        if USE_G:
            _, b_ht, q_last = chunk_decay(g, t, t < s1, H, i_h, True)
            b_d = tl.exp2(key_diagonal_decay(b_gn, b_hk, s, t, b_ht + b_pre, F32))
            b_pre += q_last
        b_a = tl.where(mask, square_sum(b_u, G, SUM, BM, BN) * b_d, 0.0)  # Aᵀ / scale²: [BM, BN]
        b_dv += score_values(b_a * b_r[None, :], b_do, SPLIT, F32)  # [BM, BN] @ [BN, BV]
        b_da = mma(b_v, tl.trans(b_do), F32) * b_r[None, :] - b_c[None, :]  # dAᵀ: [BM, BN]
        b_dk += grad_dot(group_grad(b_u, b_da * b_d * (2.0 * scale2), mask, G, SUM, True), b_q, G, SUM, SPLIT, F32)
    b_between = tl.sum(tl.zeros([BN], dtype=tl.float32), axis=0)
    b_tail = tl.zeros([BM], dtype=tl.float32)
    if USE_G:
        b_tail = chunk_suffix(b_gk, b_hk, k_last, F32)  # [BM]: key -> key tile end
    for t0 in range(s1, eos, BN):  # later query tiles, nearest first
        t = t0 + tl.arange(0, BN)
        m_t = t < eos
        b_q = load_groups(q, t0, eos, H, i_h, K, E, G, BN, BE)  # [G*BN, BE]
        b_do = load_rows(do, t0, eos, H, i_h, V, BN, BV)  # [BN, BV]
        b_r = tl.load(r + t * H + i_h, mask=m_t, other=0.0)
        b_c = tl.load(c + t * H + i_h, mask=m_t, other=0.0)
        b_u = pair_dots(b_k, b_q, G, SUM, F32)
        b_a = square_sum(b_u, G, SUM, BM, BN)
        b_da = mma(b_v, tl.trans(b_do), F32) * b_r[None, :] - b_c[None, :]
        b_w = b_da * (2.0 * scale2)
        if USE_G:
            _, b_ht, q_last = chunk_decay(g, t, m_t, H, i_h, True)
            b_d = tl.exp2((b_tail + b_between)[:, None] + b_ht[None, :])
            b_between += q_last
            b_a = b_a * b_d
            b_w = b_w * b_d
        b_dv += score_values(b_a * b_r[None, :], b_do, SPLIT, F32)
        b_dk += grad_dot(group_grad(b_u, b_w, None, G, SUM, False), b_q, G, SUM, SPLIT, F32)
    store_groups(dk, b_dk, s0, s1, H, i_h, K, E, G, BM, BE, F32)
    o_v = tl.arange(0, BV)
    p_dv = dv + (s.to(tl.int64) * H + i_h)[:, None] * V + o_v[None, :]
    tl.store(p_dv, to_output(b_dv * scale2, dv.dtype.element_ty, F32), mask=m_s[:, None] & (o_v < V)[None, :])
    tl.store(kdk + s * H + i_h, group_rowdot(b_k.to(tl.float32), b_dk, G, BM), mask=m_s)


@triton.jit
def row_dot_kernel(x, y, z, out, N, D, HAS_Z: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    """`out[n] = Σ_d x[n, d] (y[n, d] + z[n, d])` in fp32 for BR rows of `[N, D]` tensors of any dtypes
    (z only with HAS_Z): the normalized read's `do·(o + o_lo)` and the log-decay identity's `q·dq`, `k·dk`
    in one pass over the rows. grid: (cdiv(N, BR),)."""
    n = tl.program_id(0) * BR + tl.arange(0, BR)
    m_n = n < N
    acc = tl.zeros([BR], dtype=tl.float32)
    for d0 in range(0, D, BD):
        o_d = d0 + tl.arange(0, BD)
        offsets = n.to(tl.int64)[:, None] * D + o_d[None, :]  # [BR, BD]
        m = m_n[:, None] & (o_d < D)[None, :]
        b_y = tl.load(y + offsets, mask=m, other=0.0).to(tl.float32)
        if HAS_Z:
            b_y += tl.load(z + offsets, mask=m, other=0.0).to(tl.float32)
        acc += tl.sum(tl.load(x + offsets, mask=m, other=0.0).to(tl.float32) * b_y, axis=1)
    tl.store(out + n, acc, mask=m_n)


def row_dot_ref(x, y, z=None):
    """Twin of `row_dot_kernel` on `[..., D]` tensors: `Σ_d x (y + z)` in float64, `[...]`."""
    y = y.double() if z is None else y.double() + z.double()
    return (x.double() * y).sum(-1)


def _per_sequence_grads(q, k, v, g, do, r, c, seq_lens, *, groups, combine, scale):
    """Dense float64 `(dq, dk, dv)` of the kernels' stage: the gradient of `Σ A ⊙ dA` with dA held fixed."""
    dqs, dks, dvs, bos = [], [], [], 0
    for n in seq_lens:
        sl = slice(bos, bos + n)
        qs, ks = (x[sl].double().requires_grad_() for x in (q, k))
        A = sequence_scores(qs, ks, None if g is None else g[sl], groups=groups, combine=combine, scale=scale)  # [H, T, T]
        rdo = (r[sl, :, None].double() * do[sl].double()).transpose(0, 1)  # [H, T, V]
        dA = rdo @ v[sl].double().permute(1, 2, 0) - c[sl].double().t()[..., None]  # [H, T, V] @ [H, V, T] -> [H, T, T]
        dq_s, dk_s = torch.autograd.grad((A * dA).sum(), (qs, ks)) if n else (qs * 0, ks * 0)
        dqs.append(dq_s)
        dks.append(dk_s)
        dvs.append((A.detach().transpose(-1, -2) @ rdo).transpose(0, 1))  # [H, T, T] @ [H, T, V] -> [T, H, V]
        bos += n
    return torch.cat(dqs, 0), torch.cat(dks, 0), torch.cat(dvs, 0)


def kata_dq_ref(q, k, v, g, do, r, c, seq_lens, *, groups, combine, scale):
    """Twin of `kata_dq_kernel` on flattened tokens: `(dq [N_tok, H, K], q·dq [N_tok, H])` in float64."""
    dq, _, _ = _per_sequence_grads(q, k, v, g, do, r, c, seq_lens, groups=groups, combine=combine, scale=scale)
    return dq, (q.double() * dq).sum(-1)


def kata_dkdv_ref(q, k, v, g, do, r, c, seq_lens, *, groups, combine, scale):
    """Twin of `kata_dkdv_kernel`: `(dk [N_tok, H, K], dv [N_tok, H, V], k·dk [N_tok, H])` in float64."""
    _, dk, dv = _per_sequence_grads(q, k, v, g, do, r, c, seq_lens, groups=groups, combine=combine, scale=scale)
    return dk, dv, (k.double() * dk).sum(-1)


__all__ = ["kata_dkdv_kernel", "kata_dkdv_ref", "kata_dq_kernel", "kata_dq_ref", "row_dot_kernel", "row_dot_ref"]
