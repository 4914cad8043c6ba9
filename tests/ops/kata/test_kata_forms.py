"""The float64 ladder for KATA: every form == naive, continuation, varlen, gradcheck, convex hull."""

import functools
import math
import random

import pytest
import torch

from polyattn.ops.kata import KATA_FORMS, KataState, kata, make_feature_map
from polyattn.testing import assert_close_rel, assert_continuation, assert_states_close, assert_varlen, seeded_inputs

TOL = 1e-10
C = 8  # chunk/tile size of the ladder; T = 29 covers a partial last chunk
FAST = ("recurrent", "chunk", "scan", "parallel")
CHUNKED = ("chunk", "scan", "parallel")


def _inputs(B, T, H, K, V, decay=True, seed=0):
    x = seeded_inputs(B, T, H, K, V, decay=decay, seed=seed)
    x.pop("beta")
    return x


def _state(B, H, P, V, seed=0):
    gen = torch.Generator().manual_seed(seed)
    S = torch.randn(B, H, P, V, generator=gen, dtype=torch.float64)
    z = torch.rand(B, H, P, generator=gen, dtype=torch.float64)  # a normaliser of nonnegative weights is positive
    return KataState(S, z)


def _extra(form, chunk_size=C):
    return {"chunk_size": chunk_size} if form in CHUNKED else {}


PSD_LADDER = [
    pytest.param(combine, groups, decay, form, id=f"psd-{combine}-G{groups}-{'g' if decay else 'nog'}-{form}-B2-T29-H2-K8-V5")
    for combine in ("concat", "sum")
    for groups in (1, 2, 4)
    for decay in (True, False)
    for form in FAST
]


@pytest.mark.parametrize("combine, groups, decay, form", PSD_LADDER)
def test_psd_form_equals_naive(combine, groups, decay, form):
    x = _inputs(2, 29, 2, 8, 5, decay=decay)
    opts = dict(feature="psd", groups=groups, combine=combine, scale=0.4)
    h0 = _state(2, 2, make_feature_map("psd", 8, groups, combine).dim(), 5)
    for normalize, state in ((True, None), (True, h0), (False, h0)):
        o_ref, s_ref = KATA_FORMS["naive"](**x, **opts, normalize=normalize, initial_state=state, output_final_state=True)
        o, s = KATA_FORMS[form](**x, **opts, normalize=normalize, initial_state=state, output_final_state=True, **_extra(form))
        assert_close_rel(o, o_ref, TOL, f"o normalize={normalize}")
        assert_states_close(s, s_ref, TOL, "final_state")


FIRST_ORDER = [
    pytest.param(feature, form, id=f"{feature}-g-{form}-B2-T29-H2-K6-V3")
    for feature in ("orthant", "lorentz")
    for form in FAST
]


@pytest.mark.parametrize("feature, form", FIRST_ORDER)
def test_first_order_form_equals_naive(feature, form):
    x = _inputs(2, 29, 2, 6, 3, seed=1)
    h0 = _state(2, 2, 6, 3, seed=1)
    for normalize in (True, False):
        o_ref, s_ref = KATA_FORMS["naive"](**x, feature=feature, scale=0.5, normalize=normalize, initial_state=h0, output_final_state=True)
        o, s = KATA_FORMS[form](**x, feature=feature, scale=0.5, normalize=normalize, initial_state=h0, output_final_state=True, **_extra(form))
        assert_close_rel(o, o_ref, TOL, "o")
        assert_states_close(s, s_ref, TOL, "final_state")


@pytest.mark.parametrize("form", CHUNKED)
@pytest.mark.parametrize("T", [1, 13])
@pytest.mark.parametrize("chunk_size", [1, 4, 16, 64])
def test_chunk_sizes(form, T, chunk_size):
    x = _inputs(1, T, 2, 6, 4, seed=2)
    opts = dict(feature="psd", groups=3, combine="concat", scale=0.6, output_final_state=True)
    o_ref, s_ref = KATA_FORMS["naive"](**x, **opts)
    o, s = KATA_FORMS[form](**x, **opts, chunk_size=chunk_size)
    assert_close_rel(o, o_ref, TOL, "o")
    assert_states_close(s, s_ref, TOL, "final_state")


