"""The PyTorch chunk toolkit that several families share: chunked inputs, linear-attention chunk
summaries and outputs, and the delta rule's per-chunk unit-lower system.

Inside a chunk of C tokens, with ``gc`` the chunk-local inclusive cumsum of the log-decay, ``gs`` the
suffix sums (``gs[j] = g[j+1] + ... + g[C-1]``), ``segsum(g)[i, j] = g[j+1] + ... + g[i]`` and ``h``
the state entering the chunk (ops/linear/README.md, "Chunk derivation")::

    O   = ((scale Q) K^T ⊙ exp(segsum g) ⊙ [j <= i]) V  +  exp(gc) ⊙ (scale Q) h          (intra + inter)
    h'  = exp(a) h + U,   a = gc[C-1],   U = (K ⊙ exp(gs))^T V                              (summary (a, U))

and the delta rule's pseudo-values solve ``(I + diag(β)(K K^T ⊙ Γ ⊙ L⁻)) U = diag(β) (V − …)``
(ops/delta/README.md, "Dense form"). Every decay is a direct sum of the log-decays it spans and every
causal mask is selected, not multiplied (ops/README.md, "Guarantees of the PyTorch forms"). Linear attention, HLA, the delta
rule and log-linear attention build their chunk and scan forms from these; the chunk-to-chunk carry of
the decayed forms is ``common.carry_decayed``.
"""

from __future__ import annotations

import torch

from polyattn.ops.common import causal_matmul, causal_scores, compute_dtype, exp_segsum, heads_chunks, suffix_sum


def chunk_inputs(q, k, v, g, scale, C):
    """Pad to a multiple of C and reshape: ``q, k, v -> [B, H, N, C, D]``, ``g -> [B, H, N, C]`` (zeros if None)."""
    dt = compute_dtype(q)
    B, T, H, _ = q.shape
    if g is None:
        g = torch.zeros(B, T, H, dtype=dt, device=q.device)
    return tuple(heads_chunks(x.to(dt), C) for x in (q * scale, k, v, g))  # [B, T, H, *] -> [B, H, N, C, *]


def chunk_summaries(k, v, g):
    """Per-chunk ``(a [B,H,N], U [B,H,N,K,V])``: total log-decay and the state the chunk makes from zero."""
    a = g.sum(dim=-1)  # [B, H, N]
    U = (k * torch.exp(suffix_sum(g))[..., None]).transpose(-1, -2) @ v  # [B,H,N,K,C] @ [B,H,N,C,V] -> [B,H,N,K,V]
    return a, U


def chunk_outputs(q, k, v, g, states_before):
    """Outputs of every chunk given the state entering it: ``states_before: [B, H, N, K, V]`` -> ``[B, H, N, C, V]``."""
    gc = torch.cumsum(g, dim=-1)  # [B, H, N, C]
    A = causal_scores(q @ k.transpose(-1, -2), exp_segsum(g))  # [B, H, N, C, C]
    o = causal_matmul(A, v)  # [B, H, N, C, C] @ [B, H, N, C, V] -> [B, H, N, C, V]
    return o + torch.exp(gc)[..., None] * (q @ states_before)  # [B, H, N, C, K] @ [B, H, N, K, V] -> [B, H, N, C, V]


def delta_rule_system(k, beta, g):
    """The pieces of (2) for ``k: [..., T, K]``, ``beta, g: [..., T]``: ``(Γ ⊙ L [..., T, T], unit-lower M [..., T, T])``."""
    D = exp_segsum(g)  # [..., T, T], Γ ⊙ L
    kk = (k @ k.transpose(-1, -2)) * D  # [..., T, T]
    M = torch.eye(k.shape[-2], dtype=k.dtype, device=k.device) + beta[..., :, None] * torch.tril(kk, diagonal=-1)  # tril selects
    return D, M
