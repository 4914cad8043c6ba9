"""Input validation shared by every op: one place that says what was expected and what came.

Every check raises ``ValueError`` with a message of the form ``"<name>: expected ..., got ..."``.

Structural checks (types, shapes, dtypes, devices, options) run on the host and cost nothing. Checks of
tensor *values* (``g <= 0``, ``cu_seqlens`` offsets, state positions) go through :func:`check_value`,
which never synchronises with a GPU and never breaks a ``torch.compile`` graph; see
:func:`set_value_checks` for the modes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

VALUE_CHECK_MODES = ("auto", "sync", "async", "off")
_value_checks = {"mode": "auto"}


def set_value_checks(mode: str) -> str:
    """Choose how :func:`check_value` checks tensor values; returns the previous mode.

    - ``"auto"`` (default): CPU tensors outside ``torch.compile`` are checked at once (``ValueError``);
      CUDA tensors and compiled code use ``"async"``.
    - ``"sync"``: always check at once, raising ``ValueError`` (a host sync on CUDA, a graph break
      under ``torch.compile``): for debugging.
    - ``"async"``: ``torch._assert_async``, no host sync and no graph break. A failure raises
      ``RuntimeError`` with the same message: at the call on CPU; on CUDA as a device-side assert
      at the next synchronisation, which leaves the CUDA context unusable.
    - ``"off"``: no value checks (structural checks still run).
    """
    check_choice("mode", mode, VALUE_CHECK_MODES)
    previous, _value_checks["mode"] = _value_checks["mode"], mode
    return previous


def check_value(ok: torch.Tensor, message: str, detail: Callable[[], str] | None = None) -> None:
    """Check that the boolean tensor ``ok`` is all True, per the mode of :func:`set_value_checks`.

    ``detail``, when given, builds a fuller message from the values; it runs only where the check is
    made on the host (the failure is certain there and the values are at hand).
    """
    mode = _value_checks["mode"]
    if mode == "off" or ok.device.type == "meta":
        return
    deferred = ok.device.type != "cpu" or torch.compiler.is_compiling()
    if mode == "async" or (mode == "auto" and deferred):
        torch._assert_async(ok.all(), message)
    elif not bool(ok.all()):
        raise ValueError(message if detail is None else detail())


def _describe(x: torch.Tensor) -> str:
    return f"shape {tuple(x.shape)}, dtype {x.dtype}, device {x.device}"


def _check_tensor(name: str, x, ref: torch.Tensor | None = None) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOATING:
        raise ValueError(f"{name}: expected a floating dtype (fp16, bf16, fp32, fp64), got {x.dtype}")
    if ref is not None and x.device != ref.device:
        raise ValueError(f"{name}: expected device {ref.device} (the device of q), got {x.device}")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int, int]:
    """Check ``q, k: [B, T, H, K]`` and ``v: [B, T, H, V]``; return ``(B, T, H, K, V)``."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x, q if name != "q" else None)
        if x.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D tensor [B, T, H, D], got {_describe(x)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v: expected one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k: expected shape {tuple(q.shape)} (same [B, T, H, K] as q), got {tuple(k.shape)}")
    if v.shape[:3] != (B, T, H):
        raise ValueError(f"v: expected shape [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    if T == 0 or K == 0 or v.shape[3] == 0:
        raise ValueError(f"q, k, v: expected non-empty T, K and V, got q {tuple(q.shape)}, v {tuple(v.shape)}")
    return B, T, H, K, v.shape[3]


def check_per_token(name: str, x: torch.Tensor, q: torch.Tensor, *, last_dim: int | None = None) -> None:
    """Check a per-token tensor: ``[B, T, H]``, or ``[B, T, H, last_dim]`` (``last_dim=-1``: any size >= 1)."""
    _check_tensor(name, x, q)
    B, T, H = q.shape[:3]
    if last_dim is None:
        if tuple(x.shape) != (B, T, H):
            raise ValueError(f"{name}: expected shape [B, T, H] = [{B}, {T}, {H}], got {tuple(x.shape)}")
        return
    if x.dim() != 4 or tuple(x.shape[:3]) != (B, T, H) or (last_dim >= 0 and x.shape[3] != last_dim) or x.shape[3] < 1:
        want = "L" if last_dim < 0 else str(last_dim)
        raise ValueError(f"{name}: expected shape [B, T, H, {want}] = [{B}, {T}, {H}, {want}], got {tuple(x.shape)}")


def check_log_decay(g: torch.Tensor, q: torch.Tensor) -> None:
    """Check the per-token log-decay ``g: [B, T, H]``: ``g <= 0`` wherever it is a number (decays at most 1).

    ``g = -inf`` is an exact reset: the weight across that token is exactly 0. A NaN is non-finite input,
    like one in q, k or v: it reaches the outputs from its token on and never an earlier one.
    """
    check_per_token("g", g, q)
    message = "g: expected a log-decay g <= 0 everywhere (-inf: an exact reset), got a value > 0"
    check_value(~(g > 0), message, detail=lambda: f"{message} (max {g.nan_to_num(nan=-float('inf')).max().item():.4g})")


def check_cu_seqlens(cu_seqlens: torch.Tensor | None, q: torch.Tensor) -> int:
    """Check FlashAttention-style ``cu_seqlens`` (``[N + 1]``, 0 = start, strictly increasing, T = end).

    Returns N, the number of sequences (B when ``cu_seqlens`` is None).
    """
    if cu_seqlens is None:
        return q.shape[0]
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"cu_seqlens: expected an int64 tensor [N + 1], got {type(cu_seqlens).__name__}")
    if q.shape[0] != 1:
        raise ValueError(f"cu_seqlens: expected batch size B = 1 with packed sequences, got B = {q.shape[0]}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens: expected a 1-D tensor [N + 1] with N >= 1, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"cu_seqlens: expected dtype int64 (or int32), got {cu_seqlens.dtype}")
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens: expected device {q.device} (the device of q), got {cu_seqlens.device}")
    T = q.shape[1]
    for ok, message in (
        ((cu_seqlens[0] == 0) & (cu_seqlens[-1] == T), f"cu_seqlens: expected to start at 0 and end at T = {T}"),
        (cu_seqlens[1:] > cu_seqlens[:-1], "cu_seqlens: expected strictly increasing offsets (every sequence non-empty)"),
    ):
        check_value(ok, message, detail=lambda message=message: f"{message}, got {cu_seqlens.tolist()}")
    return cu_seqlens.numel() - 1


def check_state(name: str, state: torch.Tensor, expected_shape: Sequence[int], q: torch.Tensor) -> None:
    """Check a state tensor: exactly ``expected_shape``, floating, on q's device."""
    _check_tensor(name, state, q)
    if tuple(state.shape) != tuple(expected_shape):
        raise ValueError(f"{name}: expected shape {list(expected_shape)}, got {list(state.shape)}")


def check_choice(name: str, value, choices: Sequence) -> None:
    """Check that ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def check_flag(name: str, value) -> None:
    """Check a boolean option (a Python bool: ``0``, ``"no"`` or a tensor are refused)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected a bool, got {value!r}")


def check_positive(name: str, value) -> float:
    """Check a positive, finite Python number (not a bool); return it as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < finite_float(value) < float("inf"):
        raise ValueError(f"{name}: expected a positive float (finite, not a bool), got {value!r}")
    return float(value)


def finite_float(value: int | float) -> float:
    """``float(value)``, or inf for a Python int too large for a float (``float(10**400)`` raises)."""
    try:
        return float(value)
    except OverflowError:
        return float("inf")


def resolve_scale(scale: float | None, K: int) -> float:
    """The query scale: ``K ** -0.5`` by default."""
    if scale is None:
        return K ** -0.5
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise ValueError(f"scale: expected a Python float or None, got {type(scale).__name__}")
    if not abs(finite_float(scale)) < float("inf"):
        raise ValueError(f"scale: expected a finite float, got {scale!r}")
    return float(scale)


class Dims(NamedTuple):
    """Sizes of a checked call: batch, time, heads, key width, value width, number of sequences."""

    B: int
    T: int
    H: int
    K: int
    V: int
    N: int


def check_inputs(q, k, v, g=None, cu_seqlens=None, output_final_state=False, **per_token) -> Dims:
    """The checks every op starts with: ``q, k, v``, the log-decay ``g``, ``cu_seqlens``,
    ``output_final_state`` and each ``[B, T, H]`` tensor in ``per_token`` (e.g. ``beta=beta``; None entries
    are skipped)."""
    check_flag("output_final_state", output_final_state)
    B, T, H, K, V = check_qkv(q, k, v)
    for name, x in per_token.items():
        if x is not None:
            check_per_token(name, x, q)
    if g is not None:
        check_log_decay(g, q)
    return Dims(B, T, H, K, V, check_cu_seqlens(cu_seqlens, q))