def test_naive_matches_scalar_definition():
    # ops/kata/README.md, "Normalized KATA", with Python loops over (t, s): checks naive's decay and eps conventions
    x = _inputs(1, 6, 1, 4, 2, seed=3)
    q, k, v, g = x["q"][0, :, 0], x["k"][0, :, 0], x["v"][0, :, 0], x["g"][0, :, 0]
    o, _ = kata(**x, groups=2, combine="sum", scale=0.5, impl="naive")
    for t in range(6):
        w = [sum((0.5 * q[t, 2 * i : 2 * i + 2] @ k[s, 2 * j : 2 * j + 2]) ** 2 for i in range(2) for j in range(2))
             * math.exp(sum(g[r].item() for r in range(s + 1, t + 1))) for s in range(t + 1)]
        expected = sum(w[s] * v[s] for s in range(t + 1)) / max(sum(w), 1e-6)
        assert_close_rel(o[0, t, 0], expected, TOL, f"t={t}")


@pytest.mark.parametrize("impl", ["naive", "recurrent", "chunk", "scan", "parallel"])
def test_continuation_at_random_splits(impl):
    x = _inputs(2, 23, 2, 4, 3, seed=4)
    op = functools.partial(kata, groups=2, combine="concat", impl=impl)
    for split in [1, 22] + random.Random(impl).sample(range(2, 22), 2):
        assert_continuation(op, x, split, TOL)


def test_prefill_then_steps_across_forms():
    # one state format: a chunk prefill, recurrent steps, a scan and a parallel segment continue each other
    x = _inputs(2, 14, 2, 4, 3, seed=5)
    opts = dict(groups=2, combine="sum")
    o_full, s_full = kata(**x, **opts, output_final_state=True, impl="naive")
    piece = lambda a, b: {n: t[:, a:b] for n, t in x.items()}  # noqa: E731
    o, state = kata(**piece(0, 5), **opts, output_final_state=True, impl="chunk")
    outs = [o]
    for t in range(5, 9):
        o, state = kata(**piece(t, t + 1), **opts, initial_state=state, output_final_state=True, impl="recurrent")
        outs.append(o)
    for impl, (a, b) in (("scan", (9, 12)), ("parallel", (12, 14))):
        o, state = kata(**piece(a, b), **opts, initial_state=state, output_final_state=True, impl=impl)
        outs.append(o)
    assert_close_rel(torch.cat(outs, dim=1), o_full, TOL)
    assert_states_close(state, s_full, TOL)


@pytest.mark.parametrize("impl", ["naive", "recurrent", "chunk", "scan", "parallel"])
def test_varlen_equals_separate_runs(impl):
    lengths = [5, 1, 11, 3]
    x = _inputs(1, sum(lengths), 2, 4, 3, seed=6)
    h0 = _state(len(lengths), 2, make_feature_map("psd", 4, 2, "concat").dim(), 3, seed=6)
    assert_varlen(functools.partial(kata, groups=2, impl=impl), x, lengths, TOL, initial_state=h0)


@pytest.mark.parametrize("form", ["parallel", "chunk"])
@pytest.mark.parametrize("combine", ["concat", "sum"])
def test_gradcheck(form, combine):
    x = _inputs(1, 7, 1, 4, 2, seed=7)
    h0 = _state(1, 1, make_feature_map("psd", 4, 2, combine).dim(), 2, seed=7)
    names = ["q", "k", "v", "g"]

    def f(q, k, v, g, S0, z0):
        o, s = KATA_FORMS[form](q, k, v, g, groups=2, combine=combine, scale=0.8, initial_state=KataState(S0, z0),
                                output_final_state=True, chunk_size=4)
        return o, s.S, s.z

    # keep g strictly inside (-inf, 0] under finite differences
    args = [(x[n] - 0.05 if n == "g" else x[n]).clone().requires_grad_() for n in names]
    args += [h0.S.clone().requires_grad_(), h0.z.clone().requires_grad_()]
    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("feature, groups, combine", [("psd", 1, "concat"), ("psd", 2, "sum"), ("orthant", 1, "concat"), ("lorentz", 1, "concat")],
                         ids=["M1", "S2", "orthant", "lorentz"])
def test_normalized_outputs_in_convex_hull(feature, groups, combine):
    x = _inputs(2, 20, 2, 4, 3, seed=8)
    o, _ = kata(**x, feature=feature, groups=groups, combine=combine)
    directions = torch.cat([torch.eye(3, dtype=torch.float64), -torch.eye(3, dtype=torch.float64),
                            torch.randn(16, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)])  # [22, V]
    proj_o = o @ directions.T  # [B, T, H, 22]
    proj_v = x["v"] @ directions.T
    support = torch.cummax(proj_v, dim=1).values  # max over s <= t of u·v_s: [B, T, H, 22]
    assert (proj_o <= support + 1e-12).all(), "an output leaves the convex hull of the values seen so far"
    # the first output is v_1 itself (a hull of one point)
    assert_close_rel(o[:, 0], x["v"][:, 0], TOL, "o_1")
