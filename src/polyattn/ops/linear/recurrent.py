"""Causal linear attention, token by token: the decoding form.

    S_t = exp(g_t) S_{t-1} + k_t v_t^T,        o_t = S_t^T (scale q_t)
"""

from __future__ import annotations

import torch

from polyattn.ops.common import compute_dtype


def linear_attn_step(q, k, v, g, state, *, scale):
    """One token for a batch: ``q, k: [B, H, K]``, ``v: [B, H, V]``, ``g: [B, H]`` or None, ``state: [B, H, K, V]``.

    Returns ``(o [B, H, V], new_state)``; the state is not modified in place.
    """
    if g is not None:
        state = torch.exp(g)[..., None, None] * state
    state = state + k[..., :, None] * v[..., None, :]  # [B, H, K, 1] * [B, H, 1, V] -> [B, H, K, V]
    o = ((scale * q)[..., None, :] @ state).squeeze(-2)  # [B, H, 1, K] @ [B, H, K, V] -> [B, H, V]
    return o, state


def linear_attn_recurrent(q, k, v, g=None, *, scale, initial_state=None, output_final_state=False):
    """The recurrence over every token. Returns ``(o [B,T,H,V], final_state [B,H,K,V] | None)``."""
    out_dtype, dt = q.dtype, compute_dtype(q)
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v = (x.to(dt) for x in (q, k, v))
    g = None if g is None else g.to(dt)
    state = torch.zeros(B, H, K, V, dtype=dt, device=q.device) if initial_state is None else initial_state.to(dt)
    outputs = []
    for t in range(T):
        o_t, state = linear_attn_step(q[:, t], k[:, t], v[:, t], None if g is None else g[:, t], state, scale=scale)
        outputs.append(o_t)
    o = torch.stack(outputs, dim=1).to(out_dtype)  # T x [B, H, V] -> [B, T, H, V]
    return o, (state if output_final_state else None)
