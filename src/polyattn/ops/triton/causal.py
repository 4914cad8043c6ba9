"""In-chunk products that stay causal whatever the inputs hold.

A chunk's score tile has exact zeros off its causal triangle, but multiplying by a zero does not
remove a NaN or an Inf (`0 * nan = nan`): a non-finite key or value of a later row would reach
every earlier row of its chunk. `causal_scores` selects the masked scores away (the twin of
`ops.common.causal_scores`); `causal_product` keeps the product `scores @ values` causal (the twin
of `ops.common.causal_matmul`, and of its mirror image for the anticausal passes).
"""
import triton
import triton.language as tl

from .precision import mma_left_fp32


@triton.jit
def causal_scores(b_att, b_d, scale):
    """`b_att * exp2(b_d) * scale` where the [C, C] log2-decay `b_d` is finite, exactly 0 where it is
    -inf (off the causal triangle, and across a reset): selected, not multiplied, so a non-finite score
    `a_i . b_j` of a masked pair never enters."""
    return tl.where(b_d == float("-inf"), 0.0, b_att * (tl.exp2(b_d) * scale))


@triton.jit
def causal_product(b_att, b_v, REVERSE: tl.constexpr, F32: tl.constexpr):
    """`b_att @ b_v` ([C, C] fp32 @ [C, BC] input dtype -> [C, BC] fp32) for a causal (REVERSE:
    anticausal) score tile, where row i depends on the rows of `b_v` at or before i (at or after i).

    A tile of finite values (one reduction says so) takes the plain product. Otherwise the
    non-finite entries enter the product as 0, and every output entry `(i, c)` whose column c holds a
    non-finite value at a row the pass has reached by i is NaN: what the recurrence gives there (a
    non-finite value stays in the state).
    """
    b_nf = b_v.to(tl.float32) * 0.0  # [C, BC]: 0 where finite, NaN where b_v is NaN or +-Inf
    if tl.sum(tl.sum(b_nf, axis=1), axis=0) == 0.0:
        b_o = mma_left_fp32(b_att, b_v, F32)  # [C, C] @ [C, BC] -> [C, BC]
    else:
        b_bad = b_nf != 0.0  # [C, BC]
        b_o = mma_left_fp32(b_att, tl.where(b_bad, 0.0, b_v).to(b_v.dtype), F32)  # [C, C] @ [C, BC] -> [C, BC]
        o_t = tl.arange(0, b_v.shape[0])
        if REVERSE:  # rows at or before the last non-finite row of each column
            b_hit = o_t[:, None] <= tl.max(tl.where(b_bad, o_t[:, None], -1), axis=0)[None, :]  # [C, BC]
        else:  # rows at or after the first one
            b_hit = o_t[:, None] >= tl.min(tl.where(b_bad, o_t[:, None], b_v.shape[0]), axis=0)[None, :]  # [C, BC]
        b_o = tl.where(b_hit, float("nan"), b_o)
    return b_o


__all__ = ["causal_product", "causal_scores"]
