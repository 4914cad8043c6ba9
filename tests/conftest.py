import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run under the interpreter on CPU-only machines (CI); it must be set before triton loads.
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("TRITON_INTERPRET") == "1":
    # every interpreted launch touches only its tensors' storage (polyattn.ops.triton.bounds)
    from polyattn.ops.triton.bounds import check_interpreter_bounds

    check_interpreter_bounds()

    def _patch_lang_once_per_launch():
        """The interpreter patches `triton.language` for a launch, and again at every call of a `@triton.jit`
        function inside the kernel (`tl.sum`, `tl.cumsum` included). What a patch does depends only on the
        modules (`tl`, `tl.core`) the function sees, and nothing undoes an inner patch before the launch's own
        restore: a call whose modules the launch already patched skips the repeat (the same kernels, 30-40%
        less interpreter time)."""
        import inspect

        import triton.language as tl
        from triton.runtime import interpreter

        if not all(hasattr(interpreter, name) for name in ("_patch_lang", "_LangPatchScope", "GridExecutor")):
            return  # another Triton's interpreter: its own patching, slower
        patch_lang, run_grid = interpreter._patch_lang, interpreter.GridExecutor.__call__
        patched = []  # per launch in progress: the ids of the modules patched during it

        def patch_lang_once(fn):
            seen = frozenset(id(m) for m in fn.__globals__.values() if inspect.ismodule(m) and m in (tl, tl.core))
            if patched and seen and seen <= patched[-1]:
                return interpreter._LangPatchScope()  # nothing to restore
            scope = patch_lang(fn)
            if patched:
                patched[-1] |= seen
            return scope

        def run_grid_tracked(self, *args, **kwargs):
            patched.append(frozenset())
            try:
                return run_grid(self, *args, **kwargs)
            finally:
                patched.pop()

        interpreter._patch_lang = patch_lang_once
        interpreter.GridExecutor.__call__ = run_grid_tracked

    _patch_lang_once_per_launch()

if os.environ.get("PYTEST_XDIST_WORKER"):
    # one intra-op thread per xdist worker: the workers already fill the cores
    torch.set_num_threads(1)


# A CUDA error that poisons the context (an illegal address, a device-side assert) makes every later
# test of the same process fail too. Under xdist the worker leaves after reporting such a failure, and
# xdist starts a fresh one for the remaining tests, so one faulting kernel fails only its own tests
# (reported twice: as the failure and as the worker's crash).
_POISONED = ("illegal memory access", "device-side assert", "unspecified launch failure", "an illegal instruction")
_poisoned = []


def pytest_runtest_makereport(item, call):
    if call.excinfo is not None and any(text in str(call.excinfo.value) for text in _POISONED):
        _poisoned.append(item.nodeid)


def pytest_runtest_logfinish(nodeid, location):
    if _poisoned and os.environ.get("PYTEST_XDIST_WORKER"):
        os._exit(3)  # after the report went out: xdist restarts the worker


def pytest_runtest_teardown(item, nextitem):
    if torch.cuda.is_available() and os.environ.get("PYTEST_XDIST_WORKER"):
        # the workers share one GPU: a test's cached blocks go back to the driver, so a memory-heavy test in one
        # worker does not leave the others out of memory (three workers beside the log-linear file's long-sequence
        # test on an H100: CUDA out of memory, even for loading a kernel)
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True, scope="session")
def _poisoned_empty():
    """With POLYATTN_POISON_EMPTY=1, every torch.empty is NaN-filled for the whole run (polyattn.testing.poisoned_empty):
    a read of memory nobody wrote shows."""
    if os.environ.get("POLYATTN_POISON_EMPTY") != "1":
        yield
        return
    from polyattn.testing import poisoned_empty

    with poisoned_empty():
        yield
