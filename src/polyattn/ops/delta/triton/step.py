"""Fused one-token decoding step of the delta rule: the state is updated in place.

`delta_rule_step_kernel` implements `delta_rule_step` of ops/delta/recurrent.py:

    S <- exp(g) S,    S <- S + beta k (v - S^T k)^T,    o = S^T (scale q)

on the shared step front (ops/triton/step.py: grid, tiling, one read and one write of the state;
the tile holds the whole K, so the read `S^T k` of its columns is complete).
"""
import triton
import triton.language as tl

from polyattn.ops.triton.step import launch_step, step_finish, step_tile


@triton.jit
def delta_rule_step_kernel(
    q, k, v, g, beta, state, o, scale, K, V,
    BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, F32: tl.constexpr,
):
    """One decoding step for one (batch, head, V tile); q, k: [B, H, K], v, o: [B, H, V]."""
    p_s, m_s, b_s, b_q, b_k, b_v = step_tile(q, k, v, g, state, scale, K, V, BK, BV, USE_G)
    b_beta = tl.load(beta + tl.program_id(1)).to(tl.float32)
    b_read = tl.sum(b_s * b_k[:, None], axis=0)  # [BK, BV] -> [BV]: S^T k
    b_s += b_k[:, None] * (b_beta * (b_v - b_read))[None, :]  # rank-1 update, [BK, BV]
    step_finish(p_s, m_s, b_s, b_q, o, V, BV, F32)


def delta_rule_step_inplace(q, k, v, beta, g, state, *, scale):
    """One decoding step of `delta_rule` with `state` updated in place (the arguments of
    `ops.delta.recurrent.delta_rule_step`, which returns a new state instead).

    q, k: [B, H, K]; v: [B, H, V]; beta: [B, H]; g: [B, H] log-decay or None; state:
    [B, H, K, V] fp32 contiguous. Returns `(o [B, H, V] in q's dtype, state)`.
    """
    extra = (g.contiguous() if g is not None else None, beta.contiguous())
    return launch_step(delta_rule_step_kernel, q, k, v, state, extra, scale=scale, use_g=g is not None)
