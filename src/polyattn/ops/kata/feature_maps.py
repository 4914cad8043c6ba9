"""KATA feature maps ψ, one per symmetric cone, each declaring the kernel κ(q, k) = ⟨ψ(q), ψ(k)⟩ it realises.

ops/kata/README.md, "Feature maps". ``u: [..., K]`` is a (scaled) query or key head vector; ``groups`` splits K into
``groups`` blocks ``u_i`` of width ``E = K / groups``.

| feature | combine | ψ(u) | P (feature dim) | κ(q, k) |
|---|---|---|---|---|
| ``psd`` | ``concat`` (KATA-Mg) | concat_i vec(u_i u_iᵀ) | groups·E² | Σ_i (q_i·k_i)² |
| ``psd`` | ``sum`` (KATA-Σg) | vec(Σ_i u_i u_iᵀ) | E² | Σ_{i,j} (q_i·k_j)² |
| ``orthant`` | – | relu(u) + 1e-6 | K | ⟨relu(q) + ε, relu(k) + ε⟩ |
| ``lorentz`` | – | [u_{1:K-1}, ‖u_{1:K-1}‖ (1 + u_K²)] | K | q'·k' + ‖q'‖‖k'‖(1 + q_K²)(1 + k_K²) |

Every map offers the operations the forms need, so that no form tests for a feature by name:

- ``lift(u) -> [..., P]``: ψ itself (naive spec, tests, first-order forms);
- ``kernel(q [..., T, K], k [..., S, K]) -> [..., T, S]``: κ for all pairs, without building ψ;
- ``read(q [..., T, K], S [..., P, W]) -> [..., T, W]``: ψ(q)ᵀ S, for PSD the bilinear form Σ_i q_iᵀ S_i q_i;
- ``write(k [..., T, K], v [..., T, W]) -> [..., P, W]``: Σ_t ψ(k_t) v_tᵀ, for PSD Σ_t k_i k_iᵀ ⊗ v_t.

The PSD state is symmetric in its two E-indices, so it can be stored packed: ``svec`` keeps the upper
triangle with √2 on the off-diagonal (⟨svec A, svec B⟩ = ⟨A, B⟩_F), which halves P to E(E+1)/2 per slot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from polyattn.ops.common import check_choice

ORTHANT_EPS = 1e-6  # the orthant map adds a constant so that every weight is strictly positive


def _svec_index(E: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat upper-triangle indices of an E×E matrix and their svec weights (1 on the diagonal, √2 off it)."""
    rows, cols = torch.triu_indices(E, E, device=device)  # [E(E+1)/2] each
    weight = torch.full(rows.shape, math.sqrt(2.0), dtype=torch.float64, device=device)  # [E(E+1)/2]
    weight[rows == cols] = 1.0
    return rows * E + cols, weight


def svec(M: torch.Tensor) -> torch.Tensor:
    """Packed symmetric vectorisation ``[..., E, E] -> [..., E(E+1)/2]`` (upper triangle, √2 off the diagonal)."""
    E = M.shape[-1]
    index, weight = _svec_index(E, M.device)
    return M.flatten(-2)[..., index] * weight.to(M.dtype)  # [..., E*E] -> [..., E(E+1)/2]


def smat(x: torch.Tensor, E: int) -> torch.Tensor:
    """Inverse of :func:`svec`: ``[..., E(E+1)/2] -> [..., E, E]`` (symmetric)."""
    index, weight = _svec_index(E, x.device)
    upper = x / weight.to(x.dtype)  # entries of the upper triangle
    M = x.new_zeros(*x.shape[:-1], E * E)
    M[..., index] = upper  # [..., E(E+1)/2] -> [..., E*E], upper triangle only
    M = M.unflatten(-1, (E, E))  # [..., E, E]
    return M + M.transpose(-1, -2) - torch.diag_embed(torch.diagonal(M, dim1=-2, dim2=-1))


@dataclass(frozen=True)
class PSDCombine:
    """How the PSD map combines its groups: one E×E slot per group (concat) or one shared slot (sum)."""

    name: str
    kernel_doc: str
    shared_slot: bool  # True: the groups' outer products add into one E×E matrix
    lift_eq: str  # u [..., G, E] ⊗ u -> per-slot outer products
    kernel_eq: str  # group dot products of q [..., T, G, E] and k [..., S, G, E]
    kernel_group_dims: int  # trailing group dims of kernel_eq's output, squared and summed
    read_eq: str  # q [..., T, G, E] against S [..., slots, E, E, W] -> [..., T, G, E, W]
    write_eq: str  # k [..., T, G, E] against (k ⊗ v) [..., T, G, E, W] -> [..., slots, E, E, W]


