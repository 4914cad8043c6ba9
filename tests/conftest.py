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
