"""The one KATA state format shared by ``chunk``, ``scan``, ``recurrent`` and ``naive``.

Normalized and unnormalized KATA keep ``KataState(S, z)``: the numerator ``S = Σ_s w_s ψ(k_s) v_sᵀ``
(``[N, H, P, V]``) and the normaliser ``z = Σ_s w_s ψ(k_s)`` (``[N, H, P]``), ``w_s`` the decay from s to
the end. z is kept even when ``normalize=False`` so that one state serves both reads. DeltaKATA's state
is the plain delta-rule tensor ``S: [N, H, P, V]``. P is ``make_feature_map(...).dim()`` (full, unpacked).

Internally the forms carry S and z together as one augmented state ``[S | z]: [N, H, P, V + 1]``: the
normaliser is the numerator of an all-ones value column.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class KataState(NamedTuple):
    S: torch.Tensor  # [N, H, P, V]
    z: torch.Tensor  # [N, H, P]


def join_state(state: KataState | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``KataState -> [S | z]``: ``[N, H, P, V], [N, H, P] -> [N, H, P, V + 1]`` in ``dtype``."""
    if state is None:
        return None
    return torch.cat([state.S.to(dtype), state.z.to(dtype)[..., None]], dim=-1)  # -> [N, H, P, V + 1]


def split_state(augmented: torch.Tensor) -> KataState:
    """``[S | z]: [N, H, P, V + 1] -> KataState(S [N, H, P, V], z [N, H, P])``."""
    return KataState(S=augmented[..., :-1], z=augmented[..., -1])


def with_ones(v: torch.Tensor) -> torch.Tensor:
    """Append the all-ones value column whose numerator is the normaliser: ``[..., V] -> [..., V + 1]``."""
    return torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)


def normalized_read(out: torch.Tensor, normalize: bool, eps: float) -> torch.Tensor:
    """Turn an augmented read ``[..., V + 1]`` (numerator | denominator) into ``o: [..., V]``.

    ``normalize``: ``o = num / max(den, eps)`` (ops/kata/README.md, "Normalized KATA"); otherwise ``o = num``.
    """
    num, den = out[..., :-1], out[..., -1:]  # [..., V], [..., 1]
    return num / den.clamp_min(eps) if normalize else num
