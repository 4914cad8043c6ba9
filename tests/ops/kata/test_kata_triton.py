"""Triton `kata` (the flash-style quadratic kernel) against the float64 naive spec.

The bound per tensor is `polyattn.testing.assert_low_precision_matches`'s: at most twice the error of
the PyTorch `parallel` form on the same low-precision inputs (or one rounding floor), and always under
a hard ceiling, for o, the final state and every gradient (dq, dk, dv, dg, dh0; cotangents on o and on
the final state). On a CPU-only machine the kernels run under TRITON_INTERPRET=1 (tests/conftest.py)
at tiny shapes and small tiles (several query and key tiles per sequence); with CUDA at real shapes
and the default tiles. Each kernel stage is also compared with its PyTorch twin.
"""
from __future__ import annotations

import functools

import pytest
import torch
import triton
import triton.language as tl

from polyattn import ops
from polyattn.ops.kata import DELTAKATA_FORMS, KATA_FORMS, KataState, kata_chunk, kata_naive, kata_parallel, make_feature_map
from polyattn.ops.kata.triton import kata_triton, kata_triton_first_order, kata_triton_parallel
from polyattn.ops.kata.triton.tiles import diagonal_decay_ref, key_diagonal_decay, query_diagonal_decay
from polyattn.ops.triton.decay import chunk_decay, reset_limited
from polyattn.ops.triton.precision import LOG2E
from polyattn.ops.triton.plan import KernelConfig, get_config, use_config
from polyattn.testing import (
    assert_close_rel, assert_decay_weights_close, assert_continuation, assert_low_precision_matches, dtype_id, kata_case_id,
    kata_gpu_cases, random_kata_state, rel_err, seeded_inputs,
)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if CUDA:
    B, H, K, V = 2, 16, 64, 48
    T_GRID = [1, 63, 64, 65, 1000]
    CONFIG = KernelConfig()
else:
    B, H, K, V = 2, 2, 8, 12
    T_GRID = [1, 63, 64, 65, 130]
    CONFIG = KernelConfig(kata_block_m=32, kata_block_n=16)  # several tiles even at T = 65
VARIANTS = [(1, "concat"), (2, "concat"), (4, "concat"), (2, "sum"), (4, "sum")]


def _inputs(Bx, T, decay, seed=0, Kx=K):
    x = seeded_inputs(Bx, T, H, Kx, V, decay=decay, seed=seed, device=DEVICE)
    return {n: x[n] for n in ("q", "k", "v", "g")}


def _state(N, groups, combine, seed, Kx=K):
    return random_kata_state(N, H, make_feature_map("psd", Kx, groups, combine), V, seed=seed, device=DEVICE)


def _forms(groups, combine, normalize):
    opts = dict(groups=groups, combine=combine, normalize=normalize, eps=1e-6)
    return [functools.partial(f, **opts) for f in (kata_naive, kata_parallel, kata_triton_parallel)]


def _check(T, dtype, groups, combine, decay, normalize, with_state, Bx=1, seed=0, lengths=None):
    h0 = _state(Bx if lengths is None else len(lengths), groups, combine, seed + 1) if with_state else None
    x = _inputs(Bx, T if lengths is None else sum(lengths), decay, seed=seed)
    with use_config(CONFIG):
        assert_low_precision_matches(*_forms(groups, combine, normalize), x, h0, dtype, lengths=lengths)


# (T, dtype, groups, combine, decay, normalize, with_state). CPU: every variant once in fp32, three bf16
# cases, the T grid on KATA-M1; CUDA: KATA-M1 over the T grid, both dtypes and every flag, and the
# other variants at T = 65 and 1000 in both dtypes with two opposite sets of flags.
if CUDA:
    CASES = kata_gpu_cases(T_GRID, VARIANTS)
