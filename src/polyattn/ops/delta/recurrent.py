"""The (gated) delta rule token by token: the decoding form.

    S_t = exp(g_t) (I - β_t k_t k_t^T) S_{t-1} + β_t k_t v_t^T,        o_t = S_t^T (scale q_t)
"""

from __future__ import annotations

import torch

from polyattn.ops.common import compute_dtype


def delta_rule_step(q, k, v, beta, g, state, *, scale):
    """One token: ``q, k: [B, H, K]``, ``v: [B, H, V]``, ``beta: [B, H]``, ``g: [B, H]`` or None, ``state: [B, H, K, V]``.

    Returns ``(o [B, H, V], new_state)``; the state is not modified in place.
    """
    if g is not None:
        state = torch.exp(g)[..., None, None] * state
    read = (k[..., None, :] @ state).squeeze(-2)  # [B, H, 1, K] @ [B, H, K, V] -> [B, H, V]
    state = state + k[..., :, None] * (beta[..., None] * (v - read))[..., None, :]  # rank-1 update, [B, H, K, V]
    o = ((scale * q)[..., None, :] @ state).squeeze(-2)  # [B, H, 1, K] @ [B, H, K, V] -> [B, H, V]
    return o, state


def delta_rule_recurrent(q, k, v, beta, g=None, *, scale, initial_state=None, output_final_state=False):
    """The recurrence over every token. Returns ``(o [B,T,H,V], final_state [B,H,K,V] | None)``."""
    out_dtype, dt = q.dtype, compute_dtype(q)
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v, beta = (x.to(dt) for x in (q, k, v, beta))
    g = None if g is None else g.to(dt)
    state = torch.zeros(B, H, K, V, dtype=dt, device=q.device) if initial_state is None else initial_state.to(dt)
    outputs = []
    for t in range(T):
        o_t, state = delta_rule_step(q[:, t], k[:, t], v[:, t], beta[:, t], None if g is None else g[:, t], state, scale=scale)
        outputs.append(o_t)
    o = torch.stack(outputs, dim=1).to(out_dtype)  # T x [B, H, V] -> [B, T, H, V]
    return o, (state if output_final_state else None)
