"""ops.kata's public surface: bad input, dispatch, dtypes, the convex gate (ops/kata/README.md)."""

import pytest
import torch

from polyattn import ops
from polyattn.ops.kata import KataState, kata, kata_convex_gate, make_feature_map
from polyattn.testing import assert_close_rel, seeded_inputs

TOL = 1e-10


def _ok(T=6, K=4):
    x = seeded_inputs(1, T, 2, K, 3, dtype=torch.float32, seed=0)
    x.pop("beta")
    return x


BAD = {
    "groups-not-dividing-K": (dict(groups=3), r"groups: expected a positive divisor of K = 4, got groups = 3"),
    "groups-zero": (dict(groups=0), r"groups: expected a positive divisor"),
    "groups-float": (dict(groups=2.0), r"groups: expected a positive int"),
    "unknown-feature": (dict(feature="rbf"), r"feature must be one of \['psd', 'orthant', 'lorentz'\], got 'rbf'"),
    "unknown-combine": (dict(combine="prod"), r"combine must be one of \['concat', 'sum'\], got 'prod'"),
    "groups-on-first-order": (dict(feature="orthant", groups=2), r"expected groups=1 and combine='concat' for feature='orthant'"),
    "combine-on-first-order": (dict(feature="lorentz", combine="sum"), r"for feature='lorentz'"),
    "beta-with-normalize": (dict(beta=torch.rand(1, 6, 2)), r"beta: DeltaKATA's read is unnormalized; expected normalize=False"),
    "beta-shape": (dict(beta=torch.rand(1, 6, 1), normalize=False), r"beta: expected shape \[B, T, H\]"),
    "eps-zero": (dict(eps=0.0), r"eps: expected a positive float"),
    "normalize-not-bool": (dict(normalize="yes"), r"normalize: expected a bool"),
    "state-not-kata-state": (dict(initial_state=torch.zeros(1, 2, 16, 3)), r"initial_state: expected a KataState"),
    "state-S-shape": (dict(initial_state=KataState(torch.zeros(1, 2, 10, 3), torch.zeros(1, 2, 16))), r"initial_state.S: expected shape \[1, 2, 16, 3\]"),
    "state-z-shape": (dict(initial_state=KataState(torch.zeros(1, 2, 16, 3), torch.zeros(1, 2, 10))), r"initial_state.z: expected shape \[1, 2, 16\]"),
    "delta-state-shape": (dict(beta=torch.rand(1, 6, 2), normalize=False, initial_state=torch.zeros(1, 2, 4, 3)),
                          r"initial_state: expected shape \[1, 2, 16, 3\]"),
    "g-positive": (dict(g=torch.full((1, 6, 2), 0.1)), r"g: expected a log-decay g <= 0"),
    "unknown-impl": (dict(impl="fast"), r"impl must be 'auto' or one of"),
}


@pytest.mark.parametrize("change, message", list(BAD.values()), ids=list(BAD))
def test_bad_input_raises_value_error(change, message):
    with pytest.raises(ValueError, match=message):
        kata(**{**_ok(), **change})


def test_lorentz_needs_two_dims():
    with pytest.raises(ValueError, match=r"K: expected K >= 2 for feature='lorentz'"):
        kata(**_ok(K=1), feature="lorentz")


@pytest.mark.parametrize("impl", ["scan", "parallel"])
def test_deltakata_lacks_quadratic_and_scan_forms(impl):
    with pytest.raises(NotImplementedError, match=r"DeltaKATA has no impl='.*'; it has \['chunk', 'naive', 'recurrent', 'triton', 'triton_chunk'\]"):
        kata(**_ok(), beta=torch.rand(1, 6, 2), normalize=False, impl=impl)


def test_exported_from_ops_and_auto_is_chunk():
    x = {n: t.double() for n, t in _ok(T=11).items()}
    o_auto, s_auto = ops.kata(**x, groups=2, output_final_state=True)
    o_chunk, s_chunk = kata(**x, groups=2, output_final_state=True, impl="chunk")
    assert torch.equal(o_auto, o_chunk) and torch.equal(s_auto.S, s_chunk.S)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("beta", [False, True], ids=["kata", "deltakata"])
def test_low_precision_dtypes_and_fp32_state(dtype, beta):
    x = seeded_inputs(1, 13, 2, 4, 3, beta=beta, seed=1)
    if not beta:
        x.pop("beta")
    opts = dict(groups=2, normalize=not beta, output_final_state=True)
    o_ref, _ = kata(**x, **opts, impl="naive")
    o, s = kata(**{n: t.to(dtype) for n, t in x.items()}, **opts)
    assert o.dtype == dtype
    assert all(f.dtype == torch.float32 for f in (s if isinstance(s, tuple) else (s,)))
    assert_close_rel(o, o_ref, 1e-5 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("feature, groups, combine", [("psd", 1, "concat"), ("psd", 2, "concat"), ("psd", 4, "concat"),
                                                      ("psd", 2, "sum"), ("psd", 4, "sum"), ("orthant", 1, "concat"),
                                                      ("lorentz", 1, "concat")],
                         ids=["M1", "M2", "M4", "S2", "S4", "orthant", "lorentz"])
@pytest.mark.parametrize("decay", [True, False], ids=["g", "nog"])
def test_convex_gate_identity(feature, groups, combine, decay):
    x = seeded_inputs(2, 21, 2, 8, 3, decay=decay, seed=2)
    x.pop("beta")
    opts = dict(feature=feature, groups=groups, combine=combine)
    lam, read_prev = kata_convex_gate(**x, **opts, chunk_size=8)
    o, _ = kata(**x, **opts, impl="naive")
    assert_close_rel((1 - lam)[..., None] * read_prev + lam[..., None] * x["v"], o, TOL, "o = (1-λ) read + λ v")
    assert ((lam >= 0) & (lam <= 1)).all()
    assert torch.equal(lam[:, 0], torch.ones_like(lam[:, 0])), "λ_1 = 1"
    # λ_t = A[t, t] / Σ_s A[t, s], checked against the naive form's dense scores
    fmap = make_feature_map(feature, 8, groups, combine)
    q, k = x["q"].transpose(1, 2) * 8**-0.5, x["k"].transpose(1, 2)  # [B, H, T, K]
    A = fmap.kernel(q, k) * (torch.ones(21, 21, dtype=torch.float64).tril() if not decay else
                             ops.common.exp_segsum(x["g"].transpose(1, 2)))  # [B, H, T, T]
    assert_close_rel(lam, (torch.diagonal(A, dim1=-2, dim2=-1) / A.sum(-1)).transpose(1, 2), TOL, "λ")


def test_long_sequence_fp32_stays_exact_and_finite():
    # ops/README.md, "Numerics policy": long sequences (64K tokens) in fp32 match the float64 run of the
    # same form and stay finite
    x = seeded_inputs(1, 65_536, 1, 4, 2, beta=True, seed=3)
    beta = x.pop("beta")
    o64, s64 = kata(**x, groups=2, output_final_state=True)
    x32 = {n: None if t is None else t.float() for n, t in x.items()}
    o32, s32 = kata(**x32, groups=2, output_final_state=True)
    assert_close_rel(o32, o64, 1e-5, "o")
    assert_close_rel(s32.S, s64.S, 1e-5, "S")
    x32["k"] = torch.nn.functional.normalize(x32["k"], dim=-1)
    o_delta, s_delta = kata(**x32, beta=beta.float(), normalize=False, groups=2, output_final_state=True)
    assert torch.isfinite(o_delta).all() and torch.isfinite(s_delta).all()
