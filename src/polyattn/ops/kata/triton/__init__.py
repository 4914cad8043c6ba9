"""Triton kernels of `kata`: the only package of ops/kata that imports triton.

Files by stage (on the shared core ops/triton: precision helpers, tile tables, chunk decay):
tiles.py (grouped loads, squared group scores and their gradient, diagonal decay tiles),
forward.py (the flash-style quadratic forward), backward.py (dq pass over key tiles, dk/dv pass
over query tiles), chunk.py (the chunked form's lifted states, their read and the backward's reverse walk and lift gradient), function.py (custom ops, autograd, the host's state read and write), algebra.py (DeltaKATA's chunk-local `[C, C]`
algebra: the UT inverse, the in-chunk scores and their rows), delta.py (DeltaKATA's chunked walk, its custom ops and
chunk-local coefficients), step.py
(the fused one-token decoding step). Each
kernel file holds its PyTorch twin (`*_ref`). The first-order maps need no kernel of their own:
`kata_triton_first_order` runs them on linear attention's. Importing this package does not import
triton: the entry points load the kernels on first call, so CPU-only installs never need it.
"""
from __future__ import annotations

import torch

from polyattn.ops.kata.feature_maps import make_feature_map
from polyattn.ops.kata.recurrent import lifted_delta_rule, lifted_linear_attn

DELTA_MAX_FEATURES = 128  # the widest key the delta-rule kernels run (and are tested at) on the H200


def fused_step(step, tokens: tuple, state, cu_seqlens, output_final_state: bool, **options):
    """A one-token call without gradients (decoding) on `step` (step.py): `step(*tokens at their token,
    state, **options)` as `(o [B, 1, H, V], new state or None)`; None for any other call. tokens: the
    per-token tensors `(q, k, v, ..., g)`, g may be None; state: a KataState, a tensor or None."""
    from polyattn.ops.common import one_token_step
    from polyattn.ops.triton.precision import check_kernel_inputs

    q = tokens[0]
    if not q.numel() or not one_token_step(q, cu_seqlens, (*tokens, state)):
        return None
    check_kernel_inputs(q)
    o, new = step(*(None if x is None else x[:, 0] for x in tokens), state, **options)
    return o[:, None], (new if output_final_state else None)  # [B, H, V] -> [B, 1, H, V]


def psd_kernels(impl: str, fused: str, q, k, v, g, *, feature, groups, combine, normalize, eps, scale,
                initial_state, output_final_state, cu_seqlens):
    """The PSD maps' Triton forms: one token per sequence without gradients (decoding) runs the fused step of
    step.py, for any `groups`; everything else `function.<fused>`, for `groups` a power of two."""
    if feature != "psd":
        raise ValueError(f"impl={impl!r}: the Triton kernels compute feature='psd', got feature={feature!r}")
    from . import function, step

    decoded = fused_step(step.kata_step, (q, k, v, g), initial_state, cu_seqlens, output_final_state,
                         groups=groups, combine=combine, normalize=normalize, eps=eps, scale=scale)
    if decoded is not None:
        return decoded
    if groups & (groups - 1):
        raise ValueError(f"impl={impl!r}: expected groups a power of two, got groups = {groups}")
    return getattr(function, fused)(
        q, k, v, g, groups=groups, combine=combine, normalize=normalize, eps=eps, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
    )


def kata_triton_parallel(q, k, v, g=None, *, feature="psd", groups=1, combine="concat", normalize=True, eps=1e-6, scale,
                         initial_state=None, output_final_state=False, cu_seqlens=None):
    """Triton flash-style quadratic form of `kata` (PSD maps, `groups` a power of two; handles
    `cu_seqlens` natively; see function.py); one token per sequence without gradients (decoding)
    runs the fused step of step.py instead, for any `groups`."""
    return psd_kernels("triton_parallel", "kata_parallel_fused", q, k, v, g, feature=feature, groups=groups, combine=combine,
                       normalize=normalize, eps=eps, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, cu_seqlens=cu_seqlens)


