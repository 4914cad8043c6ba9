"""Log-linear attention token by token: the decoding form (ops/loglinear/README.md, "State and cost per token").

One K×V state per level plus the absolute position ``t`` of each sequence. Per token::

    j = ctz(t);  S[j+1] = S[0] + ... + S[j];  S[0..j] = 0          (t > 0; Fenwick carry, per sequence)
    S[l] = A_t S[l]  for every l                                      (A_t = exp(g_t) (I - β_t k_t k_t^T); exp(g_t) I without beta)
    S[0] = β_t k_t v_t^T                                              (k_t v_t^T without beta)
    o_t  = Σ_l lam[t, l] S[l]^T (scale q_t)

The carry and the transition commute (the transition is linear and the same for every level), and
``Σ_l S[l]`` is the plain Mamba-2 / gated-delta-rule state. Cost per token and head: ``O(L·K·V)``
time and ``L·K·V`` memory, ``L = num_levels`` of the length reached, i.e. ``O(log T)``.
"""

from __future__ import annotations

import torch

from polyattn.ops.common import compute_dtype
from polyattn.ops.loglinear.state import LogLinearState, check_lam_levels, fenwick_carry, initial_levels


def loglinear_attn_step(q, k, v, lam, g, beta, state: LogLinearState, *, scale):
    """One token for a batch: ``q, k: [N, H, K]``, ``v: [N, H, V]``, ``lam: [N, H, L]``, ``g, beta: [N, H]`` or None.

    ``state.levels: [N, H, L, K, V]``, ``state.position: [N]`` (each sequence at its own position). Returns
    ``(o [N, H, V], new_state)``; the state is not modified in place. The caller guarantees
    ``L >= num_levels(position + 1)``.
    """
    position = state.position
    levels = state.levels * (position > 0).to(state.levels.dtype)[:, None, None, None, None]  # position 0: empty
    levels = fenwick_carry(levels, position)  # [N, H, L, K, V]
    if g is not None:
        levels = torch.exp(g)[..., None, None, None] * levels
    if beta is None:
        write = k[..., :, None] * v[..., None, :]  # [N, H, K, 1] * [N, H, 1, V] -> [N, H, K, V]
    else:
        read = torch.einsum("nhk,nhlkv->nhlv", k, levels)  # [N, H, L, V]
        levels = levels - (beta[..., None] * k)[:, :, None, :, None] * read[:, :, :, None, :]  # (I - β k k^T) S[l]
        write = (beta[..., None] * k)[..., :, None] * v[..., None, :]  # [N, H, K, V]
    levels = torch.cat([write[:, :, None], levels[:, :, 1:]], dim=2)  # level 0 (empty after the carry) <- the token
    o = torch.einsum("nhl,nhk,nhlkv->nhv", lam, scale * q, levels)  # Σ_l lam[l] S[l]^T (scale q)
    return o, LogLinearState(levels, position + 1)


def loglinear_attn_recurrent(q, k, v, lam, g=None, *, beta=None, scale, initial_state=None, output_final_state=False):
    """The recurrence over every token. Returns ``(o [B,T,H,V], LogLinearState | None)``."""
    out_dtype, dt = q.dtype, compute_dtype(q)
    B, T, H, K = q.shape
    V, L = v.shape[-1], lam.shape[-1]
    check_lam_levels(L, initial_state, T)
    q, k, v, lam = (x.to(dt) for x in (q, k, v, lam))
    g = None if g is None else g.to(dt)
    beta = None if beta is None else beta.to(dt)
    state = LogLinearState(*initial_levels(initial_state, B, H, L, K, V, dt, q.device))
    outputs = []
    for t in range(T):
        o_t, state = loglinear_attn_step(
            q[:, t], k[:, t], v[:, t], lam[:, t],
            None if g is None else g[:, t], None if beta is None else beta[:, t],
            state, scale=scale,
        )
        outputs.append(o_t)
    o = torch.stack(outputs, dim=1).to(out_dtype)  # T x [B, H, V] -> [B, T, H, V]
    return o, (state if output_final_state else None)
