"""Fused one-token decoding step of the delta rule: the state is updated in place.

`delta_rule_step_kernel` implements `delta_rule_step` of ops/delta/recurrent.py:

    S <- exp(g) S,    S <- S + beta k (v - S^T k)^T,    o = S^T (scale q)

grid: (cdiv(V, BV), B * H); each program owns the [BK, BV] fp32 tile of one head's state (BK =
the whole padded K, so the read `S^T k` of its columns is complete), reads it once and writes
it once.
"""
import torch
import triton
import triton.language as tl

from polyattn.ops.triton.plan import block
from polyattn.ops.triton.precision import LOG2E


@triton.jit
def delta_rule_step_kernel(
    q, k, v, beta, g, state, o, scale, H, K, V,
    BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr,
):
    """One decoding step for one (batch, head, V tile); q, k: [B, H, K], v, o: [B, H, V]."""
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
    b_beta = tl.load(beta + i_bh).to(tl.float32)
    if USE_G:
        b_s *= tl.exp2(tl.load(g + i_bh).to(tl.float32) * LOG2E)
    b_read = tl.sum(b_s * b_k[:, None], axis=0)  # [BK, BV] -> [BV]: S^T k
    b_s += b_k[:, None] * (b_beta * (b_v - b_read))[None, :]  # rank-1 update, [BK, BV]
    b_o = tl.sum(b_s * b_q[:, None], axis=0)  # [BK, BV] -> [BV]
    tl.store(p_s, b_s, mask=m_s)
    tl.store(o + i_bh * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)  # downcast: output dtype


def delta_rule_step_inplace(q, k, v, beta, g, state, *, scale):
    """One decoding step of `delta_rule` with `state` updated in place (the arguments of
    `ops.delta.recurrent.delta_rule_step`, which returns a new state instead).

    q, k: [B, H, K]; v: [B, H, V]; beta: [B, H]; g: [B, H] log-decay or None; state:
    [B, H, K, V] fp32 contiguous. Returns `(o [B, H, V] in q's dtype, state)`.
    """
    B, H, K = q.shape
    V = v.shape[-1]
    if state.shape != (B, H, K, V) or state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"expected a contiguous fp32 state of shape {(B, H, K, V)}, got {tuple(state.shape)} {state.dtype}")
    o = torch.empty(B, H, V, dtype=q.dtype, device=q.device)
    BV = min(32, block(V))
    delta_rule_step_kernel[(triton.cdiv(V, BV), B * H)](
        q.contiguous(), k.contiguous(), v.contiguous(), beta.contiguous(),
        g.contiguous() if g is not None else None,
        state, o, scale, H, K, V, BK=block(K), BV=BV, USE_G=g is not None, num_warps=4,
    )
    return o, state
