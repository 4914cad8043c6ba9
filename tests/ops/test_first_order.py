"""The float64 ladder for the first-order primitives: every form == naive, continuation, varlen, gradcheck."""

import functools
import random

import pytest
import torch

from polyattn import ops
from polyattn.ops.delta import DELTA_RULE_FORMS, delta_rule_attention_matrix
from polyattn.ops.linear import LINEAR_ATTN_FORMS
from polyattn.testing import assert_close_rel, assert_continuation, assert_states_close, assert_varlen, seeded_inputs

TOL = 1e-10
C = 8  # chunk size for the ladder: T below covers 1, C - 1, C, C + 1, 3C + 5

MECHANISMS = {
    "linear": (ops.linear_attn, LINEAR_ATTN_FORMS, False),
    "delta": (ops.delta_rule, DELTA_RULE_FORMS, True),
}


def _inputs(mech, B, T, H, K, V, decay, seed=0):
    x = seeded_inputs(B, T, H, K, V, decay=decay, beta=MECHANISMS[mech][2], seed=seed)
    if mech == "delta":  # keep the delta rule contractive: |k|^2 beta < 2
        x["k"] = torch.nn.functional.normalize(x["k"], dim=-1)
    else:
        x.pop("beta")
    return x


def _forms(mech):
    return [f for f in MECHANISMS[mech][1] if f not in ("naive", "triton")]


CASES = [
    pytest.param(mech, form, T, decay, id=f"{mech}-{form}-B2-T{T}-H2-K5-V3-{'g' if decay else 'nog'}")
    for mech in MECHANISMS
    for form in _forms(mech)
    for T in (1, C - 1, C, C + 1, 3 * C + 5)
    for decay in (True, False)
]


@pytest.mark.parametrize("mech, form, T, decay", CASES)
def test_form_equals_naive(mech, form, T, decay):
    x = _inputs(mech, 2, T, 2, 5, 3, decay)
    h0 = torch.randn(2, 2, 5, 3, dtype=torch.float64)
    fn = MECHANISMS[mech][1][form]
    naive = MECHANISMS[mech][1]["naive"]
    extra = {"chunk_size": C} if form in ("chunk", "scan") else {}
    for state in (None, h0):
        o, s = fn(**x, scale=0.7, initial_state=state, output_final_state=True, **extra)
        o_ref, s_ref = naive(**x, scale=0.7, initial_state=state, output_final_state=True)
        assert_close_rel(o, o_ref, TOL, "o")
        assert_close_rel(s, s_ref, TOL, "final_state")


@pytest.mark.parametrize("mech", list(MECHANISMS))
@pytest.mark.parametrize("chunk_size", [1, 2, 4, 16, 64])
def test_chunk_sizes(mech, chunk_size):
    x = _inputs(mech, 1, 37, 2, 4, 6, True, seed=1)
    forms = MECHANISMS[mech][1]
    o_ref, s_ref = forms["naive"](**x, scale=1.0, output_final_state=True)
    for form in ("chunk", "scan"):
        if form in forms:
            o, s = forms[form](**x, scale=1.0, output_final_state=True, chunk_size=chunk_size)
            assert_close_rel(o, o_ref, TOL, form)
            assert_close_rel(s, s_ref, TOL, form)


@pytest.mark.parametrize("mech", list(MECHANISMS))
@pytest.mark.parametrize("impl", ["naive", "recurrent", "chunk", "scan"])
def test_continuation_at_random_splits(mech, impl):
    op, forms, _ = MECHANISMS[mech]
    if impl not in forms:
        with pytest.raises(NotImplementedError, match="has no impl"):
            op(**_inputs(mech, 1, 4, 1, 2, 2, True), impl=impl)
        return
    x = _inputs(mech, 2, 41, 2, 4, 3, True, seed=2)
    rng = random.Random(impl)
    for split in [1, 40] + rng.sample(range(2, 40), 3):
        assert_continuation(functools.partial(op, impl=impl), x, split, TOL)


