"""The suite's two memory checks. `polyattn.ops.triton.bounds`: under the interpreter (where the suite installs it),
a launch that touches memory outside its tensors fails, naming the kernel; masked-off addresses and in-bounds
ones pass (on a GPU the hardware checks instead, so these run only interpreted). `polyattn.testing.poisoned_empty`:
NaN-filled scratch for reads of memory nobody wrote."""
import pytest
import torch
import triton
import triton.language as tl

from polyattn.ops.triton.bounds import check_interpreter_bounds
from polyattn.ops.triton.precision import interpreting

interpreted = pytest.mark.skipif(not interpreting(), reason="the checks hook Triton's CPU interpreter")


@triton.jit
def _copy_kernel(x, y, n_load, n_store, ADD: tl.constexpr):
    o = tl.arange(0, 16)
    v = tl.load(x + o, mask=o < n_load, other=0.0)
    if ADD:
        tl.atomic_add(y + o, v, mask=o < n_store)
    else:
        tl.store(y + o, v, mask=o < n_store)


@interpreted
def test_the_suite_checks_every_interpreted_launch():
    """tests/conftest.py installed the checks before any test ran."""
    from triton.runtime.interpreter import InterpreterBuilder

    assert getattr(InterpreterBuilder, "_polyattn_bounds", False)


@interpreted
@pytest.mark.parametrize("add", [False, True], ids=["store", "atomic"])
def test_in_bounds_and_masked_off_addresses_pass(add):
    check_interpreter_bounds()
    x, y = torch.arange(8, dtype=torch.float32), torch.zeros(16)
    _copy_kernel[(1,)](x, y, 8, 16, ADD=add)  # lanes 8..15 of x are masked off
    assert torch.equal(y, torch.cat([x, torch.zeros(8)]))


@interpreted
@pytest.mark.parametrize("n_load, n_store, add, what", [(9, 8, False, "a load"), (8, 9, False, "a store"),
                                                         (8, 9, True, "an atomic")])
def test_an_access_past_a_tensor_fails_naming_the_kernel(n_load, n_store, add, what):
    """Both tensors hold 8 elements; one lane too many reads or writes the element past one's end (two separate
    allocations: the CPU allocator's alignment and block headers leave no tensor starting right at another's end)."""
    check_interpreter_bounds()
    x, y = torch.arange(8, dtype=torch.float32), torch.zeros(8)
    with pytest.raises(Exception, match=f"_copy_kernel: {what} of 1 element"):
        _copy_kernel[(1,)](x, y, n_load, n_store, ADD=add)


@interpreted
def test_a_view_is_bounded_by_its_storage_not_its_shape():
    """A view of a larger tensor may be read past its own end inside its storage: the check is the storage's
    (what the GPU would fault on), not the view's shape."""
    check_interpreter_bounds()
    base = torch.arange(24, dtype=torch.float32)
    y = torch.zeros(16)
    _copy_kernel[(1,)](base[4:12], y, 16, 16, ADD=False)
    assert torch.equal(y, base[4:20])


def test_poisoned_empty_fills_floats_with_nan_and_restores():
    """`polyattn.testing.poisoned_empty` (the suite's `POLYATTN_POISON_EMPTY=1` mode, the companion of the bounds
    checks for reads of memory nobody wrote): floating `empty`, `empty_like`, `new_empty` come NaN-filled, integer
    ones as they are, and the three are restored on exit."""
    from polyattn.testing import poisoned_empty

    before = torch.empty, torch.empty_like, torch.Tensor.new_empty
    with poisoned_empty():
        ones = torch.ones(3)
        assert torch.empty(4).isnan().all() and torch.empty_like(ones).isnan().all() and ones.new_empty(2, 2).isnan().all()
        assert torch.empty(3, dtype=torch.int64).dtype == torch.int64
    assert (torch.empty, torch.empty_like, torch.Tensor.new_empty) == before
