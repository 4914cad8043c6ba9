"""KATA and DeltaKATA token by token: the decoding form (ops/kata/README.md, "Normalized KATA", "DeltaKATA").

KATA is linear attention on lifted features with an all-ones value column for the normaliser:

    [S | z]_t = exp(g_t) [S | z]_{t−1} + ψ(k_t) [v_t | 1]ᵀ,      o_t = S_tᵀ ψ(scale q_t) / max(z_t·ψ(scale q_t), eps)

DeltaKATA is the gated delta rule on unit lifted keys ψ̂_t = ψ(k_t) / max(‖ψ(k_t)‖, eps), read with
ψ(scale q_t). Both reuse the first-order recurrences (``ops.linear``, ``ops.delta``) on the lifted
features; per token they cost O(P·V), P the feature dimension.
"""

from __future__ import annotations

import torch

from polyattn.ops.common import compute_dtype
from polyattn.ops.delta.recurrent import delta_rule_recurrent
from polyattn.ops.kata.feature_maps import make_feature_map
from polyattn.ops.kata.state import join_state, normalized_read, split_state, with_ones
from polyattn.ops.linear.recurrent import linear_attn_recurrent


def lifted_linear_attn(linear_form, q, k, v, g, *, fmap, normalize, eps, scale, dtype, initial_state, output_final_state, **options):
    """KATA as linear attention of ψ(scale·q), ψ(k) on the values ``[v | 1]`` (the last column the
    normaliser), run by ``linear_form`` (a ``linear_attn`` form) in ``dtype``; ``options`` go to it.
    Returns ``(o [B,T,H,V] in q's dtype, KataState | None)``."""
    psi_q, psi_k = fmap.lift(scale * q.to(dtype)), fmap.lift(k.to(dtype))  # [B, T, H, K] -> [B, T, H, P]
    out, state = linear_form(
        psi_q, psi_k, with_ones(v.to(dtype)), None if g is None else g.to(dtype), scale=1.0,
        initial_state=join_state(initial_state, dtype), output_final_state=output_final_state, **options,
    )  # out: [B, T, H, V + 1], state: [B, H, P, V + 1]
    o = normalized_read(out, normalize, eps).to(q.dtype)  # [B, T, H, V]
    return o, (split_state(state) if output_final_state else None)


def lifted_delta_rule(delta_form, q, k, v, beta, g, *, fmap, eps, scale, dtype, initial_state, output_final_state, **options):
    """DeltaKATA as the gated delta rule on the unit lifted keys ψ̂ = ψ(k) / max(‖ψ(k)‖, eps), read
    with ψ(scale·q), run by ``delta_form`` (a ``delta_rule`` form) in ``dtype``; ``options`` go to it.
    Returns ``(o [B,T,H,V] in q's dtype, S [N,H,P,V] | None)``."""
    psi_q, psi_k = fmap.lift(scale * q.to(dtype)), fmap.lift(k.to(dtype))  # [B, T, H, K] -> [B, T, H, P]
    unit_k = psi_k / torch.linalg.vector_norm(psi_k, dim=-1, keepdim=True).clamp_min(eps)  # ψ̂: [B, T, H, P]
    o, state = delta_form(
        psi_q, unit_k, v.to(dtype), beta.to(dtype), None if g is None else g.to(dtype), scale=1.0,
        initial_state=initial_state, output_final_state=output_final_state, **options,
    )
    return o.to(q.dtype), state


def kata_recurrent(
    q, k, v, g=None, *, feature="psd", groups=1, combine="concat", normalize=True, eps=1e-6, scale,
    initial_state=None, output_final_state=False,
):
    """The (S, z) recurrence over every token. Returns ``(o [B,T,H,V], KataState | None)``."""
    return lifted_linear_attn(
        linear_attn_recurrent, q, k, v, g, fmap=make_feature_map(feature, q.shape[-1], groups, combine),
        normalize=normalize, eps=eps, scale=scale, dtype=compute_dtype(q), initial_state=initial_state,
        output_final_state=output_final_state,
    )


def deltakata_recurrent(
    q, k, v, beta, g=None, *, feature="psd", groups=1, combine="concat", eps=1e-6, scale,
    initial_state=None, output_final_state=False,
):
    """The lifted gated delta rule over every token. Returns ``(o [B,T,H,V], S [B,H,P,V] | None)``."""
    return lifted_delta_rule(
        delta_rule_recurrent, q, k, v, beta, g, fmap=make_feature_map(feature, q.shape[-1], groups, combine),
        eps=eps, scale=scale, dtype=compute_dtype(q), initial_state=initial_state, output_final_state=output_final_state,
    )
