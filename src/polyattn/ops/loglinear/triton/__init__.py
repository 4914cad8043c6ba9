"""Triton kernels of `loglinear_attn` for the Mamba-2 base (`beta=None`), the forward of the Gated
DeltaNet base (`beta` given) and the decoding step of both: the only package of ops/loglinear that
imports triton.

Files by stage (on the shared core ops/triton, linear attention's chunk product and the delta rule's
WY stage): level_pass.py (the intra-chunk level-masked block and every chunk-level in one walk per
sequence, with its PyTorch twin), gdn.py (log-linear Gated DeltaNet: the per-chunk block and the walk
of its chunk-levels, with their twin), step.py (the decoding step), function.py (custom ops for the
forward and backward passes, dg, dlam, and the translation between `LogLinearState` and the kernels'
per-chunk-level states). Importing this package does not import triton: the entry point loads the
kernels on first call.
"""
from __future__ import annotations


def loglinear_attn_triton(q, k, v, lam, g=None, *, beta=None, scale, initial_state=None, output_final_state=False, cu_seqlens=None):
    """Triton form of `loglinear_attn` (handles `cu_seqlens` natively); see function.py.

    Both bases in full (log-linear Mamba-2; with `beta` log-linear Gated DeltaNet): any initial state,
    the final state on request, gradients through all of them, and the one-token decoding step.
    """
    from .function import loglinear_attn_fused

    return loglinear_attn_fused(
        q, k, v, lam, g, beta=beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
    )


loglinear_attn_triton.native_varlen = True

__all__ = ["loglinear_attn_triton"]
