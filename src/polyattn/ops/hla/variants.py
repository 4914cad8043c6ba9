"""HLA variants as compositions of causal linear attention, and the one state format every form shares.

Writing ``LA(Q, K, V; p·g)`` for causal linear attention with log-decay ``p·g`` (ops/hla/README.md, "Definitions"):

    hla2  (order=2)                  Y = LA(Q, K, K; g)                        O = LA(Q, Y, V; 2g)
    ahla  (order=2, asymmetric)      Z = LA(Q, K, V; g)                        O = LA(Q, K, Z; g)
    hla3  (order=3)                  Y = LA(Q, K, K; g),  Z = LA(Q, K, V; g),  O = LA(Q, Y, Z; 3g)

``normalize=True`` appends a ones column to V ("Normalized variant"): the last output column is the
denominator. The HLA state is the tuple of the composed calls' K×(width) states, in call order, so
that every form (recurrent, chunk, scan) reads and writes the same thing; with ``normalize=True`` each
state that carries V has one extra column holding the ones-column vector (f for hla2, m and n for ahla).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from polyattn.ops.common import check_choice, check_flag, check_state, compute_dtype


class HLA2State(NamedTuple):
    """Second-order HLA (the F-form of "Streaming recurrences"). V' = V + 1 when normalized (last column: f)."""

    S: torch.Tensor  # [N, H, K, K]   Σ_i exp(g_{i+1..t}) k_i k_iᵀ: state of Y = LA(Q, K, K; g)
    F: torch.Tensor  # [N, H, K, V']  Σ_j exp(2 g_{j+1..t}) y_j v_jᵀ, y_j = S_jᵀ q_j: state of LA(Q, Y, V; 2g)


class AHLAState(NamedTuple):
    """Asymmetric second-order HLA. V' = V + 1 when normalized (last columns: m in P, n in E)."""

    P: torch.Tensor  # [N, H, K, V']  Σ_j exp(g_{j+1..t}) k_j v_jᵀ: state of Z = LA(Q, K, V; g)
    E: torch.Tensor  # [N, H, K, V']  Σ_i exp(g_{i+1..t}) k_i z_iᵀ, z_i = P_iᵀ q_i: state of LA(Q, K, Z; g)


class HLA3State(NamedTuple):
    """Third-order HLA, masked W Wᵀ W. V' = V + 1 when normalized."""

    S: torch.Tensor  # [N, H, K, K]   state of Y = LA(Q, K, K; g)
    P: torch.Tensor  # [N, H, K, V']  state of Z = LA(Q, K, V; g)
    F: torch.Tensor  # [N, H, K, V']  Σ_u exp(3 g_{u+1..t}) y_u z_uᵀ: state of LA(Q, Y, Z; 3g)


class LACall(NamedTuple):
    """``env[out] = LA(Q, env[key], env[value]; decay·g)``; its state is the matching field of the HLA state."""

    out: str
    key: str
    value: str
    decay: int


@dataclass(frozen=True)
class Variant:
    name: str
    calls: tuple[LACall, ...]  # in the order of the state's fields; the last call writes "o"
    state: type

    def state_shapes(self, N: int, H: int, K: int, V: int, normalize: bool) -> tuple[tuple[int, ...], ...]:
        """Shapes of the state fields: ``[N, H, K, width of the call's values]``."""
        widths = {"k": K, "v": V + int(normalize)}
        shapes = []
        for call in self.calls:
            widths[call.out] = widths[call.value]
            shapes.append((N, H, K, widths[call.value]))
        return tuple(shapes)


HLA2 = Variant("hla2", (LACall("y", "k", "k", 1), LACall("o", "y", "v", 2)), HLA2State)
AHLA = Variant("ahla", (LACall("z", "k", "v", 1), LACall("o", "k", "z", 1)), AHLAState)
HLA3 = Variant("hla3", (LACall("y", "k", "k", 1), LACall("z", "k", "v", 1), LACall("o", "y", "z", 3)), HLA3State)
VARIANTS = {(2, False): HLA2, (2, True): AHLA, (3, False): HLA3}


def resolve_variant(order: int, asymmetric: bool) -> Variant:
    """The variant for ``(order, asymmetric)``; ValueError for other orders or an asymmetric third order."""
    check_choice("order", order, (2, 3))
    check_flag("asymmetric", asymmetric)
    if order == 3 and asymmetric:
        raise ValueError("asymmetric: expected False with order=3 (AHLA is second order only), got True")
    return VARIANTS[(order, asymmetric)]


def check_hla_state(variant: Variant, state, N: int, H: int, K: int, V: int, normalize: bool, q: torch.Tensor) -> None:
    """``state`` must be the variant's NamedTuple with fields of :meth:`Variant.state_shapes`."""
    if type(state) is not variant.state:
        raise ValueError(f"initial_state: expected {variant.state.__name__}{variant.state._fields} for {variant.name}, got {type(state).__name__}")
    for name, field, shape in zip(variant.state._fields, state, variant.state_shapes(N, H, K, V, normalize)):
        check_state(f"initial_state.{name}", field, shape, q)


def prepare(q, k, v, g, *, order, asymmetric, normalize, scale, initial_state):
    """Every form's first step. Returns ``(variant, q, k, v, g, state, out_dtype)``.

    The inputs in the compute dtype (:func:`~polyattn.ops.common.compute_dtype`) with ``scale`` applied
    to q and, when normalized, the ones column appended to v (``[B, T, H, V] -> [B, T, H, V + 1]``); the
    state to start from in the same dtype (``initial_state`` cast, or zeros); the output dtype (q's).
    """
    variant = resolve_variant(order, asymmetric)
    out_dtype, dt = q.dtype, compute_dtype(q)
    q, k, v = q.to(dt) * scale, k.to(dt), v.to(dt)
    if normalize:
        v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # [B, T, H, V] -> [B, T, H, V + 1]
    if initial_state is None:
        B, _, H, K = q.shape
        state = variant.state(*(q.new_zeros(shape) for shape in variant.state_shapes(B, H, K, v.shape[-1], False)))
    else:
        state = variant.state(*(field.to(dt) for field in initial_state))
    return variant, q, k, v, (None if g is None else g.to(dt)), state, out_dtype


def prepare_for_kernels(v, g, *, order, asymmetric, normalize, initial_state):
    """The Triton forms' first step: q and k stay as they are (input dtype, q unscaled: the kernels apply
    the scale in fp32, so q is never rounded after scaling). Returns ``(variant, v, g, states)``: v with
    the ones column when normalized (``[B, T, H, V] -> [B, T, H, V + 1]``), g in fp32, the calls'
    initial states in fp32 (None each for a fresh start)."""
    variant = resolve_variant(order, asymmetric)
    if normalize:
        v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # [B, T, H, V] -> [B, T, H, V + 1]
    states = (None,) * len(variant.calls) if initial_state is None else tuple(f.float() for f in initial_state)
    return variant, v, (None if g is None else g.float()), states


def finish_output(o: torch.Tensor, normalize: bool, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """``o = num / (den + eps)`` when normalized (den = the ones column); cast to the output dtype."""
    if normalize:
        o = o[..., :-1] / (o[..., -1:] + eps)  # [B, T, H, V + 1] -> [B, T, H, V]
    return o.to(dtype)
