"""The float64 ladder for log-linear attention: recurrent and chunk == naive, continuation, varlen, gradcheck."""

import functools
import random

import pytest
import torch

from polyattn import ops
from polyattn.ops.common import level, num_levels
from polyattn.ops.loglinear import LOGLINEAR_ATTN_FORMS, LogLinearState
from polyattn.testing import assert_close_rel, assert_continuation, assert_states_close, assert_varlen, seeded_inputs

TOL = 1e-10
C = 8  # chunk size of the ladder: T below covers 1, 2, C ± 1, 2^k ± 1 and 300 (with C = 16)
BASES = ("mamba2", "gdn")


def _inputs(base, B, T, H, K, V, decay, *, L=None, seed=0):
    """Per-token inputs (keyword names of the forms); lam in [0.2, 1.2) with ``L`` levels (default: just enough)."""
    x = seeded_inputs(B, T, H, K, V, decay=decay, beta=base == "gdn", seed=seed)
    if base == "gdn":  # keep the delta rule contractive: |k|^2 beta < 2
        x["k"] = torch.nn.functional.normalize(x["k"], dim=-1)
    else:
        x.pop("beta")
    gen = torch.Generator().manual_seed(seed + 100)
    L = num_levels(T) if L is None else L
    x["lam"] = 0.2 + torch.rand(B, T, H, L, generator=gen, dtype=torch.float64)
    return x


def _state(B, H, L, K, V, positions, seed=0):
    gen = torch.Generator().manual_seed(seed + 200)
    levels = torch.randn(B, H, L, K, V, generator=gen, dtype=torch.float64)
    return LogLinearState(levels, torch.tensor(positions, dtype=torch.int64))


def _form(name, chunk_size=C):
    fn = LOGLINEAR_ATTN_FORMS[name]
    return functools.partial(fn, chunk_size=chunk_size) if name in ("chunk", "scan") else fn


def _ids(base, decay):
    return f"{base}-{'g' if decay else 'nog'}"


LENGTHS = (1, 2, C - 1, C + 1, 15, 17, 31, 33)
CASES = [
    pytest.param(base, form, T, decay, id=f"{_ids(base, decay)}-{form}-B2-T{T}-H2-K5-V3")
    for base in BASES
    for decay in (True, False)
    for form in ("recurrent", "chunk", "scan")
    for T in LENGTHS
]


@pytest.mark.parametrize("base, form, T, decay", CASES)
def test_form_equals_naive(base, form, T, decay):
    # without a state, and from states at different positions per sequence (aligned and not to the chunks)
    L = num_levels(T + 40)
    x = _inputs(base, 2, T, 2, 5, 3, decay, L=L)
    for state in (None, _state(2, 2, L, 5, 3, [5, 32])):
        o, s = _form(form)(**x, scale=0.7, initial_state=state, output_final_state=True)
        o_ref, s_ref = LOGLINEAR_ATTN_FORMS["naive"](**x, scale=0.7, initial_state=state, output_final_state=True)
        assert_close_rel(o, o_ref, TOL, "o")
        assert_states_close(s, s_ref, TOL, "final_state")


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("form", ["recurrent", "chunk", "scan"])
def test_long_sequence_equals_naive(base, form):
    x = _inputs(base, 1, 300, 2, 4, 3, True, seed=1)
    o, s = _form(form, chunk_size=16)(**x, scale=0.5, output_final_state=True)
    o_ref, s_ref = LOGLINEAR_ATTN_FORMS["naive"](**x, scale=0.5, output_final_state=True)
    assert_close_rel(o, o_ref, TOL, "o")
    assert_states_close(s, s_ref, TOL, "final_state")


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("chunk_size", [1, 2, 4, 16, 64])
def test_chunk_sizes(base, chunk_size):
    x = _inputs(base, 1, 37, 2, 4, 6, True, L=num_levels(37 + 11), seed=2)
    state = _state(1, 2, num_levels(48), 4, 6, [11], seed=2)
    o, s = _form("chunk", chunk_size)(**x, scale=1.0, initial_state=state, output_final_state=True)
    o_ref, s_ref = LOGLINEAR_ATTN_FORMS["naive"](**x, scale=1.0, initial_state=state, output_final_state=True)
    assert_close_rel(o, o_ref, TOL, "o")
    assert_states_close(s, s_ref, TOL, "final_state")


