"""A NaN or Inf at position p never changes an output before p, nor any output or final state of another sequence
(a batch row, a packed document), in every op and PyTorch form.

Outputs before p must be bit-identical to a clean run of the same shape; the planted token must reach
its own output (so the plant is not silently ignored). Positions: inside a chunk (100) and on a chunk's
first token (64), with the default chunk size 64 and T = 150.
"""

import pytest
import torch

from op_cases import BY_NAME, FORM_IDS, FORM_PARAMS, case_inputs
from polyattn.ops.common import state_index

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


def states_equal(a, b) -> bool:
    """Bitwise equality of two states (a tensor, or a named tuple of them)."""
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return all(states_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("name, impl", FORM_PARAMS, ids=FORM_IDS)
def test_nonfinite_token_stays_in_its_sequence(name, impl):
    """A NaN or Inf in one sequence changes no output or final state of another: in a batch (row 1 poisoned, row 0
    compared) and in a packed call (the middle document poisoned, the documents before and after it compared)."""
    case = BY_NAME[name]
    cu = torch.tensor([0, 40, 104, 150])  # T = 150 packed: the middle document poisoned
    for packed in (False, True):
        clean = case_inputs(B=1 if packed else 2)
        kwargs = dict(output_final_state=True, cu_seqlens=cu if packed else None)
        o_clean, s_clean = case.call(clean, impl, **kwargs)
        keep = [0, 2] if packed else [0]  # the sequences that must not change
        for field in ("q", "k", "v", "beta", "g", "lam"):
            if not uses(name, field) or clean.get(field) is None:
                continue
            for value in ("nan", "inf") if field != "g" else ("nan",):
                x = {n: t.clone() for n, t in clean.items()}
                if packed:
                    x[field][0, 70, 0] = float(value)  # inside the middle document
                else:
                    x[field][1, 30, 0] = float(value)
                o, s = case.call(x, impl, **kwargs)
                where = f"{field}={value} in {'document 1' if packed else 'row 1'}"
                for i in keep:
                    rows = (slice(None), slice(int(cu[i]), int(cu[i + 1]))) if packed else (i,)
                    assert torch.equal(o[rows], o_clean[rows]), f"{where} changed sequence {i}'s outputs"
                    assert states_equal(state_index(s, i), state_index(s_clean, i)), f"{where} changed sequence {i}'s final state"
