"""The one log-linear state format shared by ``naive``, ``recurrent`` and ``chunk``, and its Fenwick carry.

``LogLinearState(levels, position)``:

* ``levels [N, H, L, K, V]`` (fp32; float64 for float64 inputs): level ``l`` holds the keys that sit in
  level ``l`` of the last query ``position - 1``, each carried (decayed, delta-rule transitions applied) to
  that query. ``L`` is the level count of ``lam``: a state made with ``lam: [..., L]`` continues with the
  same ``L``.
* ``position [N]`` int64: the number of tokens consumed, i.e. the absolute position of the next token.
  Levels are functions of absolute positions, so a continuation from any split is exact. A state at
  position 0 holds no keys: its levels are ignored.

When the query at ``position`` arrives, its levels follow from the previous query's by the carry
``j = ctz(position)``: levels ``0..j`` merge into level ``j + 1`` (ops/loglinear/README.md, "State and cost per token").
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from polyattn.ops.common import check_state, check_value, compute_dtype, num_levels


class LogLinearState(NamedTuple):
    levels: torch.Tensor  # [N, H, L, K, V]
    position: torch.Tensor  # [N] int64


def fenwick_carry(levels: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """The carry before the token at absolute ``position [N]``: levels ``0..j`` merge into ``j + 1``, ``j = ctz(position)``.

    ``levels: [N, H, L, K, V]``; position 0 carries nothing. Integer bits only (no logarithms); level
    ``j + 1`` is empty before the carry (bit ``j`` of ``position - 1`` is 0), so it receives the sum of
    levels ``0..j + 1``.
    """
    L = levels.shape[2]
    lowest = position & -position  # [N]: 2^ctz(position), 0 at position 0
    ell = torch.arange(L, device=position.device, dtype=torch.int64)
    powers = torch.where(ell < 63, 2 ** ell.clamp(max=62), -1)  # [L]: no int64 position has a lowest bit past 62
    at_j = lowest[:, None] == powers[None, :]  # [N, L]: True at l = j
    upto_j = at_j.flip(-1).cumsum(-1).flip(-1) > 0  # [N, L]: l <= j
    into = torch.cat([torch.zeros_like(at_j[:, :1]), at_j[:, :-1]], dim=1)  # [N, L]: l = j + 1
    upto_j, into = (m[:, None, :, None, None] for m in (upto_j, into))  # [N, L] -> [N, 1, L, 1, 1]
    merged = torch.cumsum(levels, dim=2)  # [N, H, L, K, V]
    return torch.where(into, merged, torch.where(upto_j, torch.zeros_like(levels), levels))


def occupied_levels(position: torch.Tensor, L: int) -> torch.Tensor:
    """``[N, L]`` bool: the levels that can hold keys in a state at ``position [N]`` (those of query
    ``position - 1``): level 0, and level ``l >= 1`` iff bit ``l - 1`` of ``position - 1`` is set; none at 0."""
    last = (position - 1).clamp(min=0)[:, None]  # [N, 1]
    bits = (last >> (torch.arange(L, device=position.device) - 1).clamp(min=0)) & 1  # [N, L]
    level0 = torch.arange(L, device=position.device) == 0  # [L]
    return (level0[None] | (bits == 1)) & (position > 0)[:, None]


def initial_levels(initial_state: LogLinearState | None, N: int, H: int, L: int, K: int, V: int, dtype, device):
    """``(levels [N, H, L, K, V] in dtype, position [N] int64)``; zeros at position 0 (empty state)."""
    if initial_state is None:
        return torch.zeros(N, H, L, K, V, dtype=dtype, device=device), torch.zeros(N, dtype=torch.int64, device=device)
    position = initial_state.position.to(device=device, dtype=torch.int64)
    levels = initial_state.levels.to(dtype) * (position > 0).to(dtype)[:, None, None, None, None]
    return levels, position


def check_loglinear_state(state, N: int, H: int, L: int, K: int, V: int, q: torch.Tensor) -> None:
    """Check an ``initial_state``: ``LogLinearState(levels [N, H, L, K, V] floating, position [N] int64 >= 0)``."""
    if not isinstance(state, LogLinearState):
        raise ValueError(f"initial_state: expected LogLinearState(levels, position), got {type(state).__name__}")
    levels, position = state
    check_state("initial_state.levels", levels, (N, H, L, K, V), q)
    if not isinstance(position, torch.Tensor) or position.dtype != torch.int64 or tuple(position.shape) != (N,):
        got = f"shape {tuple(position.shape)}, dtype {position.dtype}" if isinstance(position, torch.Tensor) else type(position).__name__
        raise ValueError(f"initial_state.position: expected an int64 tensor [{N}], got {got}")
    if position.device != q.device:
        raise ValueError(f"initial_state.position: expected device {q.device} (the device of q), got {position.device}")
    check_value(position >= 0, "initial_state.position: expected positions >= 0")


def check_lam_levels(L: int, state: LogLinearState | None, lengths: torch.Tensor | int) -> None:
    """``lam`` needs ``num_levels(position + length)`` levels for the absolute length each sequence reaches,
    i.e. ``position + length <= 2**(L - 1)``; ``lengths`` is one length for all or a tensor ``[N]``.
    Without a state and with one length the check is on the host; else a value check (no host sync)."""
    if state is None and isinstance(lengths, int):
        ends = None
        end = lengths
    else:
        if state is not None:  # position + tokens must not wrap around int64 (a wrapped end passes any check)
            check_value(state.position <= torch.iinfo(torch.int64).max - lengths,
                        "initial_state: expected position + tokens to fit in int64 for every sequence")
        ends = lengths + (0 if state is None else state.position)  # [N]
        if ends.numel() == 0:  # no sequences (B = 0)
            return
        end = None

    def message(end):
        return (
            f"lam: expected at least num_levels({end}) = {num_levels(end)} levels for the absolute length {end} "
            f"(initial position + tokens), got L = {L}"
        )

    if ends is None:
        if L < num_levels(end):
            raise ValueError(message(end))
        return
    if L - 1 >= 63:  # every int64 end has at most 64 levels
        return
    check_value(
        ends <= 2 ** (L - 1), f"lam: expected L >= num_levels(position + tokens) for every sequence, got L = {L}",
        detail=lambda: message(int(ends.max())),
    )


def state_positions(initial_state: LogLinearState | None, N: int) -> list[int]:
    """The start position of each sequence on the host (0 without an initial state)."""
    return [0] * N if initial_state is None else initial_state.position.tolist()


def empty_batch(q: torch.Tensor, v: torch.Tensor, L: int, output_final_state: bool):
    """The result of a call on no sequences (``B = 0``): ``o [0, T, H, V]`` and an empty state."""
    B, T, H, K = q.shape
    o = v.new_zeros(B, T, H, v.shape[-1], dtype=q.dtype)
    if not output_final_state:
        return o, None
    levels = q.new_zeros(B, H, L, K, v.shape[-1], dtype=compute_dtype(q))
    return o, LogLinearState(levels, torch.zeros(B, dtype=torch.int64, device=q.device))


def widen_levels(lam: torch.Tensor, state: LogLinearState | None, T: int, *, position: int | None = None):
    """``lam [B, T, H, L]`` and ``state`` widened to the levels a call of ``T`` tokens reaches, for models
    that learn a fixed number L of level weights and must still serve any length.

    Levels past lam's last share its weight (the last column is repeated); the state gains empty levels.
    Returns ``(lam, state)`` unchanged while ``L`` suffices (``position + T <= 2**(L - 1)``). ``position``:
    a host bound of the state's positions (a mixer's count of the steps it has run), so nothing is read
    from the device; without it, the largest position is read on the host (one sync).
    """
    L = lam.shape[-1]
    end = T
    if state is not None:
        L = max(L, state.levels.shape[2])
        if position is None:
            position = int(state.position.max()) if state.position.numel() else 0
        end += position
    need = max(L, num_levels(end))
    if need > lam.shape[-1]:
        lam = torch.cat([lam, lam[..., -1:].expand(*lam.shape[:-1], need - lam.shape[-1])], dim=-1)  # [B, T, H, need]
    if state is not None and need > state.levels.shape[2]:
        levels = F.pad(state.levels, [0, 0, 0, 0, 0, need - state.levels.shape[2]])  # [N, H, L, K, V] -> [N, H, need, K, V]
        state = LogLinearState(levels, state.position)
    return lam, state
