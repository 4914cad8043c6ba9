"""``ops.kata``: kernelized linear attention with symmetric-cone feature maps, and DeltaKATA (ops/kata/README.md)."""

from __future__ import annotations

import torch

from polyattn.ops.common import check_flag, check_inputs, check_positive, check_state, one_token_step, resolve_impl, resolve_scale, run_varlen
from polyattn.ops.kata.chunk import deltakata_chunk, kata_chunk
from polyattn.ops.kata.feature_maps import FEATURE_MAPS, kata_state_size, make_feature_map
from polyattn.ops.kata.gate import kata_convex_gate
from polyattn.ops.kata.naive import deltakata_naive, kata_naive
from polyattn.ops.kata.parallel import kata_parallel
from polyattn.ops.kata.recurrent import deltakata_recurrent, kata_recurrent
from polyattn.ops.kata.scan import kata_scan
from polyattn.ops.kata.state import KataState
from polyattn.ops.kata.triton import chunk_kernels_fit, deltakata_triton, deltakata_triton_chunk, kata_triton, kata_triton_chunk, kata_triton_first_order, kata_triton_parallel  # lazy: triton loads on first call

KATA_FORMS = {
    "naive": kata_naive,
    "recurrent": kata_recurrent,
    "chunk": kata_chunk,
    "scan": kata_scan,
    "parallel": kata_parallel,
    "triton_parallel": kata_triton_parallel,
    "triton_chunk": kata_triton_chunk,
    "triton": kata_triton,  # PSD: the quadratic kernel, or the chunked one past its crossover; first order: linear attention's
}

DELTAKATA_FORMS = {
    "naive": deltakata_naive,
    "recurrent": deltakata_recurrent,
    "chunk": deltakata_chunk,
    "triton": deltakata_triton,  # PSD: the chunked kernels; first-order maps: the delta-rule kernels on lifted keys
    "triton_chunk": deltakata_triton_chunk,
}


def kata_auto_forms(feature: str, decoding: bool, delta: bool = False, groups: int = 1, group_width: int = 16) -> dict:
    """The forms ``impl="auto"`` picks from (on CUDA it takes ``"triton"`` where that is among them).

    PSD maps: every form for a decoding call (one token, no gradient: the fused steps, any groups), for
    KATA with ``groups`` a power of two (the quadratic kernel: T² work, yet 60x faster than the PyTorch
    forms at 2K tokens on the H200 and the one that fits at 8K) and for DeltaKATA with ``group_width``
    (``K / groups``) a power of two >= 16 (its chunked kernels). Otherwise the PyTorch forms: the first-order
    maps' Triton forms run the delta and linear kernels on fp32 lifted features (IEEE fp32 products, not
    yet at speed); ops/kata/README.md, "Triton kernel"."""
    forms = DELTAKATA_FORMS if delta else KATA_FORMS
    fits = chunk_kernels_fit(group_width, 1, 16) if delta else groups & (groups - 1) == 0
    if feature == "psd" and (decoding or fits):
        return forms
    return {n: f for n, f in forms.items() if "triton" not in n}


