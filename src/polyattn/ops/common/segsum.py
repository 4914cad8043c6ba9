"""Log-space segment sums: decays between positions without products of many factors."""

from __future__ import annotations

import torch


def segsum(x: torch.Tensor) -> torch.Tensor:
    """``out[..., t, s] = x[..., s+1] + ... + x[..., t]`` for ``s <= t`` and ``-inf`` above the diagonal.

    Built by a masked cumulative sum of each column (no difference of two large prefix sums), so short
    segments stay exact however long the sequence.
    """
    T = x.shape[-1]
    strict = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device), diagonal=-1)  # [T, T], s < t
    rep = x.unsqueeze(-1).expand(*x.shape, T)  # [..., T] -> [..., T(r), T(s)]: rep[r, s] = x[r]
    rep = rep.masked_fill(~strict, 0)  # keep x[r] only where r > s
    out = torch.cumsum(rep, dim=-2)  # [..., T(t), T(s)]: sum_{s < r <= t} x[r]
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device))
    return out.masked_fill(~causal, float("-inf"))


def exp_segsum(x: torch.Tensor) -> torch.Tensor:
    """The causal decay matrix ``exp(segsum(x))``: ``exp(x[s+1] + ... + x[t])`` for ``s <= t``, 0 above."""
    return torch.exp(segsum(x))
