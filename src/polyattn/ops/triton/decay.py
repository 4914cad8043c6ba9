"""Chunk-local decay stages: the log2-decay prefix and suffix sums of one chunk and its [C, C] segment sums.

`chunk_decay`, `chunk_suffix` and `chunk_segsum` run inside every chunked kernel; the `*_ref`
functions are their PyTorch twins. The weight from key j to query i >= j is exp(g_{j+1} + ... + g_i).

Every log-decay below RESET_LIMIT is raised to it first: any weight that spans such a token is
below exp(-110), which is 0 in fp32 either way, so the outputs do not change, and a reset
(`g = -inf`) or a huge finite log-decay no longer reaches the sums as `inf - inf` or as a
cancellation of 1e30-sized terms. Then bf16/fp16 calls take every decay as a difference of the
chunk's cumsum (its rounding, ~|Gc| fp32 ulps with |Gc| at most C * 159 in log2, stays under the
inputs' rounding); fp32 calls (EXACT) sum directly. No branch on the data: the same code for
every chunk (ops/linear/README.md, "Triton kernels").
"""
import torch
import triton
import triton.language as tl

from .precision import LOG2E

RESET_LIMIT = tl.constexpr(-110.0)  # log-decays below it are raised to it: exp(-110) rounds to 0 in fp32


@triton.jit
def reset_limited(b_g):
    """Log-decays raised to RESET_LIMIT: still a reset in fp32, and NaN stays NaN."""
    return tl.where(b_g < RESET_LIMIT, RESET_LIMIT, b_g)


@triton.jit
def chunk_decay(g, t, m_t, H, i_h, USE_G: tl.constexpr):
    """The chunk's `g` over rows `t` (0 past the end, raised to RESET_LIMIT), its inclusive cumsum
    `Gc` prescaled by log2(e) (after the sum: one rounding) and the last entry of `Gc`, the chunk's
    log2-decay."""
    if USE_G:
        b_g = tl.load(g + t * H + i_h, mask=m_t, other=0.0).to(tl.float32)  # [C]
        b_g = reset_limited(b_g)  # [C]
        b_gc = tl.cumsum(b_g, axis=0) * LOG2E  # [C]
        return b_g, b_gc, tl.sum(b_g, axis=0) * LOG2E
    b_zero = tl.zeros([t.shape[0]], dtype=tl.float32)
    return b_zero, b_zero, tl.sum(b_zero, axis=0)


@triton.jit
def exact_suffix(b_g):
    """`sum_{s > j} g_s` (log2(e)-prescaled) as a direct sum: [C, C] select, row sums."""
    o_t = tl.arange(0, b_g.shape[0])
    return tl.sum(tl.where(o_t[None, :] > o_t[:, None], b_g[None, :], 0.0), axis=1) * LOG2E  # [C, C] -> [C]


@triton.jit
def exact_segsum(b_g, REVERSE: tl.constexpr):
    """[C, C] segment sums by a masked cumsum of the g's in between (causal: `sum_{j < s <= i}`,
    anticausal: `sum_{i < s <= j}`), before the triangle mask."""
    o_t = tl.arange(0, b_g.shape[0])
    if REVERSE:
        b_m = tl.where(o_t[:, None] < o_t[None, :], b_g[None, :], 0.0)  # [C, C]: g_s for s > i
        return tl.cumsum(b_m, axis=1) * LOG2E  # [C, C]
    b_m = tl.where(o_t[:, None] > o_t[None, :], b_g[:, None], 0.0)  # [C, C]: g_s for s > j
    return tl.cumsum(b_m, axis=0) * LOG2E  # [C, C]


@triton.jit
def chunk_suffix(b_g, b_gc, b_last, EXACT: tl.constexpr):
    """[C] log2-decay from each row to the chunk's end, `sum_{s > j} g_s`: `Gc_last - Gc_j`, or with
    EXACT (fp32 calls) the direct sum."""
    if EXACT:
        b_s = exact_suffix(b_g)
    else:
        b_s = b_last - b_gc
    return b_s


