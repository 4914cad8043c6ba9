"""Fenwick levels of log-linear attention (ops/loglinear/README.md, "Levels"), from integer bits only.

For absolute 0-based positions ``s <= t``, key ``s`` sits in level ``level(t, s)`` of query ``t``:
level 0 is the token itself and level ``l >= 1`` holds ``2**(l-1)`` consecutive keys, non-empty iff
bit ``l - 1`` of ``t`` is set. ``python -m polyattn.ops.common.fenwick 16`` prints the grid.
"""

from __future__ import annotations

import sys

import torch


def level(t: int, s: int) -> int:
    """Level of key ``s`` for query ``t`` (``0 <= s <= t``): 0 if ``s == t`` else ``bit_length(t XOR s)``."""
    if not 0 <= s <= t:
        raise ValueError(f"level: expected 0 <= s <= t, got t = {t}, s = {s}")
    return (t ^ s).bit_length()


def num_levels(T: int) -> int:
    """Levels needed for absolute length ``T``: ``(T - 1).bit_length() + 1`` (1 for ``T <= 1``)."""
    return max(T - 1, 0).bit_length() + 1


def level_matrix(T: int, offset: int = 0, device=None) -> torch.Tensor:
    """Dense ``[T, T]`` int64 levels of absolute positions ``offset + t`` and ``offset + s``; -1 above the diagonal.

    For the naive spec and tests only: fast forms use :func:`level_table` on a chunk.
    """
    pos = torch.arange(offset, offset + T, device=device, dtype=torch.int64)  # [T]
    x = pos[:, None] ^ pos[None, :]  # [T, T]
    lev = torch.zeros_like(x)
    for _ in range(max(offset + T - 1, 0).bit_length()):  # bit_length(x) = right shifts to reach 0; x < 2**bits
        lev += (x > 0).long()
        x = x >> 1
    return lev.masked_fill(pos[None, :] > pos[:, None], -1)


def level_table(C: int, device=None) -> torch.Tensor:
    """Intra-chunk level table ``[C, C]`` for a chunk size ``C`` that is a power of two.

    Within a chunk that starts at a multiple of ``C``, levels depend only on the in-chunk offsets
    (ops/loglinear/README.md, "Chunk factorisation"), so this table serves every chunk.
    """
    if C < 1 or C & (C - 1):
        raise ValueError(f"level_table: expected a power-of-two chunk size, got {C}")
    return level_matrix(C, device=device)


def format_grid(T: int) -> str:
    """The level grid of length ``T`` as text, one row per query (binary position, then levels)."""
    width = max(T - 1, 1).bit_length()
    rows = []
    for t in range(T):
        cells = " ".join(f"{level(t, s):>2}" for s in range(t + 1))
        rows.append(f"{t:>4} ({t:0{width}b}) {cells}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    T = int(args[0]) if args else 16
    print(f"Fenwick levels for T = {T} (row = query t, column = key s <= t); num_levels = {num_levels(T)}")
    print(format_grid(T))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
