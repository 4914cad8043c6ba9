"""KATA's parameter-free convex output gate (ops/kata/README.md, "The convex gate").

With ``read_{t−1}(q) = S_{t−1}ᵀψ(q) / (z_{t−1}·ψ(q))`` the memory read of the *current* query against
the state before token t (decayed by exp(g_t), which cancels in the ratio), normalized KATA is exactly

    o_t = (1 − λ_t) · read_{t−1}(q_t) + λ_t · v_t,      λ_t = A[t, t] / Σ_{s≤t} A[t, s] ∈ [0, 1],  λ_1 = 1,

so every output lies in the convex hull of the values seen so far. The exclusive read is one more
unnormalized KATA call with every key moved one step later: position t' holds ``k_{t'−1}`` and the
augmented value ``exp(g_{t'}) [v_{t'−1} | 1]``. The factor exp(g_{t'}) turns the call's decay
exp(g_{t'+1} + … + g_t) into the true exp(g_{s+1} + … + g_t) of key s = t' − 1, so the call's
numerator and normaliser at t are ``Σ_{s<t} A[t, s] [v_s | 1]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from polyattn.ops.common import check_log_decay, check_qkv, resolve_scale
from polyattn.ops.kata.chunk import kata_chunk
from polyattn.ops.kata.feature_maps import make_feature_map
from polyattn.ops.kata.state import with_ones


def kata_convex_gate(q, k, v, g=None, *, feature="psd", groups=1, combine="concat", eps=1e-6, scale=None, chunk_size=64):
    """λ_t and read_{t−1}(q_t) of normalized KATA for dense batches (computed with the chunk form).

    Returns ``(lam [B, T, H], read_prev [B, T, H, V])`` in q's dtype, such that
    ``kata(q, k, v, g, ...)[0] == (1 − lam)[..., None] * read_prev + lam[..., None] * v`` wherever
    ``Σ_s A[t, s] >= eps``. ``read_prev`` is 0 where no earlier key has weight (t = 0).
    """
    _, _, _, K, _ = check_qkv(q, k, v)
    if g is not None:
        check_log_decay(g, q)
    scale = resolve_scale(scale, K)
    fmap = make_feature_map(feature, K, groups, combine)
    weight = torch.ones_like(v[..., 0]) if g is None else torch.exp(g)  # exp(g_t): [B, T, H]
    k_prev = F.pad(k, (0, 0, 0, 0, 1, 0))[:, :-1]  # k'_t = k_{t−1}, k'_0 = 0: [B, T, H, K]
    v_prev = F.pad(with_ones(v), (0, 0, 0, 0, 1, 0))[:, :-1] * weight[..., None]  # exp(g_t)[v_{t−1} | 1]: [B, T, H, V + 1]
    out, _ = kata_chunk(
        q, k_prev, v_prev, g, feature=feature, groups=groups, combine=combine, normalize=False, scale=scale, chunk_size=chunk_size
    )  # [B, T, H, V + 1]
    num, den = out[..., :-1], out[..., -1]  # Σ_{s<t} A[t, s] v_s: [B, T, H, V]; Σ_{s<t} A[t, s]: [B, T, H]
    diag = fmap.kernel(scale * q[..., None, :], k[..., None, :])[..., 0, 0]  # A[t, t] = κ(scale q_t, k_t): [B, T, H]
    lam = diag / (diag + den).clamp_min(eps)
    has_history = den > 0
    read_prev = torch.where(has_history[..., None], num / torch.where(has_history, den, 1.0)[..., None], 0.0)
    return lam, read_prev