@triton.jit
def chunk_segsum(b_g, b_gc, b_last, REVERSE: tl.constexpr, EXACT: tl.constexpr):
    """[C, C] log2-decay between rows: causal `sum_{j < s <= i} g_s` (j <= i), anticausal
    `sum_{i < s <= j} g_s` (j >= i); -inf outside the triangle. The difference `Gc_i - Gc_j`, or
    with EXACT (fp32 calls) the masked cumsum of `exact_segsum`."""
    o_t = tl.arange(0, b_g.shape[0])
    if REVERSE:
        m_tri = o_t[:, None] <= o_t[None, :]  # [C, C]: j >= i
    else:
        m_tri = o_t[:, None] >= o_t[None, :]  # [C, C]: j <= i
    if EXACT:
        b_d = exact_segsum(b_g, REVERSE)
    elif REVERSE:
        b_d = b_gc[None, :] - b_gc[:, None]  # [C, C]
    else:
        b_d = b_gc[:, None] - b_gc[None, :]  # [C, C]
    return tl.where(m_tri, b_d, float("-inf"))


@triton.jit
def select_scores(b_att, b_d, scale):
    """The [C, C] score tile weighted by `exp2(b_d) * scale` (`chunk_segsum`), 0 where `b_d` is -inf (or
    NaN) by select rather than by product: a non-finite score there (a later non-finite key) reaches no
    output. The scores are selected before they are weighted, so the product is the last operation, as in
    the unguarded `b_att * (exp2(b_d) * scale)`: the compiler fuses it into what follows (the fp32
    split's `x - hi` becomes one fma) in linear attention's plain and guarded loops alike, as a guarded
    rerun's finite rows need to match the plain loop's bit for bit (selected after the product, they came
    out of an unfused subtraction, one rounding apart on the GPU; ops/README.md)."""
    keep = b_d > float("-inf")  # [C, C]
    return tl.where(keep, b_att, 0.0) * (tl.exp2(tl.where(keep, b_d, float("-inf"))) * scale)


@triton.jit
def chunk_side_decays(b_g, b_gc, b_last, REVERSE: tl.constexpr, EXACT: tl.constexpr):
    """The two [C] log2-decays of a pass: `(query side, key side)`. Causal: a query reads the
    entering state through `Gc_i` and a key reaches the leaving state through the suffix after
    it; anticausal: the other way round (ops/linear/README.md, "Triton kernels")."""
    if REVERSE:
        return chunk_suffix(b_g, b_gc, b_last, EXACT), b_gc
    return b_gc, chunk_suffix(b_g, b_gc, b_last, EXACT)


def reset_limit_ref(g: torch.Tensor) -> torch.Tensor:
    """`g` raised to RESET_LIMIT (NaN kept), as every kernel loads it."""
    return g.clamp(min=RESET_LIMIT.value)


def chunk_decay_ref(g: torch.Tensor) -> tuple:
    """Twin of `chunk_decay` for one chunk `g: [C]`: `(g, Gc * log2 e, Gc[-1] * log2 e)` in fp32."""
    g = reset_limit_ref(g.float())
    gc = torch.cumsum(g, 0) * LOG2E.value  # [C]
    return g, gc, g.sum() * LOG2E.value


def chunk_suffix_ref(g: torch.Tensor) -> torch.Tensor:
    """Twin of `chunk_suffix` for one chunk `g: [C]`: `sum_{s > j} g_s * log2 e`, summed directly."""
    g = reset_limit_ref(g.double())
    return torch.stack([g[j + 1:].sum() for j in range(g.shape[0])]).float() * LOG2E.value  # [C]


def chunk_segsum_ref(g: torch.Tensor, reverse: bool) -> torch.Tensor:
    """Twin of `chunk_segsum` for one chunk `g: [C]`: the [C, C] log2-decay of direct sums, -inf off the triangle."""
    C = g.shape[0]
    g = reset_limit_ref(g.double())
    d = torch.full((C, C), float("-inf"), dtype=torch.float64, device=g.device)
    for i in range(C):
        for j in range(C):
            if reverse and j >= i:
                d[i, j] = g[i + 1:j + 1].sum()
            elif not reverse and j <= i:
                d[i, j] = g[j + 1:i + 1].sum()
    return (d * LOG2E.value).float()


__all__ = [
    "RESET_LIMIT", "chunk_decay", "chunk_decay_ref", "chunk_segsum", "chunk_segsum_ref", "chunk_side_decays", "chunk_suffix",
    "chunk_suffix_ref", "reset_limit_ref", "reset_limited",
]
