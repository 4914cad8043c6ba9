"""HLA with chunk states from a log-depth associative scan (ops/hla/README.md, "Associative combine").

This form demonstrates the paper's central claim — chunk-parallel evaluation equals the serial
recurrence — with the *corrected* decayed operators. Three steps:

1. every chunk, from a zero state, gives a segment summary ``(a, *state fields, *extras)`` where
   ``a`` is the chunk's total log-decay and every state field and extra is a decayed sum
   ``Σ_u exp(p·g_{u+1..b}) x_u w_uᵀ`` over the chunk (b = its last token), i.e. a linear-attention
   chunk summary of chunk-local sequences (y, z are the chunk-local Y, Z):

       hla2  (a, S, F, C)              C  = Σ g^{b-u} q_u v_uᵀ                                      (F-form)
       ahla  (a, P, E, R)              R  = Σ k_u q_uᵀ, undecayed                                   (erratum 4)
       hla3  (a, S, P, F, SQ, R, U)    SQ = Σ g^{b-u} q_u q_uᵀ,  R = Σ g^{2(b-u)} q_u z_uᵀ,
                                       U  = Σ g^{2(b-u)} y_u q_uᵀ

2. an inclusive :func:`~polyattn.ops.common.associative_scan` over ``[initial state, chunk 0, ..., chunk N-1]``
   with the combines below gives the state entering every chunk and the final state;
3. every chunk's outputs from its entering state, all chunks at once (the chunk algebra of ``linear_attn``).

States use the ``o = Sᵀ q`` convention of ``linear_attn`` (S_A appears transposed; it is symmetric for
states built from tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from polyattn.ops.common import associative_scan, heads_unchunk, scaled_log_decay
from polyattn.ops.hla.variants import finish_output, prepare
from polyattn.ops.chunked import chunk_inputs, chunk_outputs, chunk_summaries


def _rate(a: torch.Tensor, p: int) -> torch.Tensor:
    """``exp(p·a)`` broadcast over a state: ``[B, H, n] -> [B, H, n, 1, 1]``."""
    return torch.exp(p * a)[..., None, None]


def combine_hla2(left, right):
    """HLA2 F-form summary: ``F = ρ² F_A + F_B + ρ S_Aᵀ C_B`` (ρ = ρ_B)."""
    a1, S1, F1, C1 = left
    a2, S2, F2, C2 = right
    r, r2 = _rate(a2, 1), _rate(a2, 2)
    return a1 + a2, r * S1 + S2, r2 * F1 + F2 + r * (S1.mT @ C2), r * C1 + C2  # [.., K, K] @ [.., K, V'] -> [.., K, V']


def combine_ahla(left, right):
    """AHLA, corrected (erratum 4): R undecayed, ``E = ρ E_A + E_B + ρ R_B P_A``."""
    a1, P1, E1, R1 = left
    a2, P2, E2, R2 = right
    r = _rate(a2, 1)
    return a1 + a2, r * P1 + P2, r * E1 + E2 + r * (R2 @ P1), R1 + R2  # [.., K, K] @ [.., K, V'] -> [.., K, V']


def combine_hla3(left, right):
    """HLA3: ``F = ρ³ F_A + F_B + ρ S_Aᵀ R_B + ρ U_B P_A + ρ² S_Aᵀ SQ_B P_A`` and the R, U, SQ rules."""
    a1, S1, P1, F1, SQ1, R1, U1 = left
    a2, S2, P2, F2, SQ2, R2, U2 = right
    r, r2, r3 = _rate(a2, 1), _rate(a2, 2), _rate(a2, 3)
    SQ2P1 = SQ2 @ P1  # [.., K, K] @ [.., K, V'] -> [.., K, V']
    F = r3 * F1 + F2 + r * (S1.mT @ R2) + r * (U2 @ P1) + r2 * (S1.mT @ SQ2P1)
    R = r2 * R1 + R2 + r * SQ2P1
    U = r2 * U1 + U2 + r * (S1.mT @ SQ2)  # [.., K, K] @ [.., K, K] -> [.., K, K]
    return a1 + a2, r * S1 + S2, r * P1 + P2, F, r * SQ1 + SQ2, R, U


class Extra(NamedTuple):
    """A summary ``Σ_u exp(decay·g_{u+1..b}) env[left]_u env[right]_uᵀ`` over a chunk."""

    left: str
    right: str
    decay: int


class ScanRule(NamedTuple):
    extras: tuple[Extra, ...]
    combine: Callable


SCAN_RULES = {
    "hla2": ScanRule((Extra("q", "v", 1),), combine_hla2),
    "ahla": ScanRule((Extra("k", "q", 0),), combine_ahla),
    "hla3": ScanRule((Extra("q", "q", 1), Extra("q", "z", 2), Extra("y", "q", 2)), combine_hla3),
}


def hla_chunk_elements(variant, q, k, v, g, chunk_size):
    """Step 1 for inputs already prepared (:func:`~polyattn.ops.hla.variants.prepare`): every chunk's segment summary
    from a zero state, ``(a [B, H, N], *state fields, *extras)`` with fields ``[B, H, N, K, W]``, and the chunked
    inputs ``(qc, kc, vc, gc)`` that step 3 reads."""
    rule, T = SCAN_RULES[variant.name], q.shape[1]
    qc, kc, vc, gc = chunk_inputs(q, k, v, g, 1.0, min(chunk_size, T))  # [B, H, N, C, D], gc: [B, H, N, C]
    local = {"q": qc, "k": kc, "v": vc}  # chunk-local sequences, every chunk from a zero state
    summaries = []
    for call in variant.calls:
        key, value = local[call.key], local[call.value]
        summaries.append(chunk_summaries(key, value, scaled_log_decay(gc, call.decay))[1])  # [B, H, N, K, W]
        if call.out != "o":
            zeros = key.new_zeros(*key.shape[:3], key.shape[-1], value.shape[-1])  # [B, H, N, K, W]
            local[call.out] = chunk_outputs(qc, key, value, scaled_log_decay(gc, call.decay), zeros)  # [B, H, N, C, W]
    a = gc.sum(dim=-1)  # [B, H, N]: each chunk's total log-decay
    summaries += [chunk_summaries(local[e.left], local[e.right], scaled_log_decay(gc, e.decay))[1] for e in rule.extras]
    return (a, *summaries), (qc, kc, vc, gc)


def hla_scan(
    q, k, v, g=None, *, order=2, asymmetric=False, normalize=False, eps=1e-6, scale,
    initial_state=None, output_final_state=False, chunk_size=64,
):
    """Chunk states by a log-depth scan of segment summaries. Returns ``(o [B, T, H, V], final_state or None)``."""
    variant, q, k, v, g, h0, out_dtype = prepare(
        q, k, v, g, order=order, asymmetric=asymmetric, normalize=normalize, scale=scale, initial_state=initial_state
    )  # compute dtype; v: [B, T, H, V']
    T = q.shape[1]
    chunks, (qc, kc, vc, gc) = hla_chunk_elements(variant, q, k, v, g, chunk_size)
    N = qc.shape[2]
    first = [torch.zeros_like(x[:, :, :1]) for x in chunks]  # [B, H, 1, ...]: the initial state as element 0
    first[1 : 1 + len(h0)] = [h[:, :, None] for h in h0]
    elems = tuple(torch.cat([x0, x], dim=2) for x0, x in zip(first, chunks))  # [B, H, N + 1, ...]
    prefix = associative_scan(SCAN_RULES[variant.name].combine, elems, dim=2)  # prefix[..., n, ...] = state after n chunks
    states = prefix[1 : 1 + len(variant.calls)]

    env = {"k": kc, "v": vc}
    for call, state in zip(variant.calls, states):
        env[call.out] = chunk_outputs(qc, env[call.key], env[call.value], scaled_log_decay(gc, call.decay), state[:, :, :N])
    o = heads_unchunk(env["o"], T)  # [B, H, N, C, V'] -> [B, T, H, V']
    final = variant.state(*(state[:, :, N] for state in states)) if output_final_state else None
    return finish_output(o, normalize, eps, out_dtype), final
