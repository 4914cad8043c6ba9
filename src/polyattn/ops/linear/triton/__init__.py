"""Triton kernels of `linear_attn`: the only package of ops/linear that imports triton.

Files by stage (on the shared core ops/triton: precision helpers, segment plan, chunk decay):
chunk_states.py (segment end states + combine), chunk_outputs.py (outputs, state on chip),
launch.py (one pass on the host, the pass vocabulary), function.py (autograd Function: forward and backward
passes, dg), step.py (fused decoding step). Importing this package does not import triton:
the two entry points below load the kernels on first call, so CPU-only installs never need it.
"""
from __future__ import annotations


def linear_attn_triton(q, k, v, g=None, *, scale, initial_state=None, output_final_state=False, cu_seqlens=None):
    """Triton form of `linear_attn` (handles `cu_seqlens` natively); see function.py."""
    from .function import linear_attn_fused

    return linear_attn_fused(
        q, k, v, g, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
    )


linear_attn_triton.native_varlen = True


def linear_attn_step_inplace(q, k, v, g, state, *, scale):
    """Fused decoding step, `state` updated in place; see step.py."""
    from .step import linear_attn_step_inplace as step

    return step(q, k, v, g, state, scale=scale)


__all__ = ["linear_attn_step_inplace", "linear_attn_triton"]