SPLITS = [15, 16, 17, 31, 32, 33, 63, 64, 65] + random.Random(0).sample(range(1, 70), 4)


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("form", ["naive", "recurrent", "chunk", "scan"])
def test_continuation_at_powers_of_two_and_random_splits(base, form):
    x = _inputs(base, 2, 70, 1, 4, 3, True, seed=3)
    for split in SPLITS:
        assert_continuation(_form(form), x, split, TOL, scale=0.8)


@pytest.mark.parametrize("base", BASES)
def test_chunk_prefill_then_recurrent_steps_equals_full(base):
    T, prefill = 40, 19
    x = _inputs(base, 2, T, 2, 4, 3, True, seed=4)
    o_full, s_full = ops.loglinear_attn(**x, output_final_state=True, impl="naive")
    o, state = ops.loglinear_attn(**{n: t[:, :prefill] for n, t in x.items()}, output_final_state=True, impl="chunk")
    outs = [o]
    for t in range(prefill, T):
        step = {n: v[:, t : t + 1] for n, v in x.items()}
        o, state = ops.loglinear_attn(**step, initial_state=state, output_final_state=True, impl="recurrent")
        outs.append(o)
    assert_close_rel(torch.cat(outs, dim=1), o_full, TOL)
    assert_states_close(state, s_full, TOL)


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("impl", ["naive", "recurrent", "chunk", "scan"])
@pytest.mark.parametrize("with_state", [False, True], ids=["h0-none", "h0"])
def test_varlen_equals_separate_runs(base, impl, with_state):
    lengths = [5, 1, 9, 1, 13]
    L = num_levels(13 + 64)
    x = _inputs(base, 1, sum(lengths), 2, 3, 4, True, L=L, seed=5)
    state = _state(5, 2, L, 3, 4, [0, 7, 64, 1, 30], seed=5) if with_state else None
    assert_varlen(functools.partial(ops.loglinear_attn, impl=impl), x, lengths, TOL, initial_state=state)


def test_varlen_positions_restart_per_sequence():
    # Packed sequences are independent: the second one sees levels of its own positions 0, 1, 2, ...
    x = _inputs("mamba2", 1, 12, 1, 3, 2, True, L=num_levels(7), seed=6)
    o, _ = ops.loglinear_attn(**x, cu_seqlens=torch.tensor([0, 5, 12]), impl="chunk")
    o_second, _ = ops.loglinear_attn(**{n: t[:, 5:] for n, t in x.items()}, impl="naive")
    assert_close_rel(o[:, 5:], o_second, TOL)


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("form", ["chunk", "scan"])
@pytest.mark.parametrize("position", [5, 8], ids=lambda p: f"P{p}")
def test_gradcheck_chunked(base, form, position):
    # d q, k, v, lam, g, beta and d initial levels, through o and the final levels; chunks of 4 from an
    # unaligned (5) and an aligned (8) start
    T, L = 10, num_levels(10 + position)
    x = _inputs(base, 1, T, 1, 2, 2, True, L=L, seed=7)
    x["g"] = x["g"] - 0.05  # keep g strictly below 0 under finite differences
    state = _state(1, 1, L, 2, 2, [position], seed=7)
    names = list(x)

    def f(*args):
        kw = dict(zip(names, args[:-1]))
        initial = LogLinearState(args[-1], state.position)
        o, s = LOGLINEAR_ATTN_FORMS[form](**kw, scale=0.8, initial_state=initial, output_final_state=True, chunk_size=4)
        return o, s.levels

    args = [x[n].clone().requires_grad_() for n in names] + [state.levels.clone().requires_grad_()]
    # the scan's Jacobian is checked along random directions (fast mode): the full one takes ~15 s per case
    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-8, fast_mode=form == "scan")


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("impl", ["naive", "recurrent", "chunk", "scan"])
def test_constant_lam_reduces_to_the_base_model(base, impl):
    # lam[t, l] = c for every level: the base model times c; the levels sum to the base model's state
    x = _inputs(base, 2, 29, 2, 4, 3, True, seed=8)
    const = 0.37
    x["lam"] = torch.full_like(x["lam"], const)
    o, s = ops.loglinear_attn(**x, scale=0.9, output_final_state=True, impl=impl)
    base_inputs = {n: x[n] for n in ("q", "k", "v", "g")}
    if base == "gdn":
        o_ref, s_ref = ops.delta_rule(**base_inputs, beta=x["beta"], scale=0.9, output_final_state=True, impl="naive")
    else:
        o_ref, s_ref = ops.linear_attn(**base_inputs, scale=0.9, output_final_state=True, impl="naive")
    assert_close_rel(o, const * o_ref, TOL, "o")
    assert_close_rel(s.levels.sum(dim=2), s_ref, TOL, "sum of levels")


