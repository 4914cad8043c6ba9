"""The shared front of the fused one-token decoding steps: one (batch, head, value tile) of the state.

grid: (cdiv(V, BV), B * H). `step_tile` loads the program's [BK, BV] fp32 state tile (BK = the
whole padded K, so reads `S^T k` of its columns are complete) already decayed by `exp(g)`, and
the token's q (scaled), k, v in fp32; the family's step kernel applies its update, then
`step_finish` writes the tile back and the output `S^T q`. Each program reads and writes its
tile once: the step is bound by the state's bytes.
"""
import torch
import triton
import triton.language as tl

from .plan import block
from .precision import LOG2E, dot_f32, to_output


@triton.jit
def step_tile(q, k, v, g, state, scale, K, V, BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr):
    """`(p_s, m_s, b_s [BK, BV] decayed, b_q [BK] scaled, b_k [BK], b_v [BV])` of this program."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_s = m_k[:, None] & m_v[None, :]
    p_s = state + (i_bh.to(tl.int64) * K + o_k[:, None]) * V + o_v[None, :]
    b_s = tl.load(p_s, mask=m_s, other=0.0)  # [BK, BV]
    b_q = tl.load(q + i_bh * K + o_k, mask=m_k, other=0.0).to(tl.float32) * scale  # [BK]
    b_k = tl.load(k + i_bh * K + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BK]
    b_v = tl.load(v + i_bh * V + o_v, mask=m_v, other=0.0).to(tl.float32)  # [BV]
    if USE_G:
        b_s *= tl.exp2(tl.load(g + i_bh).to(tl.float32) * LOG2E)
    return p_s, m_s, b_s, b_q, b_k, b_v


@triton.jit
def step_finish(p_s, m_s, b_s, b_q, o, V, BV: tl.constexpr, F32: tl.constexpr):
    """Write the updated tile and this program's `o = S^T q` columns (downcast: output dtype, `to_output`)."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    o_v = i_v * BV + tl.arange(0, BV)
    tl.store(p_s, b_s, mask=m_s)
    tl.store(o + i_bh * V + o_v, to_output(tl.sum(b_s * b_q[:, None], axis=0), o.dtype.element_ty, F32), mask=o_v < V)


def launch_step(kernel, q, k, v, state, extra: tuple, *, scale, use_g: bool):
    """Check the state and launch a step kernel `kernel[grid](q, k, v, *extra, state, o, scale, K, V, ...)`;
    returns `(o [B, H, V] in q's dtype, state)`."""
    B, H, K = q.shape
    V = v.shape[-1]
    if state.shape != (B, H, K, V) or state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"expected a contiguous fp32 state of shape {(B, H, K, V)}, got {tuple(state.shape)} {state.dtype}")
    o = torch.empty(B, H, V, dtype=q.dtype, device=q.device)
    BV = min(32, block(V))
    kernel[(triton.cdiv(V, BV), B * H)](
        q.contiguous(), k.contiguous(), v.contiguous(), *extra, state, o, scale, K, V,
        BK=block(K), BV=BV, USE_G=use_g, F32=dot_f32(q.dtype), num_warps=4,
    )
    return o, state