def kata(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    *,
    feature: str = "psd",
    groups: int = 1,
    combine: str = "concat",
    normalize: bool = True,
    beta: torch.Tensor | None = None,
    eps: float = 1e-6,
    scale: float | None = None,
    initial_state: KataState | torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    impl: str = "auto",
):
    """KATA: scores ``A[t, s] = κ(scale·q_t, k_s)·exp(g_{s+1} + … + g_t)`` with a cone kernel κ ≥ 0.

    ``normalize=True``: ``o_t = Σ_s A[t, s] v_s / max(Σ_s A[t, s], eps)``; ``False``: ``o_t = Σ_s A[t, s] v_s``.
    ``beta`` given: DeltaKATA, the gated delta rule on unit lifted keys ψ(k)/‖ψ(k)‖ with the
    unnormalized read ``o_t = S_tᵀ ψ(scale·q_t)`` (requires ``normalize=False``).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; g: ``[B, T, H]`` log-decay ``<= 0`` or None.
        feature: ``"psd"`` (κ a sum of squared group dots), ``"orthant"`` or ``"lorentz"`` (first order).
        groups: split K into this many groups of ``E = K / groups`` (psd only).
        combine: psd groups ``"concat"`` (KATA-Mg, Σ_i (q_i·k_i)²) or ``"sum"`` (KATA-Σg, Σ_{i,j} (q_i·k_j)²).
        beta: ``[B, T, H]`` write strengths in [0, 1] for DeltaKATA, or None.
        eps: floor of the normaliser (and of ‖ψ(k)‖ in DeltaKATA).
        scale: multiplies q; default ``K ** -0.5``.
        initial_state: ``KataState(S [N, H, P, V], z [N, H, P])``; for DeltaKATA a tensor ``[N, H, P, V]``,
            P = ``make_feature_map(feature, K, groups, combine).dim()``.
        output_final_state: also return the state after the last token (fp32, float64 for float64 inputs).
        cu_seqlens: int64 ``[N + 1]`` offsets of packed sequences (B must be 1).
        impl: KATA ``"naive" | "recurrent" | "chunk" | "scan" | "parallel" | "triton_parallel" | "triton_chunk" | "triton" | "auto"``
            (``"triton_parallel"``: the flash-style quadratic kernel, PSD maps only; ``"triton_chunk"``: the
            chunked lifted-state kernels, PSD maps, forward and backward; ``"triton"``: for PSD maps the quadratic
            kernel, or the chunked one past its crossover length (with or without gradients), and linear
            attention's kernels for the first-order ones; with a PSD map all three run one-token calls without
            gradients on the fused decoding step);
            DeltaKATA ``"naive" | "recurrent" | "chunk" | "triton_chunk" | "triton" | "auto"`` (``"triton_chunk"``:
            the chunked kernel-trick kernels, PSD maps with ``K / groups`` a power of two >= 16, forward and
            backward; ``"triton"``: those for such maps, else the delta-rule kernels on lifted keys, for maps of
            at most 128 features; the fused step for PSD decoding calls).
            ``"auto"`` on CUDA: ``"triton"`` for PSD KATA (``groups`` a power of two), PSD DeltaKATA (``K / groups``
            a power of two >= 16) and PSD decoding calls; the PyTorch forms otherwise (:func:`kata_auto_forms`).

    Returns:
        ``(o [B, T, H, V] in q's dtype, final_state or None)``.
    """
    B, T, H, K, V, N = check_inputs(q, k, v, g, cu_seqlens, output_final_state, beta=beta)
    fmap = make_feature_map(feature, K, groups, combine)
    check_flag("normalize", normalize)
    P = fmap.dim()
    options = dict(feature=feature, groups=groups, combine=combine, eps=check_positive("eps", eps), scale=resolve_scale(scale, K))
    if beta is not None:
        if normalize:
            raise ValueError("beta: DeltaKATA's read is unnormalized; expected normalize=False with beta, got normalize=True")
        if initial_state is not None:
            check_state("initial_state", initial_state, (N, H, P, V), q)
        decoding = one_token_step(q, cu_seqlens, (q, k, v, g, beta, initial_state))
        forms = DELTAKATA_FORMS if impl != "auto" else kata_auto_forms(feature, decoding, delta=True, group_width=K // groups)
        fn = resolve_impl("DeltaKATA", impl, forms, q)
        return run_varlen(fn, (q, k, v, beta, g), cu_seqlens, initial_state, output_final_state, decay_index=4, **options)
    if initial_state is not None:
        if not isinstance(initial_state, KataState):
            raise ValueError(f"initial_state: expected a KataState(S, z), got {type(initial_state).__name__}")
        check_state("initial_state.S", initial_state.S, (N, H, P, V), q)
        check_state("initial_state.z", initial_state.z, (N, H, P), q)
    decoding = one_token_step(q, cu_seqlens, (q, k, v, g, initial_state))
    forms = KATA_FORMS if impl != "auto" else kata_auto_forms(feature, decoding, groups=groups)
    fn = resolve_impl("kata", impl, forms, q)
    # with states, packed sequences run one by one: a padded batch of P×V states is slower (measured, P = 512)
    return run_varlen(fn, (q, k, v, g), cu_seqlens, initial_state, output_final_state, decay_index=3, normalize=normalize, **options)


__all__ = [
    "DELTAKATA_FORMS",
    "FEATURE_MAPS",
    "kata_auto_forms",
    "KATA_FORMS",
    "KataState",
    "deltakata_chunk",
    "deltakata_naive",
    "deltakata_recurrent",
    "deltakata_triton",
    "deltakata_triton_chunk",
    "kata",
    "kata_chunk",
    "kata_convex_gate",
    "kata_naive",
    "kata_parallel",
    "kata_recurrent",
    "kata_scan",
    "kata_state_size",
    "kata_triton",
    "kata_triton_chunk",
    "kata_triton_first_order",
    "kata_triton_parallel",
    "make_feature_map",
]
