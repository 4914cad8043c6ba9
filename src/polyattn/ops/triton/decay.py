"""Chunk-local decay stages: the log2-decay cumsum of one chunk and its [C, C] segment sums.

`chunk_decay` and `chunk_segsum` run inside every chunked kernel; `chunk_decay_ref` and
`chunk_segsum_ref` are their PyTorch twins (ops/README.md, "Decays": `G` is the inclusive cumsum
of the log-decay, the weight from key j to query i >= j is exp(G_i - G_j)).
"""
import torch
import triton
import triton.language as tl

from .precision import LOG2E


@triton.jit
def chunk_decay(g, t, m_t, H, i_h, USE_G: tl.constexpr):
    """The chunk's `g` over rows `t` (0 past the end), its inclusive cumsum `Gc` prescaled by
    log2(e) (after the sum: one rounding) and the last entry of `Gc`, the chunk's log2-decay."""
    if USE_G:
        b_g = tl.load(g + t * H + i_h, mask=m_t, other=0.0).to(tl.float32)  # [C]
        b_gc = tl.cumsum(b_g, axis=0) * LOG2E  # [C]
        return b_g, b_gc, tl.sum(b_g, axis=0) * LOG2E
    b_zero = tl.zeros([t.shape[0]], dtype=tl.float32)
    return b_zero, b_zero, tl.sum(b_zero, axis=0)


@triton.jit
def chunk_segsum(b_g, b_gc, REVERSE: tl.constexpr, EXACT: tl.constexpr):
    """[C, C] log2-decay between rows: causal `Gc_i - Gc_j` (j <= i), anticausal `Gc_j - Gc_i`
    (j >= i); -inf outside the triangle. EXACT (fp32 inputs) sums the g's in between by a
    masked cumsum, as `ops.common.segsum` does, instead of subtracting two long cumsums, whose
    rounding (~|Gc| ulp) would dominate fp32 outputs; for bf16/fp16 the difference is ample."""
    o_t = tl.arange(0, b_g.shape[0])
    if REVERSE:
        m_tri = o_t[:, None] <= o_t[None, :]  # [C, C]: j >= i
        if EXACT:
            b_m = tl.where(o_t[:, None] < o_t[None, :], b_g[None, :], 0.0)  # [C, C]: g_s for s > i
            b_d = tl.cumsum(b_m, axis=1) * LOG2E  # [C, C]
        else:
            b_d = b_gc[None, :] - b_gc[:, None]  # [C, C]
    else:
        m_tri = o_t[:, None] >= o_t[None, :]  # [C, C]: j <= i
        if EXACT:
            b_m = tl.where(o_t[:, None] > o_t[None, :], b_g[:, None], 0.0)  # [C, C]: g_s for s > j
            b_d = tl.cumsum(b_m, axis=0) * LOG2E  # [C, C]
        else:
            b_d = b_gc[:, None] - b_gc[None, :]  # [C, C]
    return tl.where(m_tri, b_d, float("-inf"))


def chunk_decay_ref(g: torch.Tensor) -> tuple:
    """Twin of `chunk_decay` for one chunk `g: [C]`: `(g, Gc * log2 e, Gc[-1] * log2 e)` in fp32."""
    g = g.float()
    gc = torch.cumsum(g, 0) * LOG2E.value  # [C]
    return g, gc, g.sum() * LOG2E.value


def chunk_segsum_ref(g: torch.Tensor, reverse: bool) -> torch.Tensor:
    """Twin of `chunk_segsum` for one chunk `g: [C]`: the [C, C] log2-decay, -inf off the triangle."""
    C = g.shape[0]
    gc = torch.cumsum(g.double(), 0)  # [C]
    d = gc[:, None] - gc[None, :]  # [C, C]: G_i - G_j
    if reverse:
        d, mask = -d, torch.ones(C, C, dtype=torch.bool, device=g.device).triu()
    else:
        mask = torch.ones(C, C, dtype=torch.bool, device=g.device).tril()
    return torch.where(mask, d * LOG2E.value, float("-inf")).float()


__all__ = ["chunk_decay", "chunk_decay_ref", "chunk_segsum", "chunk_segsum_ref"]
