"""Forward kernel of KATA's flash-style quadratic form: numerator and normaliser per query tile, ψ never built.

`kata_forward_kernel` computes, for each query tile (BM rows) of one sequence and head,

    num_t = scale² Σ_{s<=t} κ(q_t, k_s) D[t, s] v_s + prior_t[:V],   den_t = scale² Σ_{s<=t} κ(q_t, k_s) D[t, s] + prior_t[V]
    o_t = num_t / max(den_t, eps)   (NORMALIZE)   or   num_t

over key tiles (BN rows) j <= i, with κ the sum of squared group dot products (tiles.py) and
`D[t, s] = exp(Σ_{s<u<=t} g_u)`. The key tiles inside the query tile (the diagonal) come first,
with the causal mask by select; then the earlier key tiles, nearest first, so that the log-decay
of the tiles in between is a running sum. `prior` is the host's read of an initial state
(function.py); den is stored (fp32) for the backward. `kata_forward_ref` is the PyTorch twin.
"""
import torch
import triton
import triton.language as tl

from polyattn.ops.common import exp_segsum
from polyattn.ops.kata.feature_maps import make_feature_map
from polyattn.ops.triton.precision import first_nonfinite_row, to_output, zero_rows_from

from .tiles import key_tile, pair_dots, query_tile, score_values, square_sum


