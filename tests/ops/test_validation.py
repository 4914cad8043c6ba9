"""Options and values every op checks the same way, empty batches, and value checks without host syncs."""

import pytest
import torch

from op_cases import CASES, FORM_IDS, FORM_PARAMS, BY_NAME, case_inputs
from polyattn import ops
from polyattn.ops.common import set_value_checks
from polyattn.ops.loglinear import LogLinearState


@pytest.mark.parametrize("B, H", [(0, 2), (1, 0)], ids=["B0", "H0"])
@pytest.mark.parametrize("name, impl", FORM_PARAMS, ids=FORM_IDS)
def test_empty_batch_or_heads(name, impl, B, H):
    case = BY_NAME[name]
    x = case_inputs(T=5, B=max(B, 1), H=max(H, 1))
    x = {n: (t[:0] if B == 0 else t[:, :, :0]) for n, t in x.items()}
    o, state = case.call(x, impl, output_final_state=True)
    assert tuple(o.shape) == (B, 5, H, 6)
    for field in state if isinstance(state, tuple) else (state,):
        assert field.shape[0] == B and (field.dim() == 1 or field.shape[1] == H)


def _small():
    return case_inputs(T=6, H=2, K=4, V=3)


OPTION_ERRORS = {
    "output_final_state-int": (dict(output_final_state=1), r"output_final_state: expected a bool, got 1"),
    "scale-inf": (dict(scale=float("inf")), r"scale: expected a finite float"),
    "scale-str": (dict(scale="1"), r"scale: expected a Python float"),
    "scale-huge-int": (dict(scale=10**400), r"scale: expected a finite float"),  # float() of it overflows
    "impl-bogus": (dict(impl="fast"), r"impl must be 'auto' or one of"),
}


@pytest.mark.parametrize("option", list(OPTION_ERRORS))
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_shared_options_rejected(case, option):
    kwargs, message = OPTION_ERRORS[option]
    kwargs = dict(kwargs)
    impl = kwargs.pop("impl", "chunk")
    with pytest.raises(ValueError, match=message):
        case.call(_small(), impl, **kwargs)


def _with(field, make):
    return lambda x: {**x, field: make(x[field])}


INPUT_ERRORS = {  # (change of the inputs, or None; keyword arguments; message)
    "q-rank": (_with("q", lambda q: q[0]), {}, r"q: expected a 4-D tensor"),
    "q-list": (_with("q", lambda q: q.tolist()), {}, r"q: expected a torch.Tensor, got list"),
    "v-dtype": (_with("v", lambda v: v.float()), {}, r"q, k, v: expected one dtype"),
    "int-dtype": (lambda x: {**x, **{n: x[n].long() for n in ("q", "k", "v")}}, {}, r"expected a floating dtype"),
    "k-device": (_with("k", lambda k: k.to("meta")), {}, r"k: expected device cpu"),
    "v-length": (_with("v", lambda v: v[:, :5]), {}, r"v: expected shape \[B, T, H, V\]"),
    "g-positive": (_with("g", lambda g: g.abs() + 0.1), {}, r"g: expected a log-decay g <= 0"),
    "g-positive-beside-nan": (_with("g", lambda g: torch.where(g < -0.05, float("nan"), 0.1)), {}, r"g: expected a log-decay g <= 0 .*got a value > 0 \(max 0\.1\)"),
    "g-shape": (_with("g", lambda g: g[..., None]), {}, r"g: expected shape \[B, T, H\]"),
    "g-device": (_with("g", lambda g: g.to("meta")), {}, r"g: expected device cpu"),
    "cu-list": (None, dict(cu_seqlens=[0, 6]), r"cu_seqlens: expected an int64 tensor"),
    "cu-float": (None, dict(cu_seqlens=torch.tensor([0.0, 6.0])), r"cu_seqlens: expected dtype int64"),
    "cu-2d": (None, dict(cu_seqlens=torch.tensor([[0, 6]])), r"cu_seqlens: expected a 1-D tensor"),
    "cu-end": (None, dict(cu_seqlens=torch.tensor([0, 4])), r"cu_seqlens: expected to start at 0 and end at T = 6"),
    "cu-empty-sequence": (None, dict(cu_seqlens=torch.tensor([0, 3, 3, 6])), r"strictly increasing"),
    "cu-B2": (lambda x: {n: torch.cat([t, t]) for n, t in x.items()}, dict(cu_seqlens=torch.tensor([0, 6])), r"batch size B = 1"),
    "state-str": (None, dict(initial_state="h0"), r"initial_state"),
    "state-shape": (None, dict(initial_state=torch.zeros(1, 2, 3, 3, dtype=torch.float64)), r"initial_state"),
    "state-device": (None, dict(initial_state=torch.zeros(1, 2, 4, 3, device="meta")), r"initial_state"),
}


