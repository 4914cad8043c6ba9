"""Chunk padding and reshaping along the time axis (dimension 1 of ``[B, T, ...]``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pad_time(x: torch.Tensor | None, C: int) -> torch.Tensor | None:
    """Zero-pad ``x: [B, T, ...]`` along time to a multiple of ``C``; None passes through."""
    if x is None:
        return None
    pad = (-x.shape[1]) % C
    if pad == 0:
        return x
    widths = [0, 0] * (x.dim() - 2) + [0, pad]  # F.pad lists the last dimension first
    return F.pad(x, widths)  # [B, T, ...] -> [B, T + pad, ...]


def to_chunks(x: torch.Tensor, C: int) -> torch.Tensor:
    """``[B, T, ...] -> [B, T // C, C, ...]``; T must be a multiple of C (call :func:`pad_time` first)."""
    B, T = x.shape[:2]
    if T % C:
        raise ValueError(f"to_chunks: expected T to be a multiple of the chunk size {C}, got T = {T}")
    return x.reshape(B, T // C, C, *x.shape[2:])