else:
    CASES = [(40, torch.float32, G, c, True, True, True) for G, c in VARIANTS] + [
        (65, torch.bfloat16, 1, "concat", True, True, True),
        (40, torch.bfloat16, 2, "sum", True, False, True),
        (64, torch.bfloat16, 2, "concat", False, True, False),
        (1, torch.float32, 1, "concat", True, True, True),
        (63, torch.float32, 1, "concat", True, False, True),
        (64, torch.float32, 1, "concat", False, True, False),
        (65, torch.float32, 1, "concat", True, True, False),
        (130, torch.float32, 1, "concat", True, False, False),
    ]


@pytest.mark.parametrize("case", CASES, ids=[kata_case_id(c) for c in CASES])
def test_triton_matches_naive(case):
    """o, final state and every gradient: each (groups, combine), with and without decay, normalized or
    not (the kernel's own normalized read), with and without an initial state (the combined read of
    the host's prior), over the T grid."""
    T, dtype, groups, combine, decay, normalize, with_state = case
    _check(T, dtype, groups, combine, decay, normalize, with_state, Bx=B if T <= 64 else 1)


VARLEN = [(torch.float32, 1, "concat")] + ([(torch.bfloat16, 2, "sum"), (torch.float32, 4, "concat")] if CUDA else [])


@pytest.mark.parametrize("dtype, groups, combine", VARLEN, ids=[f"{dtype_id(d)}-{c}-G{g}" for d, g, c in VARLEN])
def test_varlen_matches_naive(dtype, groups, combine):
    lengths = [1, 40, 17, 70] if not CUDA else [1, 64, 1000, 2047, 130]
    _check(None, dtype, groups, combine, True, True, True, lengths=lengths, seed=4)


# (groups, combine, K): E a power of two or not, groups a power of two or not (the step takes any), Σg with E = 2
STEP_MAPS = [(1, "concat", 8), (2, "concat", 12), (3, "concat", 12), (2, "sum", 8), (4, "sum", 8)]
STEP_FLAGS = [(True, True, True), (False, False, False), (True, False, True), (False, True, False)]  # decay, normalize, state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("decay, normalize, with_state", STEP_FLAGS, ids=lambda f: "-".join(map(str, f)) if isinstance(f, tuple) else None)
@pytest.mark.parametrize("groups, combine, Kx", STEP_MAPS, ids=[f"{c}-G{g}-K{k}" for g, c, k in STEP_MAPS])
def test_decode_step_matches_naive(groups, combine, Kx, decay, normalize, with_state, dtype, monkeypatch):
    """One token per sequence without gradients runs the fused step (any groups; V = 40 is two value
    tiles, so the normaliser's z is read by both and written by one): o and the new state against the
    float64 naive form on the same rounded inputs, the caller's state untouched, and the step's float64 twin."""
    from polyattn.ops.kata.triton import step

    calls, real_step = [], step.kata_step
    monkeypatch.setattr(step, "kata_step", lambda *a, **kw: calls.append(1) or real_step(*a, **kw))
    Vx = 40
    x = seeded_inputs(2, 1, H, Kx, Vx, decay=decay, seed=7, device=DEVICE)
    x = {n: x[n].to(dtype) if n in ("q", "k", "v") else x[n] for n in ("q", "k", "v", "g")}
    if not decay:
        x["g"] = None
    P = make_feature_map("psd", Kx, groups, combine).dim()
    gen = torch.Generator().manual_seed(8)
    h0 = KataState(torch.randn(2, H, P, Vx, generator=gen).to(DEVICE), torch.rand(2, H, P, generator=gen).to(DEVICE)) if with_state else None
    kw = dict(groups=groups, combine=combine, normalize=normalize, eps=1e-6, scale=Kx ** -0.5)
    saved = None if h0 is None else KataState(*(t.clone() for t in h0))
    with torch.no_grad():
        o, state = kata_triton_parallel(x["q"], x["k"], x["v"], x["g"], initial_state=h0, output_final_state=True, **kw)
    exact = {n: None if t is None else t.double() for n, t in x.items()}
    o_ref, state_ref = kata_naive(*exact.values(), initial_state=None if h0 is None else KataState(*(t.double() for t in h0)),
                                  output_final_state=True, **kw)
    assert calls == [1], "the one-token call did not run the fused step"
    assert o.dtype == dtype and state.S.dtype == torch.float32
    assert_close_rel(o, o_ref, 1e-5 if dtype == torch.float32 else 2.0 ** -8, "o")
    assert_close_rel(state.S, state_ref.S, 1e-5, "S")
    assert_close_rel(state.z, state_ref.z, 1e-5, "z")
    if h0 is not None:
        assert all(torch.equal(a, b) for a, b in zip(h0, saved)), "the caller's state changed"
    o_twin, state_twin = step.kata_step_ref(*(None if t is None else t[:, 0] for t in x.values()), h0, **kw)
    assert_close_rel(o[:, 0], o_twin, 1e-5 if dtype == torch.float32 else 2.0 ** -8, "o twin")
    assert_close_rel(state.S, state_twin.S, 1e-5, "S twin")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("decay, with_state", [(True, True), (False, False)], ids=["g-h0", "nog-noh0"])