@pytest.mark.parametrize("error", list(INPUT_ERRORS))
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_inputs_rejected(case, error):
    """Every op, the same bad tensors and layouts: a ValueError that names the argument."""
    change, kwargs, message = INPUT_ERRORS[error]
    x = case.inputs(_small())
    with pytest.raises(ValueError, match=message):
        case.run(**(change(x) if change else x), impl="chunk" if "chunk" in case.impls else case.impls[0], **kwargs)


PER_TOKEN_ERRORS = {
    "beta": [(lambda b: b[..., None], r"beta: expected shape \[B, T, H\]"), (lambda b: b.to("meta"), r"beta: expected device cpu")],
    "lam": [(lambda lam: lam[:, :5], r"lam: expected shape \[B, T, H, L\]"), (lambda lam: lam[..., :1], r"lam: expected at least num_levels")],
}


@pytest.mark.parametrize("case", [c for c in CASES if c.name.startswith(("delta", "loglinear"))], ids=lambda c: c.name)
def test_bad_beta_and_lam_rejected(case):
    for field, errors in PER_TOKEN_ERRORS.items():
        if field == "lam" and not case.name.startswith("loglinear") or field == "beta" and case.name == "loglinear-mamba2":
            continue
        for make, message in errors:
            x = case.inputs(_small())
            with pytest.raises(ValueError, match=message):
                case.run(**{**x, field: make(x[field])}, impl="chunk")


HLA_ERRORS = {
    "eps-negative": (dict(eps=-1.0), r"eps: expected a positive float"),
    "eps-str": (dict(eps="x"), r"eps: expected a positive float"),
    "eps-nan": (dict(eps=float("nan")), r"eps: expected a positive float"),
    "eps-huge-int": (dict(eps=10**400), r"eps: expected a positive float"),
    "normalize-str": (dict(normalize="no"), r"normalize: expected a bool, got 'no'"),
    "normalize-int": (dict(normalize=1), r"normalize: expected a bool"),
    "asymmetric-int": (dict(asymmetric=1), r"asymmetric: expected a bool"),
    "order-4": (dict(order=4), r"order must be one of \[2, 3\]"),
}


@pytest.mark.parametrize("option", list(HLA_ERRORS))
def test_hla_options_rejected(option):
    kwargs, message = HLA_ERRORS[option]
    x = _small()
    with pytest.raises(ValueError, match=message):
        ops.hla(x["q"], x["k"], x["v"], x["g"], **kwargs)


def test_kata_eps_inf_rejected():
    x = _small()
    with pytest.raises(ValueError, match=r"eps: expected a positive float"):
        ops.kata(x["q"], x["k"], x["v"], eps=float("inf"))


def test_delta_rule_without_beta_rejected():
    x = _small()
    for impl in ("naive", "recurrent", "chunk"):
        with pytest.raises(ValueError, match=r"beta: expected the write strengths"):
            ops.delta_rule(x["q"], x["k"], x["v"], None, x["g"], impl=impl)


def test_loglinear_level_check_at_int64_limits():
    """lam's level check holds for every L up to and past 64 (2 ** (L - 1) no longer an int64), and a position so
    large that position + tokens wraps around int64 is refused instead of passing any check as a negative end."""
    x = _small()
    cu = torch.tensor([0, 2, x["q"].shape[1]])
    for L in (64, 70):
        lam = torch.rand(*x["lam"].shape[:3], L, dtype=x["lam"].dtype)
        o, _ = ops.loglinear_attn(x["q"], x["k"], x["v"], lam, x["g"], cu_seqlens=cu, impl="chunk")
        want, _ = ops.loglinear_attn(x["q"], x["k"], x["v"], lam, x["g"], cu_seqlens=cu, impl="naive")
        torch.testing.assert_close(o, want)
    levels = torch.zeros(1, 2, x["lam"].shape[-1], 4, 3, dtype=torch.float64)
    for impl in ("naive", "recurrent", "chunk"):
        with pytest.raises(ValueError, match=r"initial_state: expected position \+ tokens to fit in int64"):
            ops.loglinear_attn(x["q"], x["k"], x["v"], x["lam"], x["g"], impl=impl,
                               initial_state=LogLinearState(levels, torch.tensor([2**63 - 3])))


