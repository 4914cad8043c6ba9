"""``ops.loglinear_attn``: log-linear attention over Mamba-2 (``beta=None``) and Gated DeltaNet (``beta`` given)."""

from __future__ import annotations

import torch

from polyattn.ops.common import check_inputs, check_per_token, resolve_impl, resolve_scale, run_varlen
from polyattn.ops.loglinear.chunk import loglinear_attn_chunk
from polyattn.ops.loglinear.naive import loglinear_attn_naive
from polyattn.ops.loglinear.recurrent import loglinear_attn_recurrent, loglinear_attn_step
from polyattn.ops.loglinear.scan import combine_levels, loglinear_attn_scan
from polyattn.ops.loglinear.state import LogLinearState, check_lam_levels, check_loglinear_state, widen_levels
from polyattn.ops.loglinear.triton import loglinear_attn_triton  # lazy: triton loads on first call

LOGLINEAR_ATTN_FORMS = {
    "naive": loglinear_attn_naive,
    "recurrent": loglinear_attn_recurrent,
    "chunk": loglinear_attn_chunk,
    "scan": loglinear_attn_scan,
    "triton": loglinear_attn_triton,
}


def _per_sequence(form):
    """``form`` called as ``run_varlen`` calls it: every per-token tensor positional, beta included."""

    def run(q, k, v, lam, g, beta, **kwargs):
        return form(q, k, v, lam, g, beta=beta, **kwargs)

    run.native_varlen = getattr(form, "native_varlen", False)
    return run


def loglinear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lam: torch.Tensor,
    g: torch.Tensor | None = None,
    *,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: LogLinearState | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    impl: str = "auto",
):
    """Log-linear attention: key ``s`` reaches query ``t`` with weight ``lam[t, level(t, s)]`` times the base model's.

    ``beta=None`` (log-linear Mamba-2): ``o_t = Σ_{s<=t} lam[t, level(t,s)] exp(g_{s+1}+…+g_t) (scale q_t·k_s) v_s``.
    ``beta`` given (log-linear Gated DeltaNet): ``O = (W ⊙ M^H) V`` with ``W`` the complete gated-delta-rule
    attention matrix (decay and delta-rule inverse included) and ``M^H[t, s] = lam[t, level(t, s)]``.
    Levels are those of absolute positions (``ops.common.fenwick.level``), continuing an initial state.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; lam: ``[B, T, H, L]`` level weights, level 0 = the token
            itself; ``L >= num_levels(position + length)`` for the absolute length each sequence reaches.
        g: ``[B, T, H]`` log-decay ``<= 0`` or None; beta: ``[B, T, H]`` delta-rule write strengths or None.
        scale: multiplies q; default ``K ** -0.5`` (the official models use ``scale=1.0``).
        initial_state: :class:`LogLinearState` with ``levels [N, H, L, K, V]`` (the same L as lam) and
            ``position [N]`` int64 (N = B, or the number of sequences with ``cu_seqlens``).
        output_final_state: also return the :class:`LogLinearState` after the last token.
        cu_seqlens: int64 ``[N + 1]`` offsets of packed sequences (B must be 1); positions restart per sequence.
        impl: ``"naive" | "recurrent" | "chunk" | "scan" | "triton" | "auto"`` (chunk size 64; ``"triton"`` has
            both bases with gradients and the decoding step; ``"auto"`` picks it for CUDA inputs).

    Returns:
        ``(o [B, T, H, V] in q's dtype, LogLinearState or None)``.
    """
    B, T, H, K, V, N = check_inputs(q, k, v, g, cu_seqlens, output_final_state, beta=beta)
    check_per_token("lam", lam, q, last_dim=-1)
    L = lam.shape[-1]
    if initial_state is not None:
        check_loglinear_state(initial_state, N, H, L, K, V, q)
    check_lam_levels(L, initial_state, T if cu_seqlens is None else torch.diff(cu_seqlens))
    fn = resolve_impl("loglinear_attn", impl, LOGLINEAR_ATTN_FORMS, q)
    scale = resolve_scale(scale, K)
    return run_varlen(_per_sequence(fn), (q, k, v, lam, g, beta), cu_seqlens, initial_state, output_final_state, scale=scale)


__all__ = [
    "LOGLINEAR_ATTN_FORMS",
    "LogLinearState",
    "combine_levels",
    "loglinear_attn",
    "loglinear_attn_chunk",
    "loglinear_attn_naive",
    "loglinear_attn_recurrent",
    "loglinear_attn_scan",
    "loglinear_attn_step",
    "widen_levels",
]
