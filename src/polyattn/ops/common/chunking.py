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


def heads_chunks(x: torch.Tensor, C: int) -> torch.Tensor:
    """Per-token ``[B, T, H, ...]`` -> ``[B, H, N, C, ...]``, zero-padded along time to a multiple of C."""
    return to_chunks(pad_time(x, C), C).movedim(3, 1)  # [B, T, H, ...] -> [B, N, C, H, ...] -> [B, H, N, C, ...]


def heads_unchunk(x: torch.Tensor, T: int) -> torch.Tensor:
    """``[B, H, N, C, D] -> [B, T, H, D]``, dropping the padding (inverse of :func:`heads_chunks`)."""
    return x.flatten(2, 3).transpose(1, 2)[:, :T]  # [B, H, N*C, D] -> [B, N*C, H, D] -> [B, T, H, D]
