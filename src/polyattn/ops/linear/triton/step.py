"""Fused one-token decoding step: the state is updated in place.

`linear_attn_step_kernel` implements `linear_attn_step` of ops/linear/recurrent.py:

    S <- exp(g) S + k v^T        o = S^T (scale q)

on the shared step front (ops/triton/step.py: grid, tiling, one read and one write of the state).
"""
import triton
import triton.language as tl

from polyattn.ops.triton.step import launch_step, step_finish, step_tile


@triton.jit
def linear_attn_step_kernel(
    q, k, v, g, state, o, scale, K, V,
    BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, F32: tl.constexpr,
):
    """One decoding step for one (batch, head, V tile); q, k: [B, H, K], v, o: [B, H, V]."""
    p_s, m_s, b_s, b_q, b_k, b_v = step_tile(q, k, v, g, state, scale, K, V, BK, BV, USE_G)
    b_s += b_k[:, None] * b_v[None, :]  # [BK, 1] * [1, BV] -> [BK, BV]
    step_finish(p_s, m_s, b_s, b_q, o, V, BV, F32)


def linear_attn_step_inplace(q, k, v, g, state, *, scale):
    """One decoding step of `linear_attn` with `state` updated in place (the arguments of
    `ops.linear.recurrent.linear_attn_step`, which returns a new state instead).

    q, k: [B, H, K]; v: [B, H, V]; g: [B, H] log-decay or None; state: [B, H, K, V] fp32
    contiguous. Returns `(o [B, H, V] in q's dtype, state)`.
    """
    extra = (g.contiguous() if g is not None else None,)
    return launch_step(linear_attn_step_kernel, q, k, v, state, extra, scale=scale, use_g=g is not None)
