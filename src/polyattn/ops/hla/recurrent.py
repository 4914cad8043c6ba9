"""HLA token by token: the subtraction-free streaming state (the decoding form).

Each token runs the variant's linear-attention calls in order (:mod:`polyattn.ops.hla.variants`), every
call one :func:`~polyattn.ops.linear.recurrent.linear_attn_step`. Spelled out (q already scaled,
a_t = exp(g_t); the NEW state is read right after its update — ops/hla/README.md, "Update order"):

    hla2 (F-form)              S = a S + k kᵀ;  y = Sᵀ q;  F = a² F + y vᵀ;  o = Fᵀ q
    ahla                       P = a P + k vᵀ;  z = Pᵀ q;  E = a E + k zᵀ;   o = Eᵀ q
    hla3                       S = a S + k kᵀ;  y = Sᵀ q;  P = a P + k vᵀ;  z = Pᵀ q;  F = a³ F + y zᵀ;  o = Fᵀ q

With ``normalize=True`` v carries a ones column, so F's last column is f (hla2) and P's, E's are m, n (ahla).
Cost per token O(K² + K·V) (ahla: O(K·V)); no product of two state matrices, no subtraction.
"""

from __future__ import annotations

import torch

from polyattn.ops.hla.variants import Variant, finish_output, prepare
from polyattn.ops.linear.recurrent import linear_attn_step


def hla_step(variant: Variant, q, k, v, g, state):
    """One token for a batch: ``q, k: [B, H, K]`` (q scaled), ``v: [B, H, V']``, ``g: [B, H]`` or None.

    Returns ``(o [B, H, V'], new_state)`` (un-normalized: the last column is the denominator when v has
    the ones column).
    """
    env = {"k": k, "v": v}
    fields = []
    for call, field in zip(variant.calls, state):
        decay = None if g is None else call.decay * g
        env[call.out], field = linear_attn_step(q, env[call.key], env[call.value], decay, field, scale=1.0)
        fields.append(field)
    return env["o"], variant.state(*fields)


def hla_recurrent(
    q, k, v, g=None, *, order=2, asymmetric=False, normalize=False, eps=1e-6, scale,
    initial_state=None, output_final_state=False,
):
    """The streaming recurrence over every token. Returns ``(o [B, T, H, V], final_state or None)``."""
    variant, q, k, v, g, state, out_dtype = prepare(
        q, k, v, g, order=order, asymmetric=asymmetric, normalize=normalize, scale=scale, initial_state=initial_state
    )  # compute dtype; v: [B, T, H, V']
    outputs = []
    for t in range(q.shape[1]):
        o_t, state = hla_step(variant, q[:, t], k[:, t], v[:, t], None if g is None else g[:, t], state)
        outputs.append(o_t)
    o = torch.stack(outputs, dim=1)  # T x [B, H, V'] -> [B, T, H, V']
    return finish_output(o, normalize, eps, out_dtype), (state if output_final_state else None)
