"""HLA as 2 or 3 chunked linear-attention calls (ops/hla/README.md, "Chunkwise algorithm").

    hla2   Y = LA(Q, K, K; g);                       O = LA(Q, Y, V; 2g)
    ahla   Z = LA(Q, K, V; g);                       O = LA(Q, K, Z; g)
    hla3   Y = LA(Q, K, K; g);  Z = LA(Q, K, V; g);  O = LA(Q, Y, Z; 3g)

Why this is exact: ``LA(Q, K, V; g)_t = Σ_{j<=t} exp(g_{j+1..t}) (q_t·k_j) v_j``, so ``y_j = Σ_{i<=j}
exp(g_{i+1..j}) (q_j·k_i) k_i`` and ``LA(Q, Y, V; 2g)_t = Σ_{j<=t} Σ_{i<=j} exp(2 g_{j+1..t} + g_{i+1..j})
(q_t·k_i)(q_j·k_i) v_j`` — the masked index set ``i <= j <= t`` with the decay ``γ^{2t-i-j}``, term for term
(README, "Why the composition is exact"). The same expansion gives AHLA and HLA3. Each call's state is one
field of the HLA state and each call's chunk algorithm is the one of ``linear_attn``, so the per-chunk work
of the chunkwise algorithm is exactly two (three) chunked linear attentions with Y (and Z) materialised in
fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from polyattn.ops.hla.variants import Variant, finish_output, prepare
from polyattn.ops.linear.chunk import linear_attn_chunk


def compose_linear_attn(linear_attn_fn: Callable, variant: Variant, q, k, v, g, initial_state, output_final_state):
    """Run the variant's calls with ``linear_attn_fn(q, k, v, g, *, scale, initial_state, output_final_state)``.

    ``q`` is already scaled, ``v`` already carries the ones column when normalized and ``initial_state``
    is the variant's state (zeros for a fresh start). Returns
    ``(o [B, T, H, V'] un-normalized, final_state or None)``.
    """
    env = {"k": k, "v": v}
    finals = []
    for call, h0 in zip(variant.calls, initial_state):
        decay = None if g is None else call.decay * g
        env[call.out], final = linear_attn_fn(
            q, env[call.key], env[call.value], decay, scale=1.0, initial_state=h0, output_final_state=output_final_state
        )
        finals.append(final)
    return env["o"], (variant.state(*finals) if output_final_state else None)


def hla_from_linear_attn(
    linear_attn_fn: Callable, q, k, v, g=None, *, order=2, asymmetric=False, normalize=False, eps=1e-6, scale,
    initial_state=None, output_final_state=False,
):
    """HLA from any linear-attention form with the ``linear_attn`` form signature (chunk, scan, Triton).

    The inputs are cast to the compute dtype (fp32, or float64) before the first call, so the
    intermediates Y and Z — the next call's keys and values — stay fp32 (ops/hla/README.md, "Precision").
    """
    variant, q, k, v, g, h0, out_dtype = prepare(
        q, k, v, g, order=order, asymmetric=asymmetric, normalize=normalize, scale=scale, initial_state=initial_state
    )  # compute dtype; v: [B, T, H, V']
    o, final = compose_linear_attn(linear_attn_fn, variant, q, k, v, g, h0, output_final_state)
    return finish_output(o, normalize, eps, out_dtype), final


def hla_chunk(
    q, k, v, g=None, *, order=2, asymmetric=False, normalize=False, eps=1e-6, scale,
    initial_state=None, output_final_state=False, chunk_size=64,
):
    """Chunkwise HLA. Returns ``(o [B, T, H, V], final_state or None)``."""
    return hla_from_linear_attn(
        partial(linear_attn_chunk, chunk_size=chunk_size), q, k, v, g, order=order, asymmetric=asymmetric,
        normalize=normalize, eps=eps, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
    )
