"""Packed sequences == separate runs in every op and PyTorch form, on each of the three varlen paths:
one sequence with exact resets (no states), right-padded batches by length class (with states), and
sequence by sequence (log-linear; KATA with states)."""

import pytest
import torch

from op_cases import BY_NAME, FORM_IDS, FORM_PARAMS, case_inputs
from polyattn.ops.common import state_cat, state_index
from polyattn.testing import assert_close_rel, assert_states_close

LENGTHS = [1, 5, 64, 65, 2, 13]  # T = 150: one-token sequences, a full chunk, one past it, odd sizes


def cut(x, bos, eos):
    return {n: t[:, bos:eos] for n, t in x.items()}


def bounds_of(lengths):
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return bounds


@pytest.mark.parametrize("name, impl", FORM_PARAMS, ids=FORM_IDS)
def test_packed_without_states_equals_separate_runs(name, impl):
    case = BY_NAME[name]
    x = case_inputs(T=sum(LENGTHS))
    bounds = bounds_of(LENGTHS)
    o, final = case.call(x, impl, cu_seqlens=torch.tensor(bounds))
    assert final is None
    ref = torch.cat([case.call(cut(x, a, b), impl)[0] for a, b in zip(bounds, bounds[1:])], dim=1)
    assert_close_rel(o, ref, 1e-10)


@pytest.mark.parametrize("name, impl", FORM_PARAMS, ids=FORM_IDS)
def test_packed_with_states_equals_separate_runs(name, impl):
    """Initial states from a first packed call, continued in a second: outputs and final states match."""
    case = BY_NAME[name]
    x = case_inputs(T=2 * sum(LENGTHS))
    first, second = cut(x, 0, sum(LENGTHS)), cut(x, sum(LENGTHS), 2 * sum(LENGTHS))
    bounds = bounds_of(LENGTHS)
    cu = torch.tensor(bounds)
    _, h0 = case.call(first, impl, cu_seqlens=cu, output_final_state=True)
    o, final = case.call(second, impl, cu_seqlens=cu, initial_state=h0, output_final_state=True)
    outs, finals = [], []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        o_i, s_i = case.call(cut(second, a, b), impl, initial_state=state_index(h0, i), output_final_state=True)
        outs.append(o_i)
        finals.append(s_i)
    assert_close_rel(o, torch.cat(outs, dim=1), 1e-10, "packed output")
    assert_states_close(final, state_cat(finals), 1e-10, "packed final states")


def test_many_one_token_sequences():
    """2,048 tokens as 512 sequences of 4 in the chunk form: resets and padded batches agree with separate runs."""
    case = BY_NAME["hla2"]
    x = case_inputs(T=2048, H=1, K=4, V=3)
    cu = torch.arange(0, 2049, 4)
    o, final = case.call(x, "chunk", cu_seqlens=cu, output_final_state=True)
    o_stateless, _ = case.call(x, "chunk", cu_seqlens=cu)
    pieces = [case.call(cut(x, a, a + 4), "chunk", output_final_state=True) for a in range(0, 2048, 4)]
    assert_close_rel(o, torch.cat([p[0] for p in pieces], dim=1), 1e-10)
    assert_close_rel(o_stateless, o, 1e-10)
    assert_states_close(final, state_cat([p[1] for p in pieces]), 1e-10)


def test_packed_sequences_cost_few_form_calls():
    """2,048 one-token sequences: one call without states, one padded batch with them; mixed lengths up to
    100: one call per length class (<= 8), never one per sequence."""
    from polyattn.ops.common import run_varlen
    from polyattn.ops.linear import linear_attn_chunk

    shapes = []

    def form(q, k, v, g, **kwargs):
        shapes.append(tuple(q.shape[:2]))
        return linear_attn_chunk(q, k, v, g, **kwargs)

    x = case_inputs(T=2048, H=1, K=4, V=3)
    args = ((x["q"], x["k"], x["v"], x["g"]),)
    options = dict(decay_index=3, neutral_padding=True, scale=1.0)
    run_varlen(form, *args, torch.arange(2049), None, False, **options)
    assert shapes == [(1, 2048)]
    shapes.clear()
    run_varlen(form, *args, torch.arange(2049), None, True, **options)
    assert shapes == [(2048, 1)]
    shapes.clear()
    lengths = (torch.arange(40) % 100 + 1).tolist()
    lengths[-1] += 2048 - sum(lengths)
    run_varlen(form, *args, torch.tensor(bounds_of(lengths)), None, True, **options)
    assert 1 < len(shapes) <= 12 and sum(b * t for b, t in shapes) <= 2 * 2048


@pytest.mark.parametrize("name, impl", FORM_PARAMS, ids=FORM_IDS)
def test_packed_gradients_equal_separate_runs(name, impl):
    """Training on packed sequences (the exact-reset path): gradients finite and equal to separate runs."""
    case = BY_NAME[name]
    lengths = [3, 70, 1, 40]
    bounds = bounds_of(lengths)
    x = case_inputs(T=sum(lengths))
    packed = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    case.call(packed, impl, cu_seqlens=torch.tensor(bounds))[0].square().sum().backward()
    separate = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    sum(case.call(cut(separate, a, b), impl)[0].square().sum() for a, b in zip(bounds, bounds[1:])).backward()
    for n in x:
        if separate[n].grad is not None:
            assert_close_rel(packed[n].grad, separate[n].grad, 1e-10, f"d{n}")
