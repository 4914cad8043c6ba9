"""Products over the time axis that stay causal whatever the values hold.

A causal matrix ``A`` has exact zeros above its diagonal, but in ``A @ X`` a non-finite future row of
``X`` still reaches every earlier row (``0 · inf = nan``). :func:`causal_matmul` keeps it out.
"""

from __future__ import annotations

import torch


def causal_matmul(A: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """``A @ X`` for a lower-triangular ``A: [..., T, T]`` and ``X: [..., T, W]``, causal for any X.

    Row t depends on rows ``s <= t`` of X only: the product is taken with the non-finite entries of X
    zeroed, and every output entry ``(t, w)`` whose column of X has a non-finite entry at some
    ``s <= t`` is NaN — what the recurrence gives there (a non-finite value stays in the state).
    """
    bad = ~torch.isfinite(X)  # [..., T, W]
    out = A @ torch.where(bad, 0.0, X)  # [..., T, T] @ [..., T, W] -> [..., T, W]
    poisoned = torch.cummax(bad, dim=-2).values  # [..., T, W]: a non-finite entry at or before t
    return torch.where(poisoned, torch.nan, out)
