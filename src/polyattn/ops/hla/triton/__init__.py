"""`ops.hla(..., impl="triton")`: HLA composed from the Triton `linear_attn` (2 or 3 calls).

Numerics (ops/README.md, "Numerics policy"; ops/hla/README.md, "Precision"): inside each call states
and accumulators are fp32; the intermediates Y = LA(Q, K, K) and Z = LA(Q, K, V) are written in the
input dtype (bf16 inputs: bf16 Y/Z, one rounding per element, ~2^-9 relative) so the next call runs
on the bf16 tensor cores. Use `impl="chunk"` for fp32 intermediates; fp32 inputs keep everything
fp32 here. `cu_seqlens` is handled natively by every call; gradients flow through all calls by the
Triton autograd Function. This module does not import triton itself.
"""
from __future__ import annotations

from polyattn.ops.hla.chunk import compose_linear_attn
from polyattn.ops.hla.variants import finish_output, prepare_for_kernels
from polyattn.ops.linear.triton import linear_attn_triton


def hla_triton(
    q, k, v, g=None, *, order=2, asymmetric=False, normalize=False, eps=1e-6, scale,
    initial_state=None, output_final_state=False, cu_seqlens=None,
):
    """Triton HLA (same arguments as `hla_chunk`, plus native `cu_seqlens`).

    Returns `(o [B, T, H, V] in q's dtype, final_state or None)`; each call gets the unscaled
    q and `scale`, so q is never rounded after scaling.
    """
    variant, v, g, states = prepare_for_kernels(
        v, g, order=order, asymmetric=asymmetric, normalize=normalize, initial_state=initial_state
    )  # v: [B, T, H, V'] (V' = V + 1 when normalized)
    query_scale = scale

    def call(a, b, c, decay, *, scale: float, initial_state, output_final_state):
        del scale  # compose_linear_attn passes 1.0 for a pre-scaled q; here q is not pre-scaled
        return linear_attn_triton(
            a, b, c, decay, scale=query_scale, initial_state=initial_state,
            output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        )

    o, final = compose_linear_attn(call, variant, q, k, v, g, states, output_final_state)
    return finish_output(o, normalize, eps, q.dtype), final


hla_triton.native_varlen = True

__all__ = ["hla_triton"]
