"""``ops.hla``: dispatch, defaults, dtypes, and ValueError on bad input."""

import pytest
import torch

from hla_cases import hla_inputs
from polyattn import ops
from polyattn.ops.hla import AHLAState, HLA2State, hla_naive
from polyattn.testing import assert_close_rel

TOL = 1e-10


def _x(B=1, T=5, H=2, K=3, V=2, normalize=False):
    return hla_inputs(B, T, H, K, V, decay=True, normalize=normalize, seed=40)


def test_auto_is_chunk_on_cpu_with_default_scale():
    x = _x()
    o, s = ops.hla(**x, order=3, output_final_state=True)
    o_ref, s_ref = hla_naive(**x, order=3, scale=3 ** -0.5, output_final_state=True)
    assert_close_rel(o, o_ref, TOL)
    assert_close_rel(s.F, s_ref.F, TOL)
    assert ops.hla(**x)[1] is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("impl", ["recurrent", "chunk", "scan"])
def test_output_dtype_and_fp32_state(impl, dtype):
    x = {n: t.to(dtype) for n, t in _x().items()}
    o, s = ops.hla(**x, impl=impl, output_final_state=True)
    assert o.dtype == dtype and all(f.dtype == torch.float32 for f in s)
    o_ref, _ = ops.hla(**{n: t.double() for n, t in x.items()}, impl="naive")
    assert_close_rel(o, o_ref, 1e-5 if dtype == torch.float32 else 1e-2)


def test_normalized_positive_features_are_convex_combinations():
    # With nonnegative q, k every weight is >= 0, so |o| <= max |v|; signed features break this
    # (ops/hla/README.md, "Normalized variant").
    x = hla_inputs(2, 40, 2, 4, 3, decay=True, normalize=True, seed=41)
    for order, asymmetric in ((2, False), (2, True), (3, False)):
        o, _ = ops.hla(**x, order=order, asymmetric=asymmetric, normalize=True)
        assert o.abs().max() <= x["v"].abs().max()


BAD = {
    "order-4": (dict(order=4), "order must be one of"),
    "order-3-asymmetric": (dict(order=3, asymmetric=True), "AHLA is second order only"),
    "g-positive": (dict(g=torch.full((1, 5, 2), 0.1, dtype=torch.float64)), "g <= 0"),
    "g-shape": (dict(g=torch.zeros(1, 5, 3, dtype=torch.float64)), "g: expected shape"),
    "v-length": (dict(v=torch.zeros(1, 4, 2, 2, dtype=torch.float64)), "v: expected shape"),
    "k-dim": (dict(k=torch.zeros(1, 5, 2, 4, dtype=torch.float64)), "k: expected shape"),
    "q-dtype": (dict(q=torch.zeros(1, 5, 2, 3, dtype=torch.float32)), "one dtype"),
    "impl-unknown": (dict(impl="fast"), "impl must be"),
    "state-type": (dict(initial_state=AHLAState(torch.zeros(1, 2, 3, 2), torch.zeros(1, 2, 3, 2))), "expected HLA2State"),
    "state-plain-tuple": (dict(initial_state=(torch.zeros(1, 2, 3, 3), torch.zeros(1, 2, 3, 2))), "expected HLA2State"),
    "state-shape-normalized": (
        dict(normalize=True, initial_state=HLA2State(torch.zeros(1, 2, 3, 3), torch.zeros(1, 2, 3, 2))),
        r"initial_state.F: expected shape \[1, 2, 3, 3\]",
    ),
    "state-batch": (dict(initial_state=HLA2State(torch.zeros(2, 2, 3, 3), torch.zeros(2, 2, 3, 2))), "initial_state.S"),
    "cu_seqlens-end": (dict(cu_seqlens=torch.tensor([0, 2, 4])), "end at T = 5"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_raises_value_error(case):
    kwargs, match = BAD[case]
    x = _x()
    x.update({n: kwargs.pop(n) for n in ("q", "k", "v", "g") if n in kwargs})
    with pytest.raises(ValueError, match=match):
        ops.hla(**x, **kwargs)


def test_cu_seqlens_needs_batch_one():
    with pytest.raises(ValueError, match="B = 1"):
        ops.hla(**_x(B=2), cu_seqlens=torch.tensor([0, 2, 5]))


def test_missing_impl_raises_not_implemented():
    with pytest.raises(NotImplementedError, match="hla has no impl='parallel'"):
        ops.hla(**_x(), impl="parallel")