@pytest.mark.parametrize("groups, combine, Kx", STEP_MAPS + [(1, "concat", 16)], ids=[f"{c}-G{g}-K{k}" for g, c, k in STEP_MAPS + [(1, "concat", 16)]])
def test_deltakata_decode_step_matches_naive(groups, combine, Kx, decay, with_state, dtype, monkeypatch):
    """DeltaKATA's one-token call runs the fused step for any PSD width (K = 16: P = 256, past the chunk
    kernels' 128): o and the new state against the float64 naive form on the same rounded inputs, the
    caller's state untouched, and the step's float64 twin."""
    from polyattn.ops.kata.triton import step

    calls, real_step = [], step.deltakata_step
    monkeypatch.setattr(step, "deltakata_step", lambda *a, **kw: calls.append(1) or real_step(*a, **kw))
    Vx = 40
    x = seeded_inputs(2, 1, H, Kx, Vx, decay=decay, beta=True, seed=11, device=DEVICE)
    x = {n: x[n].to(dtype) if n in ("q", "k", "v") else x[n] for n in ("q", "k", "v", "beta", "g")}
    if not decay:
        x["g"] = None
    P = make_feature_map("psd", Kx, groups, combine).dim()
    h0 = torch.randn(2, H, P, Vx, generator=torch.Generator().manual_seed(12)).to(DEVICE) if with_state else None
    saved = None if h0 is None else h0.clone()
    kw = dict(groups=groups, combine=combine, normalize=False, eps=1e-6, scale=Kx ** -0.5)
    with torch.no_grad():
        o, S = ops.kata(x["q"], x["k"], x["v"], x["g"], beta=x["beta"], initial_state=h0, output_final_state=True, impl="triton", **kw)
    exact = {n: None if t is None else t.double() for n, t in x.items()}
    o_ref, S_ref = ops.kata(exact["q"], exact["k"], exact["v"], exact["g"], beta=exact["beta"], output_final_state=True,
                            initial_state=None if h0 is None else h0.double(), impl="naive", **kw)
    assert calls == [1], "the one-token call did not run the fused step"
    assert o.dtype == dtype and S.dtype == torch.float32
    assert_close_rel(o, o_ref, 1e-5 if dtype == torch.float32 else 2.0 ** -8, "o")
    assert_close_rel(S, S_ref, 1e-5, "S")
    if h0 is not None:
        assert torch.equal(h0, saved), "the caller's state changed"
    kw.pop("normalize")
    o_twin, S_twin = step.deltakata_step_ref(*(None if t is None else t[:, 0] for t in x.values()), h0, **kw)
    assert_close_rel(o[:, 0], o_twin, 1e-5 if dtype == torch.float32 else 2.0 ** -8, "o twin")
    assert_close_rel(S, S_twin, 1e-5, "S twin")


def test_continuation_from_state():
    """A call split in two, the second continuing from the first's final state, equals one call."""
    x = {n: t.float() for n, t in _inputs(1, 50, True, seed=5).items()}
    with use_config(CONFIG):
        assert_continuation(ops.kata, x, 37, 1e-5, groups=2, combine="concat", impl="triton_parallel")


