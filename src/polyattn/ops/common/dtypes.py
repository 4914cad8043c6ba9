"""The numerics policy in one place: what dtype a computation and a state use."""

from __future__ import annotations

import torch


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Accumulators and states: float64 stays float64 (the exact ladder); every other dtype uses float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32
