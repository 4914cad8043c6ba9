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


def _state_fields(state) -> list[torch.Tensor]:
    return [state] if isinstance(state, torch.Tensor) else list(state)


def assert_states_close(actual, expected, rtol: float, name: str = "state") -> None:
    """Compare two states field by field (a tensor, or a NamedTuple of tensors; integer fields exactly)."""
    for i, (a, e) in enumerate(zip(_state_fields(actual), _state_fields(expected), strict=True)):
        if a.dtype.is_floating_point:
            assert_close_rel(a, e, rtol, f"{name}[{i}]")
        else:
            assert torch.equal(a, e), f"{name}[{i}]: {a.tolist()} != {e.tolist()}"


def assert_continuation(op, inputs: dict, split: int, rtol: float, **kwargs) -> None:
    """``op`` over ``[0, T)`` equals ``op`` over ``[0, split)`` then ``[split, T)`` from its final state.

    ``inputs`` holds the per-token tensors (``[B, T, ...]`` or None) passed by keyword; ``kwargs`` the rest.
    """
    first = {n: None if x is None else x[:, :split] for n, x in inputs.items()}
    second = {n: None if x is None else x[:, split:] for n, x in inputs.items()}
    o_full, s_full = op(**inputs, output_final_state=True, **kwargs)
    o_1, s_1 = op(**first, output_final_state=True, **kwargs)
    o_2, s_2 = op(**second, initial_state=s_1, output_final_state=True, **kwargs)
    assert_close_rel(torch.cat([o_1, o_2], dim=1), o_full, rtol, f"output split at {split}")
    assert_states_close(s_2, s_full, rtol, f"final state split at {split}")


def assert_varlen(op, inputs: dict, lengths: list[int], rtol: float, initial_state=None, **kwargs) -> None:
    """``op`` on sequences packed with ``cu_seqlens`` (``inputs`` have B = 1) equals separate runs."""
    from polyattn.ops.common import state_cat, state_index

    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    cu = torch.tensor(bounds, dtype=torch.int64)
    o, s = op(**inputs, cu_seqlens=cu, initial_state=initial_state, output_final_state=True, **kwargs)
    outs, states = [], []
    for i, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
        piece = {n: None if x is None else x[:, bos:eos] for n, x in inputs.items()}
        o_i, s_i = op(**piece, initial_state=state_index(initial_state, i), output_final_state=True, **kwargs)
        outs.append(o_i)
        states.append(s_i)
    assert_close_rel(o, torch.cat(outs, dim=1), rtol, "packed output")
    assert_states_close(s, state_cat(states), rtol, "packed final states")
