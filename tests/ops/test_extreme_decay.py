"""Huge and infinite log-decays: every PyTorch form stays exact, and ``g = -inf`` is an exact reset.

Chunk forms run with the default chunk size 64 on T = 150: resets sit on a chunk's first token (64),
its last (127) and inside a chunk (100); ``finfo.min`` is planted twice in a row.
"""

import pytest
import torch

from op_cases import BY_NAME, FORM_IDS, FORM_PARAMS, case_inputs
from polyattn.testing import assert_close_rel, assert_states_close

FMIN = float(torch.finfo(torch.float32).min)
RESETS = {
    "m1e4-at100": (-1e4, (100,)),
    "m1e4-at64": (-1e4, (64,)),
    "m1e30-at127": (-1e30, (127,)),
    "m1e30-at100": (-1e30, (100,)),
    "fmin-twice-at63": (FMIN, (63, 64)),
    "fmin-twice-at100": (FMIN, (100, 101)),
    "minf-at64": (float("-inf"), (64,)),
    "minf-at100": (float("-inf"), (100,)),
}


def planted(value, positions, dtype=torch.float64):
    x = case_inputs(dtype=torch.float64)
    for p in positions:
        x["g"][:, p, 0] = value  # head 0 only: head 1 keeps an ordinary decay
    return {n: t.to(dtype) for n, t in x.items()}


@pytest.mark.parametrize("reset", list(RESETS))
@pytest.mark.parametrize("name, impl", FORM_PARAMS, ids=FORM_IDS)
def test_float64_form_matches_naive(name, impl, reset):
    case = BY_NAME[name]
    x = planted(*RESETS[reset])
    o_ref, s_ref = case.call(x, "naive", output_final_state=True)
    o, s = case.call(x, impl, output_final_state=True)
    assert_close_rel(o, o_ref, 1e-10, f"{name}-{impl} output")
    assert_states_close(s, s_ref, 1e-10, f"{name}-{impl} final state")


@pytest.mark.parametrize("name", list(BY_NAME))
def test_naive_matches_recurrence(name):
    """The spec against the token loop (exp(g) S, nothing to cancel) under every planted value."""
    case = BY_NAME[name]
    for value, positions in RESETS.values():
        x = planted(value, positions)
        assert_close_rel(case.call(x, "naive")[0], case.call(x, "recurrent")[0], 1e-10, f"{name} {value}")


@pytest.mark.parametrize("name, impl", FORM_PARAMS, ids=FORM_IDS)
def test_float32_form_close_to_float64(name, impl):
    case = BY_NAME[name]
    for reset, (value, positions) in RESETS.items():
        ref, _ = case.call(planted(value, positions), "naive")
        o, _ = case.call(planted(value, positions, torch.float32), impl)
        assert_close_rel(o, ref, 1e-5, f"{name}-{impl} float32 {reset}")


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


def test_validation_accepts_minus_inf_and_rejects_nan():
    x = case_inputs(T=8)
    x["g"][:, 3] = float("-inf")
    BY_NAME["linear"].call(x, "chunk")
    x["g"][:, 3] = float("nan")
    with pytest.raises(ValueError, match=r"g: expected a log-decay g <= 0 .*NaN"):
        BY_NAME["linear"].call(x, "chunk")