RESETS = {"-1e4": [-1e4], "-1e30": [-1e30], "finfo.min x2": [torch.finfo(torch.float32).min] * 2, "-inf": [float("-inf")]}


GATES = [("-1e30", 64), ("-inf", 100), ("finfo.min x2", 64), ("-1e4", 100)]


@pytest.mark.parametrize("reset, position", GATES, ids=[f"{r}-{'tile-start' if p == 64 else 'inside'}" for r, p in GATES])
def test_exact_under_extreme_gates(reset, position):
    """A huge negative log-decay or a reset (-inf) leaves every other weight exact: o and final state
    match the float64 spec in fp32, and the gradients stay finite."""
    x = _inputs(1, 110, True, seed=3)
    for i, value in enumerate(RESETS[reset]):
        x["g"][:, position + i] = value
    h0 = _state(1, 2, "concat", 6)
    kw = dict(groups=2, combine="concat", scale=K**-0.5, output_final_state=True)
    o_ref, s_ref = kata_naive(*x.values(), initial_state=h0, **kw)
    leaves = [t.float().requires_grad_() for t in x.values()]
    with use_config(CONFIG):
        o, s = kata_triton_parallel(*leaves, initial_state=KataState(*(f.float() for f in h0)), **kw)
    assert_close_rel(o, o_ref, 1e-5, "o")
    assert_close_rel(s.S, s_ref.S, 1e-5, "final S")
    assert_close_rel(s.z, s_ref.z, 1e-5, "final z")
    grads = torch.autograd.grad(o.sum() + s.S.sum(), leaves[:3])
    assert all(bool(torch.isfinite(d).all()) for d in grads)


@triton.jit
def diagonal_decay_kernel(g, d_query, d_key, p0, c0, R: tl.constexpr, C: tl.constexpr, EXACT: tl.constexpr):
    rows = p0 + tl.arange(0, R)
    cols = c0 + tl.arange(0, C)
    b_g, b_h, _ = chunk_decay(g, rows, rows < p0 + R, 1, 0, True)
    _, b_hc, _ = chunk_decay(g, cols, cols < c0 + C, 1, 0, True)
    b_pre = tl.sum(tl.where(rows < c0, b_g, 0.0), axis=0) * LOG2E  # log2-decay from p0 to c0
    o_r = tl.arange(0, R)
    o_c = tl.arange(0, C)
    tl.store(d_query + o_r[:, None] * C + o_c[None, :], query_diagonal_decay(b_g, b_h, rows, cols, b_hc + b_pre, EXACT))
    b_gn = reset_limited(tl.load(g + rows + 1, mask=rows + 1 < p0 + R, other=0.0))
    tl.store(d_key + o_r[:, None] * C + o_c[None, :], key_diagonal_decay(b_gn, b_h, rows, cols, b_hc + b_pre, EXACT))


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "differences"])
@pytest.mark.parametrize("plant", [None, -1e30, float("-inf")], ids=["plain", "huge", "reset"])
def test_diagonal_decay_matches_twin(plant, exact):
    """Both paths of the diagonal decay tiles (queries as rows; keys as rows) against the direct sums:
    as log2-decays on the exact path, as fp32 weights on both (ops/triton/decay.py's reset limit)."""
    R, C, c0 = 32, 16, 16
    g = -0.3 * torch.rand(R + 1, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    if plant is not None:
        g[20] = plant
    g = g.float().to(DEVICE)
    d_query, d_key = torch.empty(R, C, device=DEVICE), torch.empty(R, C, device=DEVICE)
    diagonal_decay_kernel[(1,)](g, d_query, d_key, 0, c0, R=R, C=C, EXACT=exact)
    rows, cols = torch.arange(R), torch.arange(c0, c0 + C)
    for name, got, want in (("query rows", d_query, diagonal_decay_ref(g, rows, cols, True)),
                            ("key rows", d_key, diagonal_decay_ref(g, rows, cols, False))):
        want = want.to(DEVICE)
        if exact:
            assert torch.equal(torch.isinf(got), torch.isinf(want)), f"{name}: infinities differ"
            finite = torch.isfinite(want)
            assert torch.allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5), f"{name} differs"
        assert_decay_weights_close(got, want, name)


