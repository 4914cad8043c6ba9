"""HLA, the executable spec: dense masked matrices (ops/hla/README.md, "Reference definitions"), float64-able.

One head, scaled queries, ``D_p[t, s] = exp(p·(g[s+1] + ... + g[t]))`` for ``s <= t`` and 0 above (a constant
decay factor γ would give ``γ^{p(t-s)}``), ``A = D_1 ⊙ Q Kᵀ`` the decayed causal affinity::

    hla2   Y = A K                   O = (D_2 ⊙ Q Yᵀ) V          (masked HLA2, decay γ^{2t-i-j})
    ahla   Z = A V                   O = A Z                     (O = (D_g ⊙ QKᵀ)(D_g ⊙ QKᵀ) V)
    hla3   Y = A K,  Z = A V         O = (D_3 ⊙ Q Yᵀ) Z          (masked W Wᵀ W, decay γ^{3t-i-u-j})

``normalize=True`` runs the same with a ones column appended to V; that column is the denominator ``den``
and ``o = num / (den + eps)`` (ops/hla/README.md, "Normalized variant"). With an initial state, each line
above gains the state's contribution ``diag(exp(p·G)) Q h0`` (``G`` the inclusive cumulative log-decay), and
the final state of each line is ``exp(p·G_T) h0 + keysᵀ diag(D_p[T-1, :]) values``; these are the states of
:mod:`polyattn.ops.hla.variants` (ops/hla/README.md, "Streaming recurrences").
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from polyattn.ops.common import causal_matmul, causal_scores, exp_segsum
from polyattn.ops.hla.variants import finish_output, prepare


class Decay(NamedTuple):
    mask: torch.Tensor  # [B, H, T, T]  D_p
    start: torch.Tensor  # [B, H, T, 1]  exp(p·G_t): decay from the initial state to t
    end: torch.Tensor  # [B, H, T, 1]  D_p[T-1, s]: decay from s to the last token
    total: torch.Tensor  # [B, H, 1, 1]  exp(p·G_{T-1})


def _decay(g: torch.Tensor, p: int) -> Decay:
    """``g: [B, H, T]`` log-decays -> the masks of rate ``p·g``."""
    mask = exp_segsum(p * g)  # [B, H, T] -> [B, H, T, T]
    G = torch.cumsum(p * g, dim=-1)  # [B, H, T]
    return Decay(mask, torch.exp(G)[..., None], mask[..., -1, :, None], torch.exp(G[..., -1])[..., None, None])


def _hla2(q, k, v, d, h0):
    """Masked, decayed HLA2: ``o_t = Σ_{j<=t} Σ_{i<=j} exp(2t-i-j decay) (q_t·k_i)(q_j·k_i) v_j``."""
    S0, F0 = h0
    A = causal_scores(q @ k.mT, d[1].mask)  # [B, H, T, K] @ [B, H, K, T] -> [B, H, T, T]
    Y = causal_matmul(A, k) + d[1].start * (q @ S0)  # [B, H, T, K]: y_t = S_tᵀ q_t
    M = causal_scores(q @ Y.mT, d[2].mask)  # [B, H, T, T]: ((D_g ⊙ QKᵀ)(L ⊙ QKᵀ)ᵀ) ⊙ D_g
    o = causal_matmul(M, v) + d[2].start * (q @ F0)  # [B, H, T, V']
    S = d[1].total * S0 + k.mT @ (d[1].end * k)  # [B, H, K, T] @ [B, H, T, K] -> [B, H, K, K]
    F = d[2].total * F0 + Y.mT @ (d[2].end * v)  # [B, H, K, T] @ [B, H, T, V'] -> [B, H, K, V']
    return o, (S, F)


def _ahla(q, k, v, d, h0):
    """AHLA with decay: ``o_t = Σ_{j<=t} Σ_{i=j..t} exp(g_{j+1..t}) (q_t·k_i)(q_i·k_j) v_j``."""
    P0, E0 = h0
    A = causal_scores(q @ k.mT, d[1].mask)  # [B, H, T, T]
    Z = causal_matmul(A, v) + d[1].start * (q @ P0)  # [B, H, T, V']: z_i = P_iᵀ q_i (first-order linear attention)
    o = causal_matmul(A, Z) + d[1].start * (q @ E0)  # [B, H, T, V']
    P = d[1].total * P0 + k.mT @ (d[1].end * v)  # [B, H, K, V']
    E = d[1].total * E0 + k.mT @ (d[1].end * Z)  # [B, H, K, V']
    return o, (P, E)


def _hla3(q, k, v, d, h0):
    """HLA3, masked W Wᵀ W: ``o_t = Σ_{u<=t} Σ_{i<=u} Σ_{j<=u} exp(3t-i-u-j decay) (q_t·k_i)(q_u·k_i)(q_u·k_j) v_j``."""
    S0, P0, F0 = h0
    A = causal_scores(q @ k.mT, d[1].mask)  # [B, H, T, T]
    Y = causal_matmul(A, k) + d[1].start * (q @ S0)  # [B, H, T, K]
    Z = causal_matmul(A, v) + d[1].start * (q @ P0)  # [B, H, T, V']
    M = causal_scores(q @ Y.mT, d[3].mask)  # [B, H, T, T]: ((W Wᵀ) ⊙ L) with weight g^{3(t-u)} g^{u-i}
    o = causal_matmul(M, Z) + d[3].start * (q @ F0)  # [B, H, T, V']
    S = d[1].total * S0 + k.mT @ (d[1].end * k)  # [B, H, K, K]
    P = d[1].total * P0 + k.mT @ (d[1].end * v)  # [B, H, K, V']
    F = d[3].total * F0 + Y.mT @ (d[3].end * Z)  # [B, H, K, V']
    return o, (S, P, F)


_DENSE = {"hla2": _hla2, "ahla": _ahla, "hla3": _hla3}


def hla_naive(
    q, k, v, g=None, *, order=2, asymmetric=False, normalize=False, eps=1e-6, scale,
    initial_state=None, output_final_state=False,
):
    """Dense ``[T, T]`` HLA. Returns ``(o [B, T, H, V] in q's dtype, final_state or None)``."""
    variant, q, k, v, g, h0, out_dtype = prepare(
        q, k, v, g, order=order, asymmetric=asymmetric, normalize=normalize, scale=scale, initial_state=initial_state
    )  # compute dtype; v: [B, T, H, V']
    B, T, H, _ = q.shape
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [B, T, H, D] -> [B, H, T, D]
    g = torch.zeros(B, H, T, dtype=q.dtype, device=q.device) if g is None else g.transpose(1, 2)  # [B, T, H] -> [B, H, T]
    d = {p: _decay(g, p) for p in (1, 2, 3)}
    o, final = _DENSE[variant.name](q, k, v, d, h0)
    o = finish_output(o.transpose(1, 2), normalize, eps, out_dtype)  # [B, H, T, V'] -> [B, T, H, V]
    return o, (variant.state(*final) if output_final_state else None)
