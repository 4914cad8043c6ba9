"""DeltaKATA (beta given): every form == naive, overwrite semantics, continuation, varlen, gradcheck."""

import functools

import pytest
import torch

from polyattn.ops.kata import DELTAKATA_FORMS, kata, make_feature_map
from polyattn.testing import assert_close_rel, assert_continuation, assert_states_close, assert_varlen, seeded_inputs

TOL = 1e-10

VARIANTS = [("psd", 1, "concat"), ("psd", 2, "concat"), ("psd", 4, "concat"), ("psd", 2, "sum"), ("psd", 4, "sum"),
            ("orthant", 1, "concat"), ("lorentz", 1, "concat")]
LADDER = [
    pytest.param(feature, groups, combine, decay, form,
                 id=f"{feature}-{combine}-G{groups}-{'g' if decay else 'nog'}-{form}-B2-T29-H2-K8-V3")
    for feature, groups, combine in VARIANTS
    for decay in (True, False)
    for form in ("recurrent", "chunk")
]


def _inputs(B, T, H, K, V, decay=True, seed=0):
    return seeded_inputs(B, T, H, K, V, decay=decay, beta=True, seed=seed)


@pytest.mark.parametrize("feature, groups, combine, decay, form", LADDER)
def test_form_equals_naive(feature, groups, combine, decay, form):
    x = _inputs(2, 29, 2, 8, 3, decay=decay)
    opts = dict(feature=feature, groups=groups, combine=combine, scale=0.4, output_final_state=True)
    P = make_feature_map(feature, 8, groups, combine).dim()
    h0 = torch.randn(2, 2, P, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    extra = {"chunk_size": 8} if form == "chunk" else {}
    for state in (None, h0):
        o_ref, s_ref = DELTAKATA_FORMS["naive"](**x, **opts, initial_state=state)
        o, s = DELTAKATA_FORMS[form](**x, **opts, initial_state=state, **extra)
        assert_close_rel(o, o_ref, TOL, "o")
        assert_close_rel(s, s_ref, TOL, "final_state")


@pytest.mark.parametrize("chunk_size", [1, 4, 64])
def test_chunk_sizes(chunk_size):
    x = _inputs(1, 13, 2, 6, 4, seed=2)
    opts = dict(groups=3, combine="concat", scale=0.6, output_final_state=True)
    o_ref, s_ref = DELTAKATA_FORMS["naive"](**x, **opts)
    o, s = DELTAKATA_FORMS["chunk"](**x, **opts, chunk_size=chunk_size)
    assert_close_rel(o, o_ref, TOL, "o")
    assert_close_rel(s, s_ref, TOL, "final_state")


@pytest.mark.parametrize("impl", ["naive", "recurrent", "chunk"])
@pytest.mark.parametrize("groups, combine", [(1, "concat"), (2, "concat"), (2, "sum")], ids=["M1", "M2", "S2"])
def test_beta_one_replaces_a_rewritten_keys_value(impl, groups, combine):
    # random history, then key k written with v_old and, later, again with v_new at beta = 1:
    # reading with ψ(q) = ψ̂(k) returns v_new exactly, whatever the history (additive KATA would average)
    x = _inputs(1, 9, 1, 4, 3, decay=False, seed=3)
    k, v, beta = x["k"].clone(), x["v"].clone(), x["beta"].clone()
    k[:, 4], k[:, 8] = k[:, 0] * 1.7, k[:, 0] * 0.6  # the same direction at other norms: the same unit lifted key
    beta[:, 4] = beta[:, 8] = 1.0
    fmap = make_feature_map("psd", 4, groups, combine)
    unit_q = k[:, 8] / fmap.kernel(k[:, 8, :, None], k[:, 8, :, None])[..., 0, 0, None] ** 0.25  # ψ(unit_q) = ψ̂(k)
    q = x["q"].clone()
    q[:, 8] = unit_q
    o, _ = kata(q, k, v, groups=groups, combine=combine, normalize=False, beta=beta, scale=1.0, impl=impl)
    assert_close_rel(o[:, 8], v[:, 8], 1e-12, "read of the rewritten key")
    o_additive, _ = kata(q, k, v, groups=groups, combine=combine, normalize=True, scale=1.0, impl=impl)
    assert (o_additive[:, 8] - v[:, 8]).abs().max() > 1e-3, "additive KATA mixes old and new values"


@pytest.mark.parametrize("impl", ["naive", "recurrent", "chunk"])
def test_continuation(impl):
    x = _inputs(2, 19, 2, 4, 3, seed=4)
    op = functools.partial(kata, groups=2, combine="sum", normalize=False, impl=impl)
    for split in (1, 7, 18):
        assert_continuation(op, x, split, TOL)


@pytest.mark.parametrize("impl", ["naive", "recurrent", "chunk"])
def test_varlen_equals_separate_runs(impl):
    lengths = [4, 1, 10]
    x = _inputs(1, sum(lengths), 2, 4, 3, seed=5)
    h0 = torch.randn(3, 2, make_feature_map("psd", 4, 2, "concat").dim(), 3, dtype=torch.float64)
    assert_varlen(functools.partial(kata, groups=2, normalize=False, impl=impl), x, lengths, TOL, initial_state=h0)


def test_prefill_then_steps_equals_full():
    x = _inputs(1, 10, 2, 4, 2, seed=6)
    opts = dict(groups=2, normalize=False)
    o_full, s_full = kata(**x, **opts, output_final_state=True, impl="naive")
    o, state = kata(**{n: t[:, :6] for n, t in x.items()}, **opts, output_final_state=True, impl="chunk")
    outs = [o]
    for t in range(6, 10):
        o, state = kata(**{n: a[:, t : t + 1] for n, a in x.items()}, **opts, initial_state=state, output_final_state=True, impl="recurrent")
        outs.append(o)
    assert_close_rel(torch.cat(outs, dim=1), o_full, TOL)
    assert_states_close(state, s_full, TOL)


def test_gradcheck_chunk():
    x = _inputs(1, 6, 1, 4, 2, seed=7)
    h0 = torch.randn(1, 1, make_feature_map("psd", 4, 2, "concat").dim(), 2, dtype=torch.float64)
    names = ["q", "k", "v", "beta", "g"]

    def f(q, k, v, beta, g, S0):
        return DELTAKATA_FORMS["chunk"](q, k, v, beta, g, groups=2, scale=0.8, initial_state=S0, output_final_state=True, chunk_size=4)

    args = [(x[n] - 0.05 if n == "g" else x[n]).clone().requires_grad_() for n in names] + [h0.requires_grad_()]
    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-8)