kata_triton_parallel.native_varlen = True


def kata_triton_chunk(q, k, v, g=None, *, feature="psd", groups=1, combine="concat", normalize=True, eps=1e-6, scale,
                      initial_state=None, output_final_state=False, cu_seqlens=None):
    """Triton chunked lifted-state form of `kata` (PSD maps, `groups` a power of two, forward and backward;
    handles `cu_seqlens` natively; see chunk.py): cost linear in T. One token per sequence without gradients
    (decoding) runs the fused step of step.py."""
    return psd_kernels("triton_chunk", "kata_chunk_fused", q, k, v, g, feature=feature, groups=groups, combine=combine,
                       normalize=normalize, eps=eps, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, cu_seqlens=cu_seqlens)


kata_triton_chunk.native_varlen = True


def kata_triton_first_order(
    q, k, v, g=None, *, feature, groups=1, combine="concat", normalize=True, eps=1e-6, scale,
    initial_state=None, output_final_state=False, cu_seqlens=None,
):
    """KATA with a first-order map (orthant, Lorentz: ψ as wide as the head, P = K) on the Triton
    kernels of `linear_attn`: linear attention of the lifted queries ψ(scale·q) and keys ψ(k) (built
    by PyTorch, which differentiates them) on the values `[v | 1]`, whose last column is the
    normaliser; the state `[S | z]` is linear attention's `[P, V + 1]` state. Everything enters in
    fp32 (IEEE products) and o is rounded once, after the division: lifted features rounded to bf16
    exceed twice the PyTorch chunk form's error (ops/kata/README.md, "First-order maps on the linear
    kernels"). Returns `(o [B, T, H, V] in q's dtype, KataState fp32 or None)`."""
    from polyattn.ops.linear.triton import linear_attn_triton

    if feature == "psd":
        raise ValueError("kata_triton_first_order: expected a first-order feature ('orthant', 'lorentz'); psd runs on kata_triton_parallel")
    return lifted_linear_attn(
        linear_attn_triton, q, k, v, g, fmap=make_feature_map(feature, q.shape[-1], groups, combine),
        normalize=normalize, eps=eps, scale=scale, dtype=torch.float32, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
    )


kata_triton_first_order.native_varlen = True


def chunk_pays(q, k, v, g, *, groups=1, combine="concat", initial_state=None, cu_seqlens=None, **_) -> bool:
    """Whether `impl="triton"` runs a PSD call on the chunked form, with or without gradients: `K / groups` a
    power of two >= 4 and the longest sequence at least `KernelConfig.kata_chunk_crossover · (P + 1024)`
    tokens, where the quadratic kernel's T² work overtakes the chunked form's (ops/kata/README.md, "Chunked
    Triton kernel": on the H200 the forward crosses over near 11K tokens for M2 and 21K for M1, the forward
    + backward near 8K and 23K)."""
    from polyattn.ops.triton.plan import get_config, sequence_lengths

    if not chunk_kernels_fit(q.shape[-1], groups):
        return False
    P = make_feature_map("psd", q.shape[-1], groups, combine).dim()
    return max(sequence_lengths(cu_seqlens, *q.shape[:2]), default=0) >= get_config().kata_chunk_crossover * (P + 1024)


def kata_triton(q, k, v, g=None, *, feature="psd", **options):
    """`impl="triton"`: for the PSD maps the quadratic kernel, or the chunked form where `chunk_pays`;
    linear attention's kernels for the first-order maps."""
    if feature != "psd":
        return kata_triton_first_order(q, k, v, g, feature=feature, **options)
    form = kata_triton_chunk if chunk_pays(q, k, v, g, **options) else kata_triton_parallel
    return form(q, k, v, g, feature=feature, **options)


kata_triton.native_varlen = True


