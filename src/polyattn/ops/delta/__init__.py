"""``ops.delta_rule``: the (gated) delta rule, ``S_t = exp(g_t)(I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ``."""

from __future__ import annotations

import torch

from polyattn.ops.common import check_inputs, check_state, resolve_impl, resolve_scale, run_varlen
from polyattn.ops.delta.chunk import delta_rule_chunk
from polyattn.ops.delta.naive import delta_rule_attention_matrix, delta_rule_naive
from polyattn.ops.delta.recurrent import delta_rule_recurrent, delta_rule_step
from polyattn.ops.delta.triton import delta_rule_triton  # lazy: triton loads on first call

DELTA_RULE_FORMS = {
    "naive": delta_rule_naive,
    "recurrent": delta_rule_recurrent,
    "chunk": delta_rule_chunk,
    "triton": delta_rule_triton,
}


def delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    impl: str = "auto",
):
    """The gated delta rule, read ``o_t = S_tᵀ (scale·q_t)``; keys are used as given (no normalisation).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; beta: ``[B, T, H]`` write strengths;
        g: ``[B, T, H]`` log-decay ``<= 0`` or None. Other keywords as :func:`polyattn.ops.linear_attn`;
        impl: ``"naive" | "recurrent" | "chunk" | "triton" | "auto"``.

    Returns:
        ``(o [B, T, H, V] in q's dtype, final_state [N, H, K, V] fp32 or None)``.
    """
    if beta is None:
        raise ValueError("beta: expected the write strengths, a [B, T, H] tensor, got None")
    d = check_inputs(q, k, v, g, cu_seqlens, output_final_state, beta=beta)
    if initial_state is not None:
        check_state("initial_state", initial_state, (d.N, d.H, d.K, d.V), q)
    fn = resolve_impl("delta_rule", impl, DELTA_RULE_FORMS, q)
    scale = resolve_scale(scale, d.K)
    return run_varlen(fn, (q, k, v, beta, g), cu_seqlens, initial_state, output_final_state, decay_index=4, neutral_padding=True, scale=scale)


__all__ = [
    "DELTA_RULE_FORMS",
    "delta_rule",
    "delta_rule_attention_matrix",
    "delta_rule_chunk",
    "delta_rule_naive",
    "delta_rule_recurrent",
    "delta_rule_step",
]
