"""Test helpers: relative errors and seeded inputs (used by the test suite and by benchmarks)."""

from __future__ import annotations

import torch


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max |actual - expected| / max |expected|`` in float64 (0 when both are zero)."""
    a = actual.detach().to(torch.float64)
    e = expected.detach().to(torch.float64)
    err = (a - e).abs().max().item() if a.numel() else 0.0
    ref = e.abs().max().item() if e.numel() else 0.0
    if ref == 0.0:
        return err
    return err / ref


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, rtol: float, name: str = "") -> None:
    """Assert equal shapes, finite values and ``rel_err(actual, expected) <= rtol``."""
    label = f"{name}: " if name else ""
    assert actual.shape == expected.shape, f"{label}shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert bool(torch.isfinite(actual).all()), f"{label}non-finite values"
    err = rel_err(actual, expected)
    assert err <= rtol, f"{label}relative error {err:.3e} > {rtol:.1e}"


def seeded_inputs(B, T, H, K, V, *, dtype=torch.float64, decay=True, beta=False, seed=0, device="cpu") -> dict:
    """Deterministic ``q, k, v: [B, T, H, *]``, ``g: [B, T, H]`` in about [-0.3, 0] (or None), ``beta`` in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)

    out = {"q": randn(B, T, H, K), "k": randn(B, T, H, K), "v": randn(B, T, H, V)}
    out["g"] = (-0.3 * torch.rand(B, T, H, generator=gen, dtype=torch.float64)).to(device=device, dtype=dtype) if decay else None
    out["beta"] = torch.sigmoid(randn(B, T, H)).to(dtype) if beta else None
    return out
