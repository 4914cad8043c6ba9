"""Bounds checks for Triton's CPU interpreter (`TRITON_INTERPRET=1`).

The interpreter runs a kernel's loads and stores on host memory: an address past a tensor's end (a mask that
lets one row too many through, an offset computed for the wrong layout) reads a neighbouring allocation or
nothing at all, where the GPU would raise an illegal address or return another tensor's data. After
`check_interpreter_bounds()`, every address a kernel touches where its mask is true (masked loads and stores,
atomic read-modify-writes) must lie inside the storage of one of the launch's tensor arguments; otherwise the
launch fails with `OutOfBounds`, naming the kernel. The test suite installs it for every interpreted run.

It hooks the interpreter's launch (the tensors a launch holds) and its memory builder. Those are Triton's
internals: if a Triton release renames them, `check_interpreter_bounds` raises rather than leaving the runs
unchecked.
"""
from __future__ import annotations

import numpy as np


class OutOfBounds(RuntimeError):
    """A kernel under the interpreter touched memory outside every tensor of its launch."""


# the launch in progress (the interpreter runs one at a time): its kernel's name and the sorted storage spans
_LAUNCH = {"kernel": "?", "lo": np.zeros(0, dtype=np.uint64), "hi": np.zeros(0, dtype=np.uint64)}


def _spans(args) -> dict:
    """{storage start: storage end} of every tensor in `args` (nested in tuples too)."""
    spans = {}
    for arg in args:
        if isinstance(arg, tuple):
            spans.update(_spans(arg))
        elif hasattr(arg, "untyped_storage"):
            storage = arg.untyped_storage()
            spans[storage.data_ptr()] = storage.data_ptr() + storage.nbytes()
    return spans


def _check(ptrs, mask, what: str) -> None:
    """Raise OutOfBounds unless every address of `ptrs` whose mask is true lies inside one storage span."""
    addr = ptrs.data if mask is None else ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape)]
    addr = np.asarray(addr, dtype=np.uint64).ravel()
    if addr.size == 0:
        return
    size = ptrs.get_element_ty().primitive_bitwidth // 8
    lo, hi = _LAUNCH["lo"], _LAUNCH["hi"]
    span = np.searchsorted(lo, addr, side="right").astype(np.int64) - 1  # the last span starting at or before
    inside = (span >= 0) & (addr + np.uint64(size) <= hi[np.maximum(span, 0)])
    if not inside.all():
        bad = addr[~inside]
        raise OutOfBounds(
            f"{_LAUNCH['kernel']}: {what} of {bad.size} element(s) outside every tensor of the launch "
            f"(first at address {int(bad[0]):#x}; the launch's tensors span "
            f"{', '.join(f'{int(a):#x}+{int(b - a)}' for a, b in zip(lo, hi))})"
        )


def check_interpreter_bounds() -> None:
    """Install the checks (idempotent). ValueError if this Triton's interpreter lacks the hooks they need."""
    from triton.runtime import interpreter

    executor, builder = getattr(interpreter, "GridExecutor", None), getattr(interpreter, "InterpreterBuilder", None)
    needed = [(executor, "_init_args_hst"), (builder, "create_masked_load"), (builder, "create_masked_store"),
              (builder, "create_atomic_rmw")]
    missing = [name for owner, name in needed if owner is None or not hasattr(owner, name)]
    if missing:
        raise ValueError(f"check_interpreter_bounds: this Triton's interpreter has no {', '.join(missing)}")
    if getattr(builder, "_polyattn_bounds", False):
        return
    init_args, load, store, rmw = (getattr(owner, name) for owner, name in needed)

    def init_args_checked(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        spans = sorted(_spans([*args_hst, *kwargs_hst.values()]).items())
        _LAUNCH["kernel"] = getattr(self.fn, "__name__", "?")
        _LAUNCH["lo"] = np.array([a for a, _ in spans], dtype=np.uint64)
        _LAUNCH["hi"] = np.array([b for _, b in spans], dtype=np.uint64)
        return args_hst, kwargs_hst

    def load_checked(self, ptrs, mask, other, *args):
        _check(ptrs, mask, "a load")
        return load(self, ptrs, mask, other, *args)

    def store_checked(self, ptrs, value, mask, *args):
        _check(ptrs, mask, "a store")
        return store(self, ptrs, value, mask, *args)

    def rmw_checked(self, op, ptr, val, mask, *args):
        _check(ptr, mask, "an atomic")
        return rmw(self, op, ptr, val, mask, *args)

    executor._init_args_hst = init_args_checked
    builder.create_masked_load = load_checked
    builder.create_masked_store = store_checked
    builder.create_atomic_rmw = rmw_checked
    builder._polyattn_bounds = True