PSD_COMBINES = {
    "concat": PSDCombine(
        name="concat",
        kernel_doc="KATA-Mg: κ(q, k) = Σ_i (q_i·k_i)²",
        shared_slot=False,
        lift_eq="...ie,...if->...ief",
        kernel_eq="...tie,...sie->...tsi",
        kernel_group_dims=1,
        read_eq="...tie,...iefw->...tifw",
        write_eq="...tie,...tifw->...iefw",
    ),
    "sum": PSDCombine(
        name="sum",
        kernel_doc="KATA-Σg: κ(q, k) = Σ_{i,j} (q_i·k_j)² = ‖Q_gᵀ K_g‖_F²",
        shared_slot=True,
        lift_eq="...ie,...if->...ef",
        kernel_eq="...tie,...sje->...tsij",
        kernel_group_dims=2,
        read_eq="...tie,...efw->...tifw",
        write_eq="...tie,...tifw->...efw",
    ),
}


@dataclass(frozen=True)
class PSDFeatureMap:
    """Rank-one PSD lift per group: κ is a sum of squared group dot products."""

    K: int
    groups: int = 1
    combine: str = "concat"

    name = "psd"
    grouped = True  # groups and combine change the kernel

    def __post_init__(self):
        check_choice("combine", self.combine, tuple(PSD_COMBINES))
        if self.groups < 1 or self.K % self.groups:
            raise ValueError(f"groups: expected a positive divisor of K = {self.K}, got groups = {self.groups}")

    @property
    def spec(self) -> PSDCombine:
        return PSD_COMBINES[self.combine]

    @property
    def E(self) -> int:
        return self.K // self.groups

    @property
    def slots(self) -> int:
        """Number of E×E blocks in the state: 1 for sum, groups for concat."""
        return 1 if self.spec.shared_slot else self.groups

    @property
    def kernel_doc(self) -> str:
        return self.spec.kernel_doc

    def dim(self, packed: bool = False) -> int:
        """Feature dimension P: slots·E², or slots·E(E+1)/2 packed."""
        per_slot = self.E * (self.E + 1) // 2 if packed else self.E * self.E
        return self.slots * per_slot

    def _split(self, u: torch.Tensor) -> torch.Tensor:
        return u.unflatten(-1, (self.groups, self.E))  # [..., K] -> [..., G, E]

    def lift(self, u: torch.Tensor, packed: bool = False) -> torch.Tensor:
        """ψ(u): ``[..., K] -> [..., P]`` (``packed``: svec per slot, P = slots·E(E+1)/2)."""
        outer = torch.einsum(self.spec.lift_eq, self._split(u), self._split(u))  # [..., (G,) E, E]
        if packed:
            return svec(outer).flatten(-2) if not self.spec.shared_slot else svec(outer)
        return outer.flatten(-3) if not self.spec.shared_slot else outer.flatten(-2)

    def kernel(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """κ(q_t, k_s) for all pairs: ``[..., T, K], [..., S, K] -> [..., T, S]``; ψ is never built."""
        dots = torch.einsum(self.spec.kernel_eq, self._split(q), self._split(k))  # [..., T, S, G(, G)]
        return dots.square().sum(dim=tuple(range(-self.spec.kernel_group_dims, 0)))  # -> [..., T, S]

    def kernel_vjp(self, q: torch.Tensor, k: torch.Tensor, grad: torch.Tensor) -> tuple:
        """`(dq, dk)` of `Σ grad ⊙ κ(q, k)` (grad `[..., T, S]`): the group dot products d = q_i·k_j enter squared,
        so `∂/∂d = 2 d grad`, carried back through the same contraction."""
        ins, out = self.spec.kernel_eq.split("->")
        eq_q, eq_k = ins.split(",")
        qg, kg = self._split(q), self._split(k)
        w = 2 * torch.einsum(self.spec.kernel_eq, qg, kg) * grad[(...,) + (None,) * self.spec.kernel_group_dims]
        dq = torch.einsum(f"{out},{eq_k}->{eq_q}", w, kg)  # [..., T, G, E]
        return dq.flatten(-2), torch.einsum(f"{out},{eq_q}->{eq_k}", w, qg).flatten(-2)

    def _state_view(self, S: torch.Tensor) -> torch.Tensor:
        view = S.unflatten(-2, (self.slots, self.E, self.E))  # [..., P, W] -> [..., slots, E, E, W]
        return view.squeeze(-4) if self.spec.shared_slot else view  # sum: [..., E, E, W]

    def read(self, q: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
        """ψ(q)ᵀ S as the bilinear form Σ_i q_iᵀ S_(i) q_i: ``[..., T, K], [..., P, W] -> [..., T, W]``."""
        qg = self._split(q)  # [..., T, G, E]
        half = torch.einsum(self.spec.read_eq, qg, self._state_view(S))  # [..., T, G, E(f), W]: q_iᵀ S_(i)
        return torch.einsum("...tif,...tifw->...tw", qg, half)  # [..., T, G, E, W] -> [..., T, W]

    def write(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Σ_t ψ(k_t) v_tᵀ: ``[..., T, K], [..., T, W] -> [..., P, W]``; ψ is never built."""
        kg = self._split(k)  # [..., T, G, E]
        kv = kg[..., :, None] * v[..., None, None, :]  # [..., T, G, E, 1] * [..., T, 1, 1, W] -> [..., T, G, E, W]
        S = torch.einsum(self.spec.write_eq, kg, kv)  # [..., (G,) E, E, W]
        return S.flatten(-4, -2) if not self.spec.shared_slot else S.flatten(-3, -2)  # -> [..., P, W]

    def pack_state(self, S: torch.Tensor) -> torch.Tensor:
        """Full state ``[..., P, W]`` -> packed ``[..., P_packed, W]`` (exact: the state is symmetric per slot)."""
        blocks = S.unflatten(-2, (self.slots, self.E, self.E)).movedim(-1, -4)  # [..., W, slots, E, E]
        return svec(blocks).flatten(-2).movedim(-2, -1)  # [..., W, slots, E(E+1)/2] -> [..., P_packed, W]

    def unpack_state(self, S_packed: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`pack_state`: ``[..., P_packed, W] -> [..., P, W]``."""
        per_slot = self.E * (self.E + 1) // 2
        blocks = S_packed.movedim(-1, -2).unflatten(-1, (self.slots, per_slot))  # [..., W, slots, E(E+1)/2]
        return smat(blocks, self.E).flatten(-3).movedim(-2, -1)  # [..., W, slots, E, E] -> [..., P, W]


@dataclass(frozen=True)
class FirstOrderFeatureMap:
    """A first-order cone map (P = K): ψ is as small as the input, so the forms build it."""

    K: int
    groups: int = 1
    combine: str = "concat"

    grouped = False

    def __post_init__(self):
        if self.groups != 1 or self.combine != "concat":
            raise ValueError(
                f"groups/combine: expected groups=1 and combine='concat' for feature={self.name!r} (only 'psd' "
                f"is grouped), got groups={self.groups}, combine={self.combine!r}"
            )

    def dim(self, packed: bool = False) -> int:
        """Feature dimension P = K (there is nothing to pack in a first-order map)."""
        return self.K

    def kernel(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return self.lift(q) @ self.lift(k).transpose(-1, -2)  # [..., T, P] @ [..., P, S] -> [..., T, S]

    def read(self, q: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
        return self.lift(q) @ S  # [..., T, P] @ [..., P, W] -> [..., T, W]

    def write(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.lift(k).transpose(-1, -2) @ v  # [..., P, T] @ [..., T, W] -> [..., P, W]


@dataclass(frozen=True)
class OrthantFeatureMap(FirstOrderFeatureMap):
    """Positive orthant R^K_+: ψ(u) = relu(u) + ε."""

    name = "orthant"
    kernel_doc = "orthant: κ(q, k) = ⟨relu(q) + ε, relu(k) + ε⟩, ε = 1e-6"

    def lift(self, u: torch.Tensor, packed: bool = False) -> torch.Tensor:
        return torch.relu(u) + ORTHANT_EPS


@dataclass(frozen=True)
class LorentzFeatureMap(FirstOrderFeatureMap):
    """Lorentz cone L^K: ψ(u) = [u', ‖u'‖ (1 + u_K²)] with u' = u_{1:K-1}; ⟨x, y⟩ ≥ 0 on L^K."""

    name = "lorentz"
    kernel_doc = "lorentz: κ(q, k) = q'·k' + ‖q'‖‖k'‖(1 + q_K²)(1 + k_K²)"

    def __post_init__(self):
        super().__post_init__()
        if self.K < 2:
            raise ValueError(f"K: expected K >= 2 for feature='lorentz', got K = {self.K}")

    def lift(self, u: torch.Tensor, packed: bool = False) -> torch.Tensor:
        head, last = u[..., :-1], u[..., -1:]  # [..., K-1], [..., 1]
        time = torch.linalg.vector_norm(head, dim=-1, keepdim=True) * (1 + last.square())  # [..., 1]
        return torch.cat([head, time], dim=-1)  # [..., K]


FEATURE_MAPS = {
    "psd": PSDFeatureMap,
    "orthant": OrthantFeatureMap,
    "lorentz": LorentzFeatureMap,
}


def make_feature_map(feature: str, K: int, groups: int = 1, combine: str = "concat"):
    """The feature map named ``feature`` for head width ``K``; ``ValueError`` on an unknown name or bad options."""
    check_choice("feature", feature, tuple(FEATURE_MAPS))
    if isinstance(groups, bool) or not isinstance(groups, int):
        raise ValueError(f"groups: expected a positive int, got {groups!r}")
    return FEATURE_MAPS[feature](K=K, groups=groups, combine=combine)


def kata_state_size(K: int, V: int, groups: int = 1, combine: str = "concat", packed: bool = False, *, feature: str = "psd") -> int:
    """Entries of the numerator state S (P·V) per head (ops/kata/README.md, "State sizes"); z adds P more."""
    return make_feature_map(feature, K, groups, combine).dim(packed) * V
