"""Associative combine of chunk summaries and a log-depth prefix scan over them.

A chunk summary of a decayed linear recurrence is ``(a, S)``: the chunk's total log-decay and the
state it produces from a zero start. Running ``left`` then ``right`` gives
``(a_l + a_r, exp(a_r) S_l + S_r)``, which is associative; the prefix scan over chunks is therefore
computable in ``ceil(log2 N)`` parallel steps (and later across devices).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def combine_decayed(left: tuple[torch.Tensor, torch.Tensor], right: tuple[torch.Tensor, torch.Tensor]):
    """``(a_l, S_l) ∘ (a_r, S_r) = (a_l + a_r, exp(a_r) S_l + S_r)`` with ``a: [...]``, ``S: [..., K, V]``."""
    a_l, s_l = left
    a_r, s_r = right
    return a_l + a_r, torch.exp(a_r)[..., None, None] * s_l + s_r


def carry_decayed(a: torch.Tensor, S: torch.Tensor, initial: torch.Tensor | None = None) -> torch.Tensor:
    """The sequential form of the same prefix, the chunk-to-chunk carry of every decayed chunk form:
    ``a: [B, H, N]``, ``S: [B, H, N, ...]`` chunk summaries -> the state after each chunk,
    ``state_n = exp(a_n) state_{n-1} + S_n`` from ``initial`` (``[B, H, ...]``) or zero: ``[B, H, N, ...]``."""
    state = torch.zeros_like(S[:, :, 0]) if initial is None else initial.to(S.dtype)
    after = []
    for n in range(S.shape[2]):
        state = torch.exp(a[:, :, n]).reshape(*a.shape[:2], *[1] * (S.dim() - 3)) * state + S[:, :, n]
        after.append(state)
    return torch.stack(after, dim=2)  # N x [B, H, ...] -> [B, H, N, ...]


def associative_scan(combine: Callable, elems: tuple[torch.Tensor, ...], dim: int) -> tuple[torch.Tensor, ...]:
    """Inclusive prefix scan of ``elems`` along ``dim`` with an associative ``combine(left, right)``.

    Hillis–Steele doubling: step ``d`` combines each element with the one ``2**d`` before it, so the
    depth is ``ceil(log2 n)``. Every tensor in ``elems`` must have the same size along ``dim``.
    """
    n = elems[0].shape[dim]
    dims = [dim % x.dim() for x in elems]
    out = tuple(elems)
    step = 1
    while step < n:
        left = tuple(x.narrow(d, 0, n - step) for x, d in zip(out, dims))  # [..., n - step, ...]
        right = tuple(x.narrow(d, step, n - step) for x, d in zip(out, dims))
        merged = combine(left, right)
        out = tuple(torch.cat([x.narrow(d, 0, step), m], dim=d) for x, m, d in zip(out, merged, dims))
        step *= 2
    return out


def associative_reduce(combine: Callable, elems: tuple[torch.Tensor, ...], dim: int) -> tuple[torch.Tensor, ...]:
    """The combine of all ``n`` elements along ``dim`` (the last entry of :func:`associative_scan`) by pairwise
    halving: ``n - 1`` combines in ``ceil(log2 n)`` steps, the element dimension removed from the result."""
    dims = [dim % x.dim() for x in elems]
    out = tuple(elems)
    while out[0].shape[dims[0]] > 1:
        n = out[0].shape[dims[0]]
        pairs = n // 2
        left = tuple(x.narrow(d, 0, 2 * pairs).unflatten(d, (pairs, 2)).select(d + 1, 0) for x, d in zip(out, dims))
        right = tuple(x.narrow(d, 0, 2 * pairs).unflatten(d, (pairs, 2)).select(d + 1, 1) for x, d in zip(out, dims))
        merged = combine(left, right)  # [..., pairs, ...]
        out = tuple(torch.cat([m, x.narrow(d, 2 * pairs, n - 2 * pairs)], dim=d) for x, m, d in zip(out, merged, dims))
    return tuple(x.squeeze(d) for x, d in zip(out, dims))