def _flat(x):
    return None if x is None else x.reshape(-1, *x.shape[2:]).contiguous()  # [B, T, H, ...] -> [B*T, H, ...]


@pytest.mark.parametrize("groups, combine", [(1, "concat"), (2, "sum")], ids=["concat-G1", "sum-G2"])
def test_stages_match_twins(groups, combine):
    """Forward, dq and dk/dv kernels against their PyTorch twins on the same fp32 packed inputs."""
    from polyattn.ops.kata.triton.backward import kata_dkdv_ref, kata_dq_ref
    from polyattn.ops.kata.triton.forward import kata_forward_ref
    from polyattn.ops.kata.triton.function import kata_parallel_backward, kata_parallel_forward

    lengths = [40, 5, 20] if not CUDA else [700, 5, 640]
    x = {n: t.float() for n, t in _inputs(1, sum(lengths), True, seed=9).items()}
    q, k, v, g = x.values()
    scale, eps = 0.4, 1e-6
    prior = torch.rand(1, sum(lengths), H, V + 1, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    opts = dict(groups=groups, combine=combine, scale=scale)
    with use_config(CONFIG):
        o, den, no_lo = kata_parallel_forward(q, k, v, g, prior, scale, eps, lengths, groups, combine, True, False, q.dtype)
        o_ref, den_ref = kata_forward_ref(*(_flat(t) for t in (q, k, v, g, prior)), lengths, eps=eps, normalize=True, **opts)
        assert rel_err(_flat(o), o_ref) <= 1e-5 and rel_err(_flat(den), den_ref) <= 1e-5
        # a bf16 call keeps o's rounding error in bf16: o + o_lo is o before its downcast to about 16 bits
        qb, kb, vb = (t.bfloat16() for t in (q, k, v))
        ob, _, o_lo = kata_parallel_forward(qb, kb, vb, g, prior, scale, eps, lengths, groups, combine, True, True, torch.bfloat16)
        ob_ref, _ = kata_forward_ref(*(_flat(t) for t in (qb.float(), kb.float(), vb.float(), g, prior)), lengths, eps=eps, normalize=True, **opts)
        assert o_lo.dtype == torch.bfloat16 and rel_err(_flat(ob.float() + o_lo.float()), ob_ref) <= 1e-4 < rel_err(_flat(ob), ob_ref)
        do = torch.randn_like(v)
        dq, dk, dv, dg, dprior = kata_parallel_backward(do, q, k, v, g, o, no_lo, den, scale, eps, lengths, groups, combine, True, True,
                                                         True, q.dtype)
    r = 1 / den.clamp_min(eps)
    c = r * (do * o).sum(-1)
    args = [_flat(t) for t in (q, k, v, g, do, r, c)]
    dq_ref, qdq = kata_dq_ref(*args, lengths, **opts)
    dk_ref, dv_ref, kdk = kata_dkdv_ref(*args, lengths, **opts)
    for name, got, want in (("dq", dq, dq_ref), ("dk", dk, dk_ref), ("dv", dv, dv_ref)):
        assert rel_err(_flat(got), want) <= 1e-5, f"{name}: {rel_err(_flat(got), want):.2e}"
    ends = torch.tensor(lengths).cumsum(0)
    dg_ref = torch.cat([(0.5 * (qdq - kdk))[b:e].flip(0).cumsum(0).flip(0) for b, e in zip([0, *ends[:-1]], ends)])
    assert rel_err(_flat(dg), dg_ref) <= 1e-5
    assert rel_err(dprior[..., :V], r[..., None] * do) <= 1e-6 and rel_err(dprior[..., V], -c) <= 1e-6


@pytest.mark.parametrize("D", [48, 200])
def test_row_dots_match_twin(D):
    """`row_dot_kernel` (the backward's fp32 row dots) against its float64 twin: mixed dtypes, rows not a
    multiple of the kernel's row tile, D under and over one column tile, with and without the third term."""
    from polyattn.ops.kata.triton.backward import row_dot_ref
    from polyattn.ops.kata.triton.function import rowdot

    gen = torch.Generator().manual_seed(5)
    x, y, z = (torch.randn(3, 37, 5, D, generator=gen).to(DEVICE) for _ in range(3))
    x, z = x.bfloat16(), z.bfloat16()
    for third in (None, z):
        got = rowdot(x, y, third)
        assert got.dtype == torch.float32 and got.shape == (3 * 37 * 5,)
        assert rel_err(got.view(3, 37, 5), row_dot_ref(x, y, third)) <= 1e-6


def test_custom_ops_pass_opcheck():
    import polyattn.ops.kata.triton.function  # noqa: F401 -- registers polyattn::kata_parallel_*

    x = {n: t.float() for n, t in _inputs(1, 40, True, seed=1).items()}
    q, k, v, g = x.values()
    prior = torch.rand(1, 40, H, V + 1, device=DEVICE)
    with use_config(CONFIG):
        for args in [(q, k, v, g, prior, 0.3, 1e-6, [40], 2, "sum", True, True, torch.float32),
                     (q, k, v, None, None, 0.3, 1e-6, [40], 1, "concat", False, False, torch.float32),
                     (q, k, v, g, prior, 0.3, 1e-6, [40], 1, "concat", True, True, torch.bfloat16)]:  # fp32 copies, bf16 kernels
            torch.library.opcheck(torch.ops.polyattn.kata_parallel_forward.default, args,
                                  test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
        for dtype in (torch.float32, torch.bfloat16):
            keep_lo = dtype != torch.float32  # a bf16 call keeps o's rounding error
            o, den, o_lo = torch.ops.polyattn.kata_parallel_forward(q, k, v, g, prior, 0.3, 1e-6, [40], 2, "concat", True, keep_lo, dtype)
            args = (torch.randn_like(o), q, k, v, g, o, o_lo, den, 0.3, 1e-6, [40], 2, "concat", True, True, True, dtype)
            torch.library.opcheck(torch.ops.polyattn.kata_parallel_backward.default, args, test_utils=("test_schema", "test_faketensor"))


def test_compiles_as_one_graph():
    """`torch.compile(fullgraph=True)` traces the custom ops and the host's state parts; gradients equal eager."""
    x = {n: t.float() for n, t in _inputs(1, 40, True, seed=2).items()}
    leaves = [t.clone().requires_grad_() for t in x.values()]

    def loss(q, k, v, g):
        o, s = ops.kata(q, k, v, g, groups=2, impl="triton", output_final_state=True)
        return o.square().sum() + s.S.sum()

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    with use_config(CONFIG):
        got = torch.autograd.grad(compiled(*leaves), leaves)
        want = torch.autograd.grad(loss(*leaves), leaves)
    for i, (a, b) in enumerate(zip(got, want)):
        assert_close_rel(a, b, 1e-6, f"gradient {i}")


def test_dispatch():
    """`impl="triton"`: the quadratic kernel for PSD maps, linear attention's kernels for first-order
    ones, chosen by name; `auto` keeps to the PyTorch forms."""
    assert KATA_FORMS["triton"] is kata_triton and KATA_FORMS["triton_parallel"] is kata_triton_parallel
    x = {n: t.float() for n, t in _inputs(1, 20, True).items()}
    with use_config(CONFIG):
        o, _ = ops.kata(*x.values(), groups=2, impl="triton")
        o_ref, _ = ops.kata(*x.values(), groups=2, impl="parallel")
        assert_close_rel(o, o_ref, 1e-5)
        o, _ = ops.kata(*x.values(), feature="lorentz", impl="triton")
        assert_close_rel(o, ops.kata(*x.values(), feature="lorentz", impl="chunk")[0], 1e-5)
        o_auto, _ = ops.kata(*x.values(), feature="orthant", impl="auto")
        assert torch.equal(o_auto, ops.kata(*x.values(), feature="orthant", impl="chunk")[0])


def _first_order_state(feature, N, seed):
    """A first-order `KataState` (P = K)."""
    return random_kata_state(N, H, make_feature_map(feature, K), V, seed=seed, device=DEVICE)


def _first_order_check(feature, T, dtype, decay, normalize, with_state, lengths=None, seed=0):
    N = (B if T <= 64 else 1) if lengths is None else len(lengths)
    x = _inputs(N if lengths is None else 1, T if lengths is None else sum(lengths), decay, seed=seed)
    h0 = _first_order_state(feature, N, seed + 1) if with_state else None
    opts = dict(feature=feature, normalize=normalize, eps=1e-6)
    forms = [functools.partial(f, **opts) for f in (kata_naive, kata_chunk, kata_triton_first_order)]
    forms[2].native_varlen = True
    with use_config(CONFIG):
        assert_low_precision_matches(*forms, x, h0, dtype, lengths=lengths)


FIRST_ORDER = [(f, T, dt, d, d, d) for f in ("orthant", "lorentz") for T in (1, 65) for dt in (torch.float32, torch.bfloat16)
               for d in (False, True)]


@pytest.mark.parametrize("feature, T, dtype, decay, normalize, with_state", FIRST_ORDER,
                         ids=[f"{f}-T{T}-{dtype_id(dt)}-{'all' if d else 'none'}" for f, T, dt, d, _, _ in FIRST_ORDER])
def test_first_order_maps_on_the_linear_kernels(feature, T, dtype, decay, normalize, with_state):
    """Orthant and Lorentz KATA through linear attention's kernels: o, the final `[S | z]` and every
    gradient (through the lift into q and k, into g and the initial state), with and without decay,
    normalizer and initial state."""
    _first_order_check(feature, T, dtype, decay, normalize, with_state)


def test_first_order_varlen():
    _first_order_check("lorentz", None, torch.float32, True, True, True, lengths=[1, 40, 17, 70], seed=4)


@pytest.mark.parametrize("bad", ["orthant", "groups3", "float64", "tiles"])
def test_bad_input_raises(bad):
    x = {n: t.float() for n, t in _inputs(1, 10, True, Kx=12).items()}
    kw = dict(impl="triton_parallel")
    if bad == "orthant":
        kw["feature"] = "orthant"
    elif bad == "groups3":
        kw["groups"] = 3
    elif bad == "float64":
        x = {n: t.double() for n, t in x.items()}
    with pytest.raises(ValueError), use_config(KernelConfig(kata_block_m=48, kata_block_n=32) if bad == "tiles" else get_config()):
        ops.kata(*x.values(), **kw)


DELTA_CASES = [("orthant", 1, "concat", 65, torch.float32, True, True), ("lorentz", 1, "concat", 1, torch.bfloat16, True, False),
               ("lorentz", 1, "concat", 65, torch.bfloat16, False, True), ("psd", 2, "sum", 65, torch.float32, True, True)]


@pytest.mark.parametrize("feature, groups, combine, T, dtype, decay, with_state", DELTA_CASES,
                         ids=[f"{f}-{c}-G{G}-T{T}-{dtype_id(dt)}-{'g' if d else 'nog'}-{'h0' if s else 'noh0'}"
                              for f, G, c, T, dt, d, s in DELTA_CASES])
def test_deltakata_on_the_delta_kernels(feature, groups, combine, T, dtype, decay, with_state):
    """DeltaKATA through the delta-rule kernels on unit lifted keys: o, the final state and every
    gradient (q, k, v, beta, g, the initial state) against the float64 naive form."""
    Kx = 8 if feature == "psd" else K  # psd: P = E^2 = 16 features
    x = seeded_inputs(1, T, H, Kx, V, decay=decay, beta=True, seed=7, device=DEVICE)
    x = {n: x[n] for n in ("q", "k", "v", "beta", "g")}
    P = make_feature_map(feature, Kx, groups, combine).dim()
    h0 = 0.5 * torch.randn(1, H, P, V, generator=torch.Generator().manual_seed(8), dtype=torch.float64).to(DEVICE) if with_state else None
    opts = dict(feature=feature, groups=groups, combine=combine, eps=1e-6)
    forms = [functools.partial(DELTAKATA_FORMS[n], **opts) for n in ("naive", "chunk", "triton")]
    with use_config(CONFIG):
        assert_low_precision_matches(*forms, x, h0, dtype)


def test_deltakata_triton_rejects_wide_maps():
    """A PSD map the chunked kernels do not take (K / groups = 24, not a power of two) and too wide for the
    delta-rule kernels (P = 576)."""
    x = seeded_inputs(1, 8, H, 24, V, beta=True, device=DEVICE)
    with pytest.raises(ValueError, match="at most 128 lifted features; got P = 576"):
        ops.kata(x["q"].float(), x["k"].float(), x["v"].float(), x["g"].float(), beta=x["beta"].float(), groups=1,
                 normalize=False, impl="triton")


def test_deltakata_triton_varlen():
    lengths = [1, 40, 17, 70] if not CUDA else [1, 64, 1000, 130]
    x = seeded_inputs(1, sum(lengths), H, K, V, decay=True, beta=True, seed=9, device=DEVICE)
    x = {n: x[n] for n in ("q", "k", "v", "beta", "g")}
    h0 = 0.5 * torch.randn(len(lengths), H, K, V, generator=torch.Generator().manual_seed(10), dtype=torch.float64).to(DEVICE)
    forms = [functools.partial(DELTAKATA_FORMS[n], feature="lorentz", eps=1e-6) for n in ("naive", "chunk", "triton")]
    forms[2].native_varlen = True
    with use_config(CONFIG):
        assert_low_precision_matches(*forms, x, h0, torch.float32, lengths=lengths)


@pytest.mark.parametrize("with_state", [False, True], ids=["noh0", "h0"])
def test_gradients_through_a_state_are_rounded_once(with_state):
    """With a final (and an initial) state, q, k, v also feed the state's read and write on the host: their
    gradients from the kernels and from the state parts are summed in fp32 and rounded once, so they are
    as close to the float64 spec as the PyTorch `parallel` form's. At K = 64 (P = 2,080 features) a
    unit-variance cotangent on the final state makes its share of dk, dv as large as the kernels' (rounded
    twice, dk was 1.8x and dv 1.3x further off than the parallel form's). g is a bf16 leaf too: its gradient
    from the kernels and from the state write, rounded twice, was 1.3x the parallel form's error."""
    T, Hx, Kx, Vx = 256, 4, 64, 48
    x = seeded_inputs(1, T, Hx, Kx, Vx, decay=True, seed=3, device=DEVICE)
    P = make_feature_map("psd", Kx).dim()
    gen = torch.Generator().manual_seed(4)
    h0 = KataState(0.5 * torch.randn(1, Hx, P, Vx, generator=gen), torch.rand(1, Hx, P, generator=gen)) if with_state else None
    do = torch.randn(1, T, Hx, Vx, generator=gen, dtype=torch.float64).to(DEVICE)
    dS, dz = (torch.randn(*shape, generator=gen, dtype=torch.float64).to(DEVICE) for shape in ((1, Hx, P, Vx), (1, Hx, P)))

    def grads(form, dtype):
        leaves = [x[n].to(dtype).requires_grad_() for n in ("q", "k", "v", "g")]
        state = None if h0 is None else KataState(*(t.to(DEVICE, torch.float64 if dtype == torch.float64 else torch.float32) for t in h0))
        o, st = form(*leaves, normalize=False, scale=Kx ** -0.5, initial_state=state, output_final_state=True)
        loss = (o.double() * do).sum() + (st.S.double() * dS).sum() + (st.z.double() * dz).sum()
        return torch.autograd.grad(loss, leaves)

    exact, fast, base = grads(kata_naive, torch.float64), grads(kata_triton_parallel, torch.bfloat16), grads(kata_parallel, torch.bfloat16)
    for name, got, ref, want in zip(("dq", "dk", "dv", "dg"), fast, base, exact):
        assert rel_err(got, want) <= 1.25 * rel_err(ref, want), f"{name}: {rel_err(got, want):.2e} against {rel_err(ref, want):.2e}"