@triton.jit
def kata_forward_kernel(
    q, k, v, g, prior, o, o_lo, den, tiles, starts,
    scale2, eps, H, K, V, E,
    G: tl.constexpr, SUM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BE: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, USE_PRIOR: tl.constexpr, NORMALIZE: tl.constexpr, SPLIT: tl.constexpr, F32: tl.constexpr,
    STORE_LO: tl.constexpr,
):
    """One query tile of one head.

    grid: (query tiles, H), the last tiles (the most key tiles) first. Tiling: q `[G·BM, BE]`
    group-major, k `[G·BN, BE]`, v `[BN, BV]`; fp32 accumulators `[BM, BV]` (numerator) and `[BM]`
    (normaliser) in registers. Per key tile: the group products (scores), the square-sum, the
    decay tile, `[BM, BN] @ [BN, BV]`. q, k, v, o: `[N_tok, H, D]`; g, den: `[N_tok, H]`;
    prior: `[N_tok, H, V + 1]` fp32; tiles: `[NT, 4]` (start, end, sequence, flags); starts: `[N + 1]`.
    STORE_LO: also `o_lo [N_tok, H, V]` bf16, the rounding error of o's downcast (o + o_lo: o before it to about
    16 bits, for the normalized backward's `do·o`).
    A NaN or Inf in a value row on the diagonal changes no earlier output: the row is zeroed in the
    product and the outputs from its token on are NaN (the scores of a non-finite key are masked by
    select already).
    """
    i_h, t0, t1, bos, t, m_t, b_q, b_gq, b_hq = query_tile(q, g, tiles, starts, H, K, E, G, BM, BE, USE_G)
    b_num = tl.zeros([BM, BV], dtype=tl.float32)
    b_den = tl.zeros([BM], dtype=tl.float32)
    b_pre = tl.sum(tl.zeros([BN], dtype=tl.float32), axis=0)  # log2-decay: query tile start -> key tile start
    bad_from = t1  # the first key on the diagonal whose value row is not finite
    for s0 in range(t0, t1, BN):  # diagonal: key tiles inside the query tile
        b_k, b_v, b_d, mask, k_last = key_tile(
            k, v, g, s0, t1, t, b_gq, b_hq, b_pre, H, i_h, K, V, E, G, BN, BE, BV, USE_G, True, F32,
        )
        b_a = square_sum(pair_dots(b_q, b_k, G, SUM, F32), G, SUM, BM, BN)  # [BM, BN]
        b_a = tl.where(mask, b_a * b_d, 0.0)  # causal mask by select
        if USE_G:
            b_pre += k_last
        b_den += tl.sum(b_a, axis=1)
        # a non-finite value row leaves the earlier query rows alone: zeroed here, their outputs NaN below
        first = first_nonfinite_row(b_v)  # scalar: BN when every row is finite
        bad_from = tl.where(first < BN, tl.minimum(bad_from, s0 + first), bad_from)
        b_v = zero_rows_from(b_v, first)  # [BN, BV]
        b_num += score_values(b_a, b_v, SPLIT, F32)  # [BM, BN] @ [BN, BV] -> [BM, BV]
    b_between = tl.sum(tl.zeros([BN], dtype=tl.float32), axis=0)  # log2-decay of the key tiles in between
    for j in range(0, (t0 - bos) // BN):  # earlier key tiles, nearest first
        b_k, b_v, b_d, _, k_last = key_tile(
            k, v, g, t0 - (j + 1) * BN, t0, t, b_gq, b_hq, b_between, H, i_h, K, V, E, G, BN, BE, BV, USE_G, False, F32,
        )
        b_a = square_sum(pair_dots(b_q, b_k, G, SUM, F32), G, SUM, BM, BN) * b_d  # [BM, BN]
        if USE_G:
            b_between += k_last
        b_den += tl.sum(b_a, axis=1)
        b_num += score_values(b_a, b_v, SPLIT, F32)  # [BM, BN] @ [BN, BV] -> [BM, BV]
    b_num = b_num * scale2
    b_den = b_den * scale2
    o_v = tl.arange(0, BV)
    m_v = o_v < V
    if USE_PRIOR:
        row = (t.to(tl.int64) * H + i_h) * (V + 1)
        b_num += tl.load(prior + row[:, None] + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
        b_den += tl.load(prior + row + V, mask=m_t, other=0.0)
    if NORMALIZE:
        b_num = b_num / tl.maximum(b_den, eps)[:, None]
    b_num = tl.where(t[:, None] < bad_from, b_num, float("nan"))  # [BM, BV]: from the non-finite value on
    offs = (t.to(tl.int64) * H + i_h)[:, None] * V + o_v[None, :]
    b_o = to_output(b_num, o.dtype.element_ty, F32)  # downcast: output dtype
    tl.store(o + offs, b_o, mask=m_t[:, None] & m_v[None, :])
    if STORE_LO:
        tl.store(o_lo + offs, to_output(b_num - b_o.to(tl.float32), tl.bfloat16, F32), mask=m_t[:, None] & m_v[None, :])  # downcast: bf16
    tl.store(den + t * H + i_h, b_den, mask=m_t)


def sequence_scores(q, k, g, *, groups, combine, scale):
    """Dense `A = κ(scale·q, k) ⊙ D` of one sequence and every head (float64): q, k `[T, H, K]`,
    g `[T, H]` or None -> `[H, T, T]`, 0 above the diagonal."""
    fmap = make_feature_map("psd", q.shape[-1], groups, combine)
    qh, kh = (x.double().transpose(0, 1) for x in (q, k))  # [T, H, K] -> [H, T, K]
    A = fmap.kernel(scale * qh, kh)  # [H, T, T]
    gh = torch.zeros(qh.shape[:2], dtype=torch.float64, device=q.device) if g is None else g.double().t()  # [H, T]
    return torch.where(torch.ones_like(A, dtype=torch.bool).tril(), A * exp_segsum(gh), 0.0)


def kata_forward_ref(q, k, v, g, prior, seq_lens, *, groups, combine, scale, eps, normalize):
    """Twin of `kata_forward_kernel` on flattened tokens (`[N_tok, H, D]`, g `[N_tok, H]`, prior
    `[N_tok, H, V + 1]` or None): `(o [N_tok, H, V], den [N_tok, H])` in float64."""
    outs, dens, bos = [], [], 0
    for n in seq_lens:
        sl = slice(bos, bos + n)
        A = sequence_scores(q[sl], k[sl], None if g is None else g[sl], groups=groups, combine=combine, scale=scale)
        num = (A @ v[sl].double().transpose(0, 1)).transpose(0, 1)  # [H, T, T] @ [H, T, V] -> [T, H, V]
        d = A.sum(-1).t()  # [H, T] -> [T, H]
        if prior is not None:
            num, d = num + prior[sl, :, :-1].double(), d + prior[sl, :, -1].double()
        outs.append(num / d.clamp_min(eps)[..., None] if normalize else num)
        dens.append(d)
        bos += n
    return torch.cat(outs, 0), torch.cat(dens, 0)
