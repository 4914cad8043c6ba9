"""Triton kernels of `delta_rule`, on the shared core ops/triton.

Files by stage: wy.py (per-chunk UT solve, every chunk in parallel), forward.py (the recurrence
with the state on chip), backward.py (reverse state-gradient recurrence, then per-chunk
gradients), function.py (autograd Function, dg), step.py (fused decoding step). Each kernel
file holds its PyTorch twin (`*_ref`). Importing this package does not import triton: the entry
points load the kernels on first call.
"""
from __future__ import annotations


def delta_rule_triton(q, k, v, beta, g=None, *, scale, initial_state=None, output_final_state=False, cu_seqlens=None):
    """Triton form of `delta_rule` (handles `cu_seqlens` natively); see function.py."""
    from .function import delta_rule_fused

    return delta_rule_fused(
        q, k, v, beta, g, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
    )


delta_rule_triton.native_varlen = True


def delta_rule_step_inplace(q, k, v, beta, g, state, *, scale):
    """Fused decoding step, `state` updated in place; see step.py."""
    from .step import delta_rule_step_inplace as step

    return step(q, k, v, beta, g, state, scale=scale)


__all__ = ["delta_rule_step_inplace", "delta_rule_triton"]