def deltakata_triton_chunk(
    q, k, v, beta, g=None, *, feature="psd", groups=1, combine="concat", eps=1e-6, scale,
    initial_state=None, output_final_state=False, cu_seqlens=None,
):
    """Triton chunked form of DeltaKATA for the PSD maps (`K / groups` a power of two >= 16; forward and
    backward; handles `cu_seqlens` natively; see delta.py): the kernel-trick UT recurrence, ψ never built,
    cost linear in T. One token per sequence without gradients (decoding) runs the fused step of step.py.
    Returns `(o [B, T, H, V] in q's dtype, S [N, H, P, V] fp32 or None)`."""
    if feature != "psd":
        raise ValueError(f"impl='triton_chunk': DeltaKATA's chunked kernels compute feature='psd', got feature={feature!r}")
    from . import delta, step

    decoded = fused_step(step.deltakata_step, (q, k, v, beta, g), initial_state, cu_seqlens, output_final_state,
                         groups=groups, combine=combine, eps=eps, scale=scale)
    if decoded is not None:
        return decoded
    return delta.deltakata_chunk_fused(q, k, v, beta, g, groups=groups, combine=combine, eps=eps, scale=scale,
                                       initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens)


deltakata_triton_chunk.native_varlen = True


def chunk_kernels_fit(K: int, groups: int, smallest: int = 4) -> bool:
    """Whether the chunked PSD kernels take a head of width K in `groups` groups: `K / groups` a power of two of at
    least `smallest` (DeltaKATA's: 16, the narrowest tensor-core product of the lift-gradient kernel on the GPU)."""
    E = K // groups
    return E >= smallest and not E & (E - 1)


def deltakata_triton(
    q, k, v, beta, g=None, *, feature="psd", groups=1, combine="concat", eps=1e-6, scale,
    initial_state=None, output_final_state=False, cu_seqlens=None,
):
    """`impl="triton"` for DeltaKATA: the PSD maps on the chunked kernels (`deltakata_triton_chunk`) where
    `K / groups` is a power of two >= 16; the first-order maps, and PSD maps of other widths up to
    DELTA_MAX_FEATURES lifted features, on the Triton kernels of `delta_rule` (the gated delta rule on the
    unit lifted keys ψ̂(k), read with ψ(scale·q), in fp32 like `kata_triton_first_order`). Returns
    `(o [B, T, H, V] in q's dtype, S [N, H, P, V] fp32 or None)`."""
    from polyattn.ops.delta.triton import delta_rule_triton

    options = dict(feature=feature, groups=groups, combine=combine, eps=eps, scale=scale, initial_state=initial_state,
                   output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    if feature == "psd" and chunk_kernels_fit(q.shape[-1], groups, 16):
        return deltakata_triton_chunk(q, k, v, beta, g, **options)
    fmap = make_feature_map(feature, q.shape[-1], groups, combine)
    if feature == "psd":
        from . import step

        decoded = fused_step(step.deltakata_step, (q, k, v, beta, g), initial_state, cu_seqlens, output_final_state,
                             groups=groups, combine=combine, eps=eps, scale=scale)
        if decoded is not None:
            return decoded
    if fmap.dim() > DELTA_MAX_FEATURES:
        raise ValueError(
            f"impl='triton': DeltaKATA runs PSD maps with K / groups a power of two >= 16 on its chunked kernels and "
            f"others on the delta-rule kernels, at most {DELTA_MAX_FEATURES} lifted features; got P = {fmap.dim()} "
            f"(feature={feature!r}, K = {q.shape[-1]}, groups = {groups}; one-token decoding without gradients "
            f"takes any P); use impl='chunk'"
        )
    return lifted_delta_rule(
        delta_rule_triton, q, k, v, beta, g, fmap=fmap, eps=eps, scale=scale, dtype=torch.float32,
        initial_state=None if initial_state is None else initial_state.float(), output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
    )


deltakata_triton.native_varlen = True

__all__ = ["DELTA_MAX_FEATURES", "chunk_kernels_fit", "chunk_pays", "deltakata_triton", "deltakata_triton_chunk", "kata_triton", "kata_triton_chunk", "kata_triton_first_order", "kata_triton_parallel"]
