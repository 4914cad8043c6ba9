"""One state format: continuation at random splits, across impls, token steps, varlen == separate runs, gradcheck."""

import functools
import random

import pytest
import torch

from hla_cases import VARIANTS, hla_inputs, variant_kwargs
from polyattn import ops
from polyattn.ops.hla import AHLAState, HLA2State, HLA3State, hla_chunk
from polyattn.testing import assert_close_rel, assert_continuation, assert_states_close, assert_varlen

TOL = 1e-10
IMPLS = ("naive", "recurrent", "chunk", "scan")


def _kwargs(name, normalize):
    return variant_kwargs(name, normalize, 0.6)


@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "norm"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_continuation_at_random_splits(name, impl, normalize):
    x = hla_inputs(2, 29, 2, 4, 3, decay=True, normalize=normalize, seed=30)
    rng = random.Random(f"{name}-{impl}-{normalize}")
    op = functools.partial(ops.hla, impl=impl, **_kwargs(name, normalize))
    for split in [1, 28] + rng.sample(range(2, 28), 2):
        assert_continuation(op, x, split, TOL)


@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "norm"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_continuation_across_impls(name, normalize):
    # Three pieces at random split points, each piece in a different impl, state handed from one to the next.
    x = hla_inputs(2, 41, 2, 4, 3, decay=True, normalize=normalize, seed=31)
    kw = _kwargs(name, normalize)
    o_full, s_full = ops.hla(**x, **kw, impl="naive", output_final_state=True)
    rng = random.Random(f"{name}-{normalize}")
    for chain in (("chunk", "recurrent", "scan"), ("scan", "chunk", "recurrent"), ("recurrent", "scan", "naive")):
        a, b = sorted(rng.sample(range(1, 41), 2))
        state, outs = None, []
        for impl, (lo, hi) in zip(chain, ((0, a), (a, b), (b, 41))):
            piece = {n: None if t is None else t[:, lo:hi] for n, t in x.items()}
            o, state = ops.hla(**piece, **kw, impl=impl, initial_state=state, output_final_state=True)
            outs.append(o)
        assert_close_rel(torch.cat(outs, dim=1), o_full, TOL, f"{chain} split at {a}, {b}")
        assert_states_close(state, s_full, TOL, f"{chain} final state")


@pytest.mark.parametrize("name", list(VARIANTS))
def test_prefill_then_steps_equals_full(name):
    x = hla_inputs(1, 12, 2, 4, 3, decay=True, normalize=False, seed=32)
    kw = _kwargs(name, False)
    o_full, s_full = ops.hla(**x, **kw, impl="chunk", output_final_state=True)
    o, state = ops.hla(**{n: t[:, :5] for n, t in x.items()}, **kw, impl="chunk", output_final_state=True)
    outs = [o]
    for t in range(5, 12):
        o, state = ops.hla(**{n: v[:, t : t + 1] for n, v in x.items()}, **kw, impl="recurrent", initial_state=state, output_final_state=True)
        outs.append(o)
    assert_close_rel(torch.cat(outs, dim=1), o_full, TOL)
    assert_states_close(state, s_full, TOL)


@pytest.mark.parametrize("with_state", [False, True], ids=["h0-none", "h0"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_varlen_equals_separate_runs(name, impl, with_state):
    lengths = [5, 1, 9, 2]
    normalize = name == "hla2"  # the normalized ones column rides along in the packed states too
    kw = _kwargs(name, normalize)
    x = hla_inputs(1, sum(lengths), 2, 3, 2, decay=True, normalize=normalize, seed=33)
    h0 = None
    if with_state:
        prefix = hla_inputs(len(lengths), 6, 2, 3, 2, decay=True, normalize=normalize, seed=34)
        _, h0 = ops.hla(**prefix, **kw, impl="naive", output_final_state=True)
    assert_varlen(functools.partial(ops.hla, impl=impl, **kw), x, lengths, TOL, initial_state=h0)


@pytest.mark.parametrize(
    "name, normalize", [("hla2", False), ("ahla", False), ("hla3", False), ("hla2", True)], ids=["hla2", "ahla", "hla3", "hla2-norm"]
)
def test_gradcheck_chunk(name, normalize):
    # Gradients through o and final_state into q, k, v, g and every initial-state field.
    x = hla_inputs(1, 6, 1, 2, 2, decay=True, normalize=normalize, seed=35)
    x["g"] = x["g"] - 0.05  # stays < 0 under finite-difference perturbations
    kw = _kwargs(name, normalize)
    _, h0 = ops.hla(**hla_inputs(1, 3, 1, 2, 2, decay=True, normalize=normalize, seed=36), **kw, output_final_state=True)
    state_cls = type(h0)
    names = list(x)

    def f(*args):
        inputs = dict(zip(names, args[: len(names)]))
        o, s = hla_chunk(**inputs, **kw, initial_state=state_cls(*args[len(names) :]), output_final_state=True, chunk_size=4)
        return (o, *s)

    args = [x[n].clone().requires_grad_() for n in names] + [h.clone().requires_grad_() for h in h0]
    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-8)


def test_state_types():
    x = hla_inputs(1, 4, 1, 3, 2, decay=False, normalize=False, seed=37)
    for (order, asymmetric), cls in (((2, False), HLA2State), ((2, True), AHLAState), ((3, False), HLA3State)):
        _, s = ops.hla(**x, order=order, asymmetric=asymmetric, output_final_state=True)
        assert type(s) is cls
        assert all(f.dtype == torch.float64 and f.shape[:3] == (1, 1, 3) for f in s)