@pytest.mark.parametrize("mech", list(MECHANISMS))
def test_prefill_then_steps_equals_full(mech):
    op, _, _ = MECHANISMS[mech]
    x = _inputs(mech, 2, 12, 2, 4, 3, True, seed=3)
    o_full, s_full = op(**x, output_final_state=True, impl="chunk")
    o, state = op(**{n: t[:, :5] for n, t in x.items()}, output_final_state=True, impl="chunk")
    outs = [o]
    for t in range(5, 12):
        o, state = op(**{n: v[:, t : t + 1] for n, v in x.items()}, initial_state=state, output_final_state=True, impl="recurrent")
        outs.append(o)
    assert_close_rel(torch.cat(outs, dim=1), o_full, TOL)
    assert_states_close(state, s_full, TOL)


@pytest.mark.parametrize("mech", list(MECHANISMS))
@pytest.mark.parametrize("impl", ["naive", "recurrent", "chunk"])
@pytest.mark.parametrize("with_state", [False, True], ids=["h0-none", "h0"])
def test_varlen_equals_separate_runs(mech, impl, with_state):
    op, _, _ = MECHANISMS[mech]
    lengths = [5, 1, 9, 1, 3]
    x = _inputs(mech, 1, sum(lengths), 2, 3, 4, True, seed=4)
    h0 = torch.randn(len(lengths), 2, 3, 4, dtype=torch.float64) if with_state else None
    assert_varlen(functools.partial(op, impl=impl), x, lengths, TOL, initial_state=h0)


@pytest.mark.parametrize("mech", list(MECHANISMS))
def test_gradcheck_chunk(mech):
    x = _inputs(mech, 1, 6, 1, 3, 2, True, seed=5)
    h0 = torch.randn(1, 1, 3, 2, dtype=torch.float64)
    names = list(x)
    fn = MECHANISMS[mech][1]["chunk"]

    def f(*args):
        kw = dict(zip(names, args[:-1]))
        o, s = fn(**kw, scale=0.8, initial_state=args[-1], output_final_state=True, chunk_size=4)
        return o, s

    args = [x[n].clone().requires_grad_() for n in names] + [h0.requires_grad_()]
    # keep g strictly inside (-inf, 0] under finite differences: it is ~U(-0.3, 0), perturbations are 1e-6
    args[names.index("g")] = (x["g"] - 0.05).requires_grad_()
    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-8)


def test_delta_rule_attention_matrix_is_the_whole_operator():
    x = _inputs("delta", 2, 11, 2, 4, 3, True, seed=6)
    W = delta_rule_attention_matrix(x["q"], x["k"], x["beta"], x["g"], scale=0.6)  # [B, H, T, T]
    o = (W @ x["v"].transpose(1, 2)).transpose(1, 2)  # [B, H, T, T] @ [B, H, T, V] -> [B, T, H, V]
    o_ref, _ = ops.delta_rule(**x, scale=0.6, impl="recurrent")
    assert_close_rel(o, o_ref, TOL)
    assert torch.equal(torch.triu(W, diagonal=1), torch.zeros_like(W))


def test_delta_rule_beta_one_overwrites():
    # With unit keys and beta = 1 the state maps k to v exactly: a rewritten key returns its newest value.
    k = torch.nn.functional.normalize(torch.randn(1, 3, 1, 4, dtype=torch.float64), dim=-1)
    k[:, 2] = k[:, 0]
    v = torch.randn(1, 3, 1, 2, dtype=torch.float64)
    beta = torch.ones(1, 3, 1, dtype=torch.float64)
    _, s = ops.delta_rule(k, k, v, beta, scale=1.0, output_final_state=True)
    assert_close_rel(k[0, 2, 0] @ s[0, 0], v[0, 2, 0], 1e-12)


def test_linear_attn_dtypes_and_state_dtype():
    x = _inputs("linear", 1, 9, 1, 4, 4, True)
    for dtype in (torch.float32, torch.bfloat16):
        y = {n: t.to(dtype) for n, t in x.items()}
        o, s = ops.linear_attn(**y, output_final_state=True)
        assert o.dtype == dtype and s.dtype == torch.float32
        o_ref, _ = ops.linear_attn(**x, impl="naive")
        assert_close_rel(o, o_ref, 1e-5 if dtype == torch.float32 else 3e-2)