def _gdn_weight_by_products(q, k, beta, g, scale):
    """``W[t, s] = scale q_t^T A_t ⋯ A_{s+1} k_s β_s`` with ``A_r = exp(g_r)(I - β_r k_r k_r^T)``, one head."""
    T, K = q.shape
    W = torch.zeros(T, T, dtype=q.dtype)
    for s in range(T):
        carried = beta[s] * k[s]  # [K]
        for t in range(s, T):
            if t > s:
                carried = torch.exp(g[t]) * (carried - beta[t] * k[t] * (k[t] @ carried))
            W[t, s] = scale * q[t] @ carried
    return W


def test_gdn_mask_multiplies_the_complete_matrix():
    # O = (W ⊙ M^H) V with W from explicit products of the transitions: the mask comes after the inverse.
    T = 7
    x = _inputs("gdn", 1, T, 1, 3, 2, True, seed=9)
    W = _gdn_weight_by_products(x["q"][0, :, 0], x["k"][0, :, 0], x["beta"][0, :, 0], x["g"][0, :, 0], 0.6)
    rows = [[x["lam"][0, t, 0, level(t, s)].item() if s <= t else 0.0 for s in range(T)] for t in range(T)]
    o_ref = (W * torch.tensor(rows, dtype=torch.float64)) @ x["v"][0, :, 0]
    for impl in ("naive", "recurrent", "chunk"):
        o, _ = ops.loglinear_attn(**x, scale=0.6, impl=impl)
        assert_close_rel(o[0, :, 0], o_ref, TOL, impl)


def test_non_empty_levels_of_the_state():
    # After T tokens, level l of the state holds keys iff l == 0 or bit l-1 of T-1 is set (popcount + 1 levels).
    x = _inputs("mamba2", 1, 45, 1, 3, 2, True, L=8, seed=10)
    for T in (1, 2, 7, 8, 9, 32, 45):
        _, s = ops.loglinear_attn(**{n: t[:, :T] for n, t in x.items()}, output_final_state=True, impl="chunk")
        non_empty = [bool(s.levels[0, 0, lev].abs().sum() > 0) for lev in range(8)]
        assert non_empty == [lev == 0 or bool(((T - 1) >> (lev - 1)) & 1) for lev in range(8)], f"T = {T}"
        assert s.position.tolist() == [T]


@pytest.mark.parametrize("impl", ["recurrent", "chunk"])
def test_float32_inputs(impl):
    x = _inputs("gdn", 1, 21, 2, 4, 4, True, seed=11)
    o_ref, s_ref = ops.loglinear_attn(**x, output_final_state=True, impl="naive")
    o, s = ops.loglinear_attn(**{n: t.float() for n, t in x.items()}, output_final_state=True, impl=impl)
    assert o.dtype == torch.float32 and s.levels.dtype == torch.float32 and s.position.dtype == torch.int64
    assert_close_rel(o, o_ref, 1e-5, "o")
    assert_close_rel(s.levels, s_ref.levels, 1e-5, "final_state")


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("position", [2**20 - 3, 2**20, 2**31 + 5], ids=lambda p: f"P{p}")
def test_large_absolute_positions(base, position):
    # levels come from integer bits: a state deep into a long sequence continues exactly
    L = num_levels(position + 11)
    x = _inputs(base, 1, 11, 1, 3, 2, True, L=L, seed=12)
    state = _state(1, 1, L, 3, 2, [position], seed=12)
    o_ref, s_ref = LOGLINEAR_ATTN_FORMS["naive"](**x, scale=1.0, initial_state=state, output_final_state=True)
    for form in ("recurrent", "chunk"):
        o, s = _form(form, chunk_size=4)(**x, scale=1.0, initial_state=state, output_final_state=True)
        assert_close_rel(o, o_ref, TOL, form)
        assert_states_close(s, s_ref, TOL, form)
