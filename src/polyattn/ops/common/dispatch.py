"""Implementation dispatch: one vocabulary of forms for every mechanism (DESIGN.md §2)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

FORMS = ("naive", "recurrent", "chunk", "scan", "parallel", "triton")


def resolve_impl(mechanism: str, impl: str, available: Mapping[str, Callable], device: torch.device) -> Callable:
    """Return the form function named by ``impl``.

    ``"auto"`` picks ``"triton"`` on CUDA when the mechanism has it, else ``"chunk"``. A name outside
    :data:`FORMS` raises ``ValueError``; a known form that this mechanism lacks raises
    ``NotImplementedError`` naming the forms it has.
    """
    if impl == "auto":
        impl = "triton" if torch.device(device).type == "cuda" and "triton" in available else "chunk"
    if impl not in FORMS:
        raise ValueError(f"impl must be 'auto' or one of {list(FORMS)}, got {impl!r}")
    if impl not in available:
        raise NotImplementedError(f"{mechanism} has no impl={impl!r}; it has {sorted(available)} and 'auto'")
    return available[impl]
