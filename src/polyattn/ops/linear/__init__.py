"""``ops.linear_attn``: causal linear attention with optional per-token log-decay (the workhorse)."""

from __future__ import annotations

import torch

from polyattn.ops.common import check_inputs, check_state, resolve_impl, resolve_scale, run_varlen
from polyattn.ops.linear.chunk import linear_attn_chunk
from polyattn.ops.linear.naive import linear_attn_naive
from polyattn.ops.linear.recurrent import linear_attn_recurrent, linear_attn_step
from polyattn.ops.linear.scan import linear_attn_scan
from polyattn.ops.linear.triton import linear_attn_triton  # lazy: triton loads on first call


LINEAR_ATTN_FORMS = {
    "naive": linear_attn_naive,
    "recurrent": linear_attn_recurrent,
    "chunk": linear_attn_chunk,
    "scan": linear_attn_scan,
    "triton": linear_attn_triton,
}


def linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    impl: str = "auto",
):
    """Causal linear attention ``S_t = exp(g_t) S_{t-1} + k_t v_tᵀ``, ``o_t = S_tᵀ (scale·q_t)``.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H]`` log-decay ``<= 0`` or None (no decay).
        scale: multiplies q; default ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` (N = B, or the number of sequences with ``cu_seqlens``).
        output_final_state: also return the ``[N, H, K, V]`` fp32 state after the last token.
        cu_seqlens: int64 ``[N + 1]`` offsets of packed sequences (B must be 1).
        impl: ``"naive" | "recurrent" | "chunk" | "scan" | "triton" | "auto"``.

    Returns:
        ``(o [B, T, H, V] in q's dtype, final_state or None)``.
    """
    d = check_inputs(q, k, v, g, cu_seqlens, output_final_state)
    if initial_state is not None:
        check_state("initial_state", initial_state, (d.N, d.H, d.K, d.V), q)
    fn = resolve_impl("linear_attn", impl, LINEAR_ATTN_FORMS, q)
    scale = resolve_scale(scale, d.K)
    return run_varlen(fn, (q, k, v, g), cu_seqlens, initial_state, output_final_state, decay_index=3, neutral_padding=True, scale=scale)


__all__ = [
    "LINEAR_ATTN_FORMS",
    "linear_attn",
    "linear_attn_chunk",
    "linear_attn_naive",
    "linear_attn_recurrent",
    "linear_attn_scan",
    "linear_attn_step",
]
