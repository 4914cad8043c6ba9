"""A NaN or Inf at position p never changes an output before p, in every op and PyTorch form.

Outputs before p must be bit-identical to a clean run of the same shape; the planted token must reach
its own output (so the plant is not silently ignored). Positions: inside a chunk (100) and on a chunk's
first token (64), with the default chunk size 64 and T = 150.
"""

import pytest
import torch

from op_cases import BY_NAME, FORM_IDS, FORM_PARAMS, case_inputs

PLANTS = [(field, value, p) for field in ("q", "k", "v", "beta", "lam") for value in ("nan", "inf") for p in (64, 100)]
PLANTS += [("g", "nan", p) for p in (64, 100)]  # -inf in g is a reset (test_extreme_decay.py), NaN is non-finite input


def uses(name, field):
    if field == "beta":
        return name.startswith(("delta", "loglinear-gdn", "deltakata"))
    if field == "g":
        return True  # every case that has a g
    return field != "lam" or name.startswith("loglinear")


@pytest.mark.parametrize("name, impl", FORM_PARAMS, ids=FORM_IDS)
def test_future_nonfinite_leaves_earlier_outputs_bit_identical(name, impl):
    case = BY_NAME[name]
    clean = case_inputs()
    o_clean, _ = case.call(clean, impl)
    assert bool(torch.isfinite(o_clean).all())
    for field, value, p in PLANTS:
        if not uses(name, field) or clean.get(field) is None:
            continue
        x = {n: t.clone() for n, t in clean.items()}
        x[field][:, p, 0] = float(value)  # head 0
        o, _ = case.call(x, impl)
        assert torch.equal(o[:, :p], o_clean[:, :p]), f"{field}={value} at {p} changed an earlier output"
        if field in ("k", "v", "g"):
            assert not bool(torch.isfinite(o[:, p:, 0]).all()), f"{field}={value} at {p} never reached an output"