def test_loglinear_plain_tuple_state_rejected():
    x = _small()
    levels = torch.zeros(1, 2, x["lam"].shape[-1], 4, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"initial_state: expected LogLinearState\(levels, position\), got tuple"):
        ops.loglinear_attn(x["q"], x["k"], x["v"], x["lam"], initial_state=(levels, torch.zeros(1, dtype=torch.int64)))
    ops.loglinear_attn(x["q"], x["k"], x["v"], x["lam"], initial_state=LogLinearState(levels, torch.zeros(1, dtype=torch.int64)))


def _bad_g():
    x = _small()
    x["g"][0, 2, 1] = 0.5
    return x


def test_value_check_modes():
    x = _bad_g()
    with pytest.raises(ValueError, match=r"g: expected a log-decay g <= 0"):
        ops.linear_attn(x["q"], x["k"], x["v"], x["g"])
    try:
        assert set_value_checks("async") == "auto"
        with pytest.raises(RuntimeError, match=r"g: expected a log-decay g <= 0"):
            ops.linear_attn(x["q"], x["k"], x["v"], x["g"])
        set_value_checks("off")
        o, _ = ops.linear_attn(x["q"], x["k"], x["v"], x["g"])
        assert o.shape == (1, 6, 2, 3)
        with pytest.raises(ValueError, match=r"mode must be one of"):
            set_value_checks("never")
    finally:
        set_value_checks("auto")


def test_value_checks_compile_without_graph_breaks():
    """Under torch.compile the checks are traced asserts: one graph, and a bad value still fails."""
    x = _small()

    def run(q, k, v, g):
        return ops.linear_attn(q, k, v, g, impl="chunk")[0]

    compiled = torch.compile(run, fullgraph=True, backend="eager", dynamic=False)
    assert torch.equal(compiled(x["q"], x["k"], x["v"], x["g"]), run(x["q"], x["k"], x["v"], x["g"]))
    bad = _bad_g()
    with pytest.raises(RuntimeError, match=r"g: expected a log-decay g <= 0"):
        compiled(bad["q"], bad["k"], bad["v"], bad["g"])


@pytest.mark.parametrize("op", ["linear_attn", "delta_rule", "hla"])
def test_triton_forms_take_minus_inf_resets(op):
    """Through the public op, the Triton forms accept g = -inf (an exact reset) and give the chunk form's output."""
    from polyattn.testing import rel_err

    x = _small()
    x["g"][0, 3, 1] = float("-inf")
    args = {"linear_attn": (x["q"], x["k"], x["v"], x["g"]), "delta_rule": (x["q"], x["k"], x["v"], x["beta"], x["g"]),
            "hla": (x["q"], x["k"], x["v"], x["g"])}[op]
    args = tuple(t.float() for t in args)
    o, _ = getattr(ops, op)(*args, impl="triton")
    o_chunk, _ = getattr(ops, op)(*args, impl="chunk")
    assert bool(torch.isfinite(o).all())
    assert rel_err(o, o_chunk) <= 1e-5, f"{op}: {rel_err(o, o_chunk):.2e}"


def test_loglinear_decode_step_compiles_without_graph_breaks():
    """Continuing a state (positions, level count) is checked on the device: the recurrent step is one graph."""
    x = case_inputs(T=1, H=2, K=4, V=3, dtype=torch.float32)
    lam = torch.rand(1, 1, 2, 5)
    state = LogLinearState(torch.randn(1, 2, 5, 4, 3), torch.tensor([7]))

    def step(q, k, v, lam, g, state):
        return ops.loglinear_attn(q, k, v, lam, g, initial_state=state, output_final_state=True, impl="recurrent")

    torch._dynamo.reset()
    o, final = torch.compile(step, fullgraph=True, backend="eager")(x["q"], x["k"], x["v"], lam, x["g"], state)
    o_eager, final_eager = step(x["q"], x["k"], x["v"], lam, x["g"], state)
    assert torch.equal(o, o_eager) and torch.equal(final.levels, final_eager.levels)
    with pytest.raises(ValueError, match=r"lam: expected at least num_levels\(17\) = 6 levels"):
        step(x["q"], x["k"], x["v"], lam, x["g"], LogLinearState(state.levels, torch.tensor([16])))
