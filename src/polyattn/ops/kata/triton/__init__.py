"""Triton kernels of `kata`: the only package of ops/kata that imports triton.

Files by stage (on the shared core ops/triton: precision helpers, tile tables, chunk decay):
tiles.py (grouped loads, squared group scores and their gradient, diagonal decay tiles),
forward.py (the flash-style quadratic forward), backward.py (dq pass over key tiles, dk/dv pass
over query tiles), function.py (custom ops, autograd, the host's state read and write). Each
kernel file holds its PyTorch twin (`*_ref`). Importing this package does not import triton: the
entry point loads the kernels on first call, so CPU-only installs never need it.
"""
from __future__ import annotations


def kata_triton_parallel(
    q, k, v, g=None, *, feature="psd", groups=1, combine="concat", normalize=True, eps=1e-6, scale,
    initial_state=None, output_final_state=False, cu_seqlens=None,
):
    """Triton flash-style quadratic form of `kata` (PSD maps, `groups` a power of two; handles
    `cu_seqlens` natively); see function.py."""
    if feature != "psd":
        raise ValueError(f"impl='triton_parallel': the Triton kernels compute feature='psd', got feature={feature!r}")
    if groups & (groups - 1):
        raise ValueError(f"impl='triton_parallel': expected groups a power of two, got groups = {groups}")
    from .function import kata_parallel_fused

    return kata_parallel_fused(
        q, k, v, g, groups=groups, combine=combine, normalize=normalize, eps=eps, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
    )


kata_triton_parallel.native_varlen = True

__all__ = ["kata_triton_parallel"]
