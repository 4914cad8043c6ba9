"""Log-space segment sums: decays between positions without products of many factors or differences.

Every decay a form uses is a sum of the log-decays it spans, summed directly: never ``G[t] - G[s]`` of
two prefix sums (which loses everything when one token's log-decay is huge, and gives ``-inf - -inf =
nan`` for an exact reset ``g = -inf``), never a product of many factors.
"""

from __future__ import annotations

import torch


def causal_mask(T: int, device, diagonal: int = 0) -> torch.Tensor:
    """``[T, T]`` bool, True where ``s <= t + diagonal`` (``diagonal=-1``: strictly below)."""
    return torch.tril(torch.ones(T, T, dtype=torch.bool, device=device), diagonal=diagonal)


def segsum(x: torch.Tensor) -> torch.Tensor:
    """``out[..., t, s] = x[..., s+1] + ... + x[..., t]`` for ``s <= t`` and ``-inf`` above the diagonal.

    Built by a masked cumulative sum of each column (no difference of two large prefix sums), so short
    segments stay exact however long the sequence and however large one log-decay is.
    """
    T = x.shape[-1]
    rep = x.unsqueeze(-1).expand(*x.shape, T)  # [..., T] -> [..., T(r), T(s)]: rep[r, s] = x[r]
    rep = rep.masked_fill(~causal_mask(T, x.device, -1), 0)  # keep x[r] only where r > s
    out = torch.cumsum(rep, dim=-2)  # [..., T(t), T(s)]: sum_{s < r <= t} x[r]
    return out.masked_fill(~causal_mask(T, x.device), float("-inf"))


def exp_segsum(x: torch.Tensor) -> torch.Tensor:
    """The causal decay matrix ``exp(segsum(x))``: ``exp(x[s+1] + ... + x[t])`` for ``s <= t``, 0 above."""
    return torch.exp(segsum(x))


def suffix_sum(x: torch.Tensor) -> torch.Tensor:
    """``out[..., s] = x[..., s+1] + ... + x[..., -1]`` (0 for the last entry): the log-decay from s to the end.

    A reversed cumulative sum, each entry summed directly (not ``total - prefix``).
    """
    rev = torch.flip(torch.cumsum(torch.flip(x, [-1]), dim=-1), [-1])  # [..., T]: x[s] + ... + x[-1]
    return torch.cat([rev[..., 1:], torch.zeros_like(rev[..., :1])], dim=-1)  # [..., T]: shifted by one


def scaled_log_decay(g: torch.Tensor, p: int) -> torch.Tensor:
    """The log-decay ``p·g`` of the rate ``exp(g)^p``; ``p = 0`` is no decay (zeros, even where ``g = -inf``)."""
    return p * g if p else torch.zeros_like(g)


def causal_scores(scores: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """``scores ⊙ decay`` on and below the diagonal, exactly 0 above (``[..., T, T]``).

    Selected, not multiplied: a non-finite score of a future key (``nan · 0 = nan``) stays out of earlier rows.
    """
    T = scores.shape[-1]
    return torch.where(causal_mask(T, scores.device), scores * decay, 0.0)
