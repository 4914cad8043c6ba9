"""Huge and infinite log-decays: every PyTorch form stays exact, and ``g = -inf`` is an exact reset.

Chunk forms run with the default chunk size 64 on T = 150: each head gets its own planted values
(-1e4, -1e30, ``finfo(float32).min`` twice in a row, -inf) on a chunk's first token, its last token
and inside a chunk; one head keeps an ordinary decay.
"""

import pytest
import torch

from op_cases import BY_NAME, FORM_IDS, FORM_PARAMS, case_inputs
from polyattn.testing import assert_close_rel, assert_states_close

FMIN = float(torch.finfo(torch.float32).min)
# head -> planted (log-decay, positions): on a chunk's first token (64), its last (63, 127), inside (100)
PLANTS = {
    0: ((-1e4, (64, 100)),),
    1: ((-1e30, (100, 127)),),
    2: ((FMIN, (63, 64)), (FMIN, (100, 101))),
    3: ((float("-inf"), (64,)), (float("-inf"), (100,))),
}  # head 4 keeps an ordinary decay


def planted(dtype=torch.float64):
    x = case_inputs(H=5, dtype=torch.float64)
    for head, plants in PLANTS.items():
        for value, positions in plants:
            for p in positions:
                x["g"][:, p, head] = value
    return {n: t.to(dtype) for n, t in x.items()}


@pytest.mark.parametrize("name, impl", FORM_PARAMS, ids=FORM_IDS)
def test_float64_form_matches_naive(name, impl):
    case = BY_NAME[name]
    x = planted()
    o_ref, s_ref = case.call(x, "naive", output_final_state=True)
    o, s = case.call(x, impl, output_final_state=True)
    assert_close_rel(o, o_ref, 1e-10, f"{name}-{impl} output")
    assert_states_close(s, s_ref, 1e-10, f"{name}-{impl} final state")


@pytest.mark.parametrize("name", list(BY_NAME))
def test_naive_matches_recurrence(name):
    """The spec against the token loop (exp(g) S: nothing to cancel), head by head."""
    case = BY_NAME[name]
    x = planted()
    o_naive, o_rec = case.call(x, "naive")[0], case.call(x, "recurrent")[0]
    for head in range(5):
        assert_close_rel(o_naive[:, :, head], o_rec[:, :, head], 1e-10, f"{name} head {head}")


@pytest.mark.parametrize("name, impl", FORM_PARAMS, ids=FORM_IDS)
def test_float32_form_close_to_float64(name, impl):
    case = BY_NAME[name]
    ref, _ = case.call(planted(), "naive")
    o, _ = case.call(planted(torch.float32), impl)
    for head in range(5):
        assert_close_rel(o[:, :, head], ref[:, :, head], 1e-5, f"{name}-{impl} float32 head {head}")


@pytest.mark.parametrize("r", [64, 100])
@pytest.mark.parametrize("name, impl", FORM_PARAMS, ids=FORM_IDS)
def test_minus_inf_is_an_exact_reset(name, impl, r):
    """With g[r] = -inf in every head, tokens r: equal a fresh run on them; the weight across r is 0."""
    case = BY_NAME[name]
    x = case_inputs()
    x["g"][:, r] = float("-inf")
    o, s = case.call(x, impl, output_final_state=True)
    o_tail, s_tail = case.restart(x, r, impl, output_final_state=True)
    assert_close_rel(o[:, r:], o_tail, 1e-10, "after the reset")
    assert_states_close(s, s_tail, 1e-10)
    assert_close_rel(o[:, :r], case.call({n: t[:, :r] for n, t in x.items()}, impl)[0], 1e-10, "before the reset")


def test_validation_accepts_minus_inf_and_nan_and_rejects_positive():
    """-inf is a reset, NaN non-finite input (test_nonfinite_causality.py); g > 0 is refused."""
    x = case_inputs(T=8)
    x["g"][:, 3] = float("-inf")
    BY_NAME["linear"].call(x, "chunk")
    x["g"][:, 3] = float("nan")
    o, _ = BY_NAME["linear"].call(x, "chunk")
    assert bool(torch.isfinite(o[:, :3]).all()) and not bool(torch.isfinite(o[:, 3:]).all())
    x["g"][:, 4] = 0.5
    with pytest.raises(ValueError, match=r"g: expected a log-decay g <= 0 .*got a value > 0 \(max 0\.5\)"):
        BY_NAME["linear"].call(x, "chunk")
