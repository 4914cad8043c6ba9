"""``ops.hla``: higher-order linear attention (second order, asymmetric AHLA, third order), exact forms."""

from __future__ import annotations

import torch

from polyattn.ops.common import check_flag, check_inputs, check_positive, resolve_impl, resolve_scale, run_varlen
from polyattn.ops.hla.chunk import compose_linear_attn, hla_chunk, hla_from_linear_attn
from polyattn.ops.hla.naive import hla_naive
from polyattn.ops.hla.recurrent import hla_recurrent, hla_step
from polyattn.ops.hla.scan import hla_scan
from polyattn.ops.hla.triton import hla_triton  # composes the Triton linear_attn; triton loads on first call
from polyattn.ops.hla.variants import AHLAState, HLA2State, HLA3State, check_hla_state, resolve_variant

HLA_FORMS = {
    "naive": hla_naive,
    "recurrent": hla_recurrent,
    "chunk": hla_chunk,
    "scan": hla_scan,
    "triton": hla_triton,
}


def hla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    *,
    order: int = 2,
    asymmetric: bool = False,
    normalize: bool = False,
    eps: float = 1e-6,
    scale: float | None = None,
    initial_state: HLA2State | AHLAState | HLA3State | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    impl: str = "auto",
):
    """Higher-order linear attention as compositions of causal linear attention ``LA`` (ops/hla/README.md).

    - ``order=2``: masked HLA2, ``O = LA(Q, LA(Q, K, K; g), V; 2g)``.
    - ``order=2, asymmetric=True``: AHLA, ``O = LA(Q, K, LA(Q, K, V; g); g)``.
    - ``order=3``: masked ``W Wᵀ W``, ``O = LA(Q, LA(Q, K, K; g), LA(Q, K, V; g); 3g)``.

    Outputs are polynomial in q (``scale²`` or ``scale³``) and grow with t (ops/hla/README.md, "Output growth"); with
    ``normalize=True`` the output is ``num / (den + eps)`` with ``den`` the same composition on a ones
    column. That needs **nonnegative q and k** (a positive feature map applied by the caller): with
    signed features ``den`` changes sign and the ratio blows up. Nothing checks this for you.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H]`` log-decay ``<= 0`` or None.
        order: 2 or 3. asymmetric: AHLA (order 2 only). normalize, eps: see above.
        scale: multiplies q; default ``K ** -0.5``.
        initial_state: the variant's state (``HLA2State(S, F)``, ``AHLAState(P, E)``, ``HLA3State(S, P, F)``),
            fields ``[N, H, K, K]`` or ``[N, H, K, V']`` with ``V' = V + 1`` when normalized. Any form's
            ``final_state`` continues in any other form.
        output_final_state: also return the state after the last token (fp32; float64 for float64 inputs).
        cu_seqlens: int64 ``[N + 1]`` offsets of packed sequences (B must be 1).
        impl: ``"naive" | "recurrent" | "chunk" | "scan" | "auto"`` (chunk on CPU).

    Returns:
        ``(o [B, T, H, V] in q's dtype, final_state or None)``.
    """
    variant = resolve_variant(order, asymmetric)
    d = check_inputs(q, k, v, g, cu_seqlens, output_final_state)
    check_flag("normalize", normalize)
    eps = check_positive("eps", eps)
    if initial_state is not None:
        check_hla_state(variant, initial_state, d.N, d.H, d.K, d.V, normalize, q)
    fn = resolve_impl("hla", impl, HLA_FORMS, q)
    return run_varlen(
        fn, (q, k, v, g), cu_seqlens, initial_state, output_final_state, decay_index=3, neutral_padding=True,
        order=order, asymmetric=asymmetric, normalize=normalize, eps=eps, scale=resolve_scale(scale, d.K),
    )


__all__ = [
    "AHLAState",
    "HLA2State",
    "HLA3State",
    "HLA_FORMS",
    "compose_linear_attn",
    "hla",
    "hla_chunk",
    "hla_from_linear_attn",
    "hla_naive",
    "hla_recurrent",
    "hla_scan",
    "hla_step",
]
