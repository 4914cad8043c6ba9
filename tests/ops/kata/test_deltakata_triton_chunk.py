"""Triton DeltaKATA on its chunked kernels (`impl="triton_chunk"`, ops/kata/triton/delta.py) against the float64
naive spec.

The bound per tensor is `polyattn.testing.assert_low_precision_matches`'s: at most twice the error of the
PyTorch `chunk` form on the same low-precision inputs (or one rounding floor), under a hard ceiling, for o,
the final state and every gradient (dq, dk, dv, dbeta, dg and the initial state's, through o and the final
state). The kernels are called directly (`deltakata_chunk_fused`), so that T = 1 runs them too and not the
decoding step. On a CPU-only machine they run under TRITON_INTERPRET=1 at tiny shapes with chunks of 16
tokens (several chunks per sequence); with CUDA at real shapes and the default chunk of 128 (run it there with
few workers: the float64 naive form at K = 64 and T = 1000 takes tens of GB). The walk is also
compared with its PyTorch twin, forward and (through the twin's autograd) backward.
"""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from polyattn import ops
from polyattn.ops.kata import deltakata_chunk, deltakata_naive, make_feature_map
from polyattn.ops.kata.triton.algebra import chunk_algebra, chunk_algebra_backward, chunk_algebra_backward_ref, chunk_algebra_ref
from polyattn.ops.kata.triton.delta import (
    _walk_plan, chunk_layout, deltakata_chunk_fused, deltakata_coefficients, deltakata_walk, deltakata_walk_ref, state_interval,
    state_rounds,
)
from polyattn.ops.triton.plan import KernelConfig, get_config, use_config
from polyattn.testing import (
    LOW_PRECISION_CEILING, LOW_PRECISION_FLOOR, assert_close_rel, assert_continuation, assert_low_precision_matches, dtype_id,
    rel_err, seeded_inputs,
)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if CUDA:
    B, H, K, V = 2, 16, 64, 48
    T_GRID = [1, 63, 64, 65, 129, 1000]  # 129: past the default chunk of 128
    CONFIG = KernelConfig()
else:
    B, H, K, V = 2, 2, 16, 12  # the group width K / groups: 16 here, the narrowest the kernels take
    T_GRID = [1, 15, 16, 17, 50]
    CONFIG = KernelConfig(deltakata_chunk_size=16, kata_read_block=16)  # 4 chunks at T = 50
KERNELS = dataclasses.replace(CONFIG, deltakata_algebra_kernels=True)  # the chunk-local algebra on its kernels


def _state(N, fmap, seed):
    return 0.5 * torch.randn(N, H, fmap.dim(), V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(DEVICE)


def _width(groups):
    """The head width of a variant: K on the GPU; on the CPU 16 per group (group width 16, the narrowest)."""
    return K if CUDA else 16 * groups


def _check(T, dtype, groups, combine, decay, with_state, Bx=1, seed=0, lengths=None, config=CONFIG):
    N = Bx if lengths is None else len(lengths)
    Kx = _width(groups)
    fmap = make_feature_map("psd", Kx, groups, combine)
    x = seeded_inputs(Bx, T if lengths is None else sum(lengths), H, Kx, V, decay=decay, beta=True, seed=seed, device=DEVICE)
    x = {n: x[n] for n in ("q", "k", "v", "beta", "g")}
    opts = dict(groups=groups, combine=combine, eps=1e-6)
    fused = functools.partial(deltakata_chunk_fused, **opts)
    fused.native_varlen = True
    forms = [functools.partial(f, feature="psd", **opts) for f in (deltakata_naive, deltakata_chunk)] + [fused]
    with use_config(config):
        assert_low_precision_matches(*forms, x, _state(N, fmap, seed + 1) if with_state else None, dtype, lengths=lengths)


VARIANTS = [(1, "concat"), (2, "concat"), (4, "concat"), (2, "sum"), (4, "sum")]
# (T, dtype, groups, combine, decay, with_state): KATA-M1 over the T grid in both dtypes, the other variants in
# fp32 and bf16 on the GPU, in one of them (alternating) on the CPU (M4 on the GPU only), alternating the flags; fp16 once
CASES = [(T, dt, 1, "concat", True, T % 2 == 1) for T in T_GRID for dt in (torch.float32, torch.bfloat16)] + [
    (T_GRID[-2], dt, G, c, i % 2 == 0, i % 2 == 1) for i, (G, c) in enumerate(VARIANTS[1:])
    for dt in ((torch.float32, torch.bfloat16) if CUDA else ((torch.bfloat16, torch.float32)[i % 2],))
    if CUDA or (G, c) != (4, "concat")  # the CPU's 16-wide groups make M4 a 64-wide head: Σ4 covers 4 groups there
] + [(T_GRID[-1], torch.float16, 2, "concat", True, True)]


@pytest.mark.parametrize("case", CASES, ids=[f"T{T}-{dtype_id(d)}-G{G}-{c}-{'g' if g else 'nog'}-{'h0' if s else 'noh0'}"
                                             for T, d, G, c, g, s in CASES])
def test_triton_chunk_matches_naive(case):
    """o, the final state and every gradient: each (groups, combine), with and without decay and an initial
    state, over the T grid (one token, a chunk boundary inside or not)."""
    T, dtype, groups, combine, decay, with_state = case
    _check(T, dtype, groups, combine, decay, with_state, Bx=B if T < T_GRID[-1] else 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_triton_chunk_varlen_matches_naive(dtype):
    """Packed sequences (one of a single token, others around the chunk size), each from its own state."""
    # on the GPU: 1025 is one past eight chunks; the float64 naive form keeps tens of MB a token at these widths, so
    # the packed call stays under an H100's 80 GB
    lengths = [1, 16, 37, 20] if not CUDA else [1, 64, 500, 1025, 130]
    _check(None, dtype, 1 if not CUDA else 2, "concat", True, True, lengths=lengths, seed=4)


# (T, dtype, groups, combine, lengths): the chunk-local algebra's kernels end to end, fp32 and bf16, M1 and Σ2, packed
KERNEL_CASES = [(T_GRID[-1], torch.float32, 1, "concat", None), (T_GRID[-2], torch.bfloat16, 2, "sum", None),
                (None, torch.float32, 1, "concat", [1, 16, 37, 20] if not CUDA else [1, 64, 500, 130])]


@pytest.mark.parametrize("case", KERNEL_CASES, ids=[f"T{T}-{dtype_id(d)}-G{G}-{c}{'-varlen' if n else ''}"
                                                    for T, d, G, c, n in KERNEL_CASES])
def test_algebra_kernels_match_naive(case):
    """With `KernelConfig.deltakata_algebra_kernels` (the chunk-local algebra, its backward and the walk's `[C, C]`
    gradients on kernels): o, the final state and every gradient, as the default path is tested."""
    T, dtype, groups, combine, lengths = case
    _check(T, dtype, groups, combine, True, True, seed=6, lengths=lengths, config=KERNELS)


@pytest.mark.parametrize("split", [1, 17] if not CUDA else [1, 15, 17, 32])
def test_prefill_continues(split):
    """A prefill continued from its final state at a split inside or on a chunk's edge equals one call."""
    x = seeded_inputs(1, 50, H, _width(2), V, decay=True, beta=True, seed=2, device=DEVICE, dtype=torch.float32)
    inputs = {n: x[n] for n in ("q", "k", "v", "beta", "g")}
    with use_config(CONFIG), torch.no_grad():
        assert_continuation(ops.kata, inputs, split, 2e-5, groups=2, normalize=False, impl="triton_chunk")


def _walk_inputs(lengths, groups, combine, seed, state_seed):
    """Flat fp32 tokens of the packed `lengths`, their chunk-local coefficients, the walk's plan and initial states
    (call it under `use_config`): `(fmap, flat, coefs, plan, h0)`."""
    N_tok, Kx = sum(lengths), _width(groups)
    fmap = make_feature_map("psd", Kx, groups, combine)
    x = seeded_inputs(1, N_tok, H, Kx, V, decay=True, beta=True, seed=seed, device=DEVICE, dtype=torch.float32)
    flat = [x[n][0].contiguous() for n in ("q", "k", "v", "beta", "g")]
    plan = _walk_plan(lengths, H, Kx, V, groups, combine, DEVICE, torch.float32)
    idx, mask = chunk_layout(plan["table"], get_config().deltakata_chunk_size, N_tok)
    with torch.no_grad():
        coefs = deltakata_coefficients(*flat, fmap=fmap, scale=Kx**-0.5, eps=1e-6, idx=idx, mask=mask)
    return fmap, flat, coefs, plan, _state(len(lengths), fmap, state_seed).float()


@pytest.mark.parametrize("groups, combine, config", [(1, "concat", CONFIG), (2, "sum", CONFIG), (1, "concat", KERNELS)],
                         ids=["M1", "S2", "M1-kernels"])
def test_walk_matches_twin(groups, combine, config):
    """The walk kernel against `deltakata_walk_ref` (float64) on the same fp32 coefficients, packed sequences from
    initial states, every stored row and state; its backward op against the twin's autograd, for every input (with
    `deltakata_algebra_kernels`, dM and dA from their kernel)."""
    lengths = (40, 5, 17) if not CUDA else (700, 5, 170)
    with use_config(config) as config:
        C = config.deltakata_chunk_size
        fmap, flat, coefs, plan, h0 = _walk_inputs(lengths, groups, combine, 3, 5)
        leaves = [t.clone().requires_grad_() for t in (flat[0], flat[1], *coefs, h0)]
        got = deltakata_walk(*leaves, list(lengths), groups, combine, torch.float32, True)
        ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
        ref = deltakata_walk_ref(*ref_leaves, lengths, C, fmap)
        kept = plan["rounds"]["ckpt"] >= 0  # the entering states the forward keeps (checkpoints), in chunk order
        for name, a, b in zip(("o", "final state", "checkpoints", "U", "Yk", "Yq"), got, (*ref[:2], ref[2][kept], *ref[3:])):
            assert_close_rel(a, b, 1e-5, name)
        gen = torch.Generator().manual_seed(6)
        do, dht = (torch.randn(t.shape, generator=gen).to(DEVICE) for t in (got[0], got[1]))
        grads = torch.autograd.grad((got[0] * do).sum() + (got[1] * dht).sum(), leaves)
        want = torch.autograd.grad((ref[0] * do).sum() + (ref[1] * dht).sum(), ref_leaves)
    for name, a, b in zip(("dq", "dk", "dM", "dA", "db", "dalpha", "domega", "drho", "dlam", "dh0"), grads, want):
        assert rel_err(a, b) <= 1e-5, f"{name}: {rel_err(a, b):.2e}"


@pytest.mark.parametrize("groups, combine", [(1, "concat"), (2, "concat"), (2, "sum")], ids=["M1", "M2", "S2"])
def test_chunk_algebra_backward_passes_gradcheck(groups, combine):
    """`chunk_algebra`'s written-out backward against finite differences (float64): every output's cotangent into
    k, q, β and g, with a padded row (k = 0, β = 0: its norm clamped), a decay reset and a second chunk; and both
    custom ops' schema, fakes and autograd registration."""
    gen = torch.Generator().manual_seed(17)
    kc, qc = (torch.randn(2, 2, 6, 4 * groups, generator=gen, dtype=torch.float64) for _ in range(2))
    bc, gc = (torch.rand(2, 2, 6, generator=gen, dtype=torch.float64) for _ in range(2))
    gc = -gc
    kc[1, :, -1], bc[1, :, -1], gc[1, :, -1] = 0.0, 0.0, 0.0  # a padded row
    gc[0, 1, 3] = -30.0  # a reset inside a chunk
    leaves = [x.requires_grad_() for x in (kc, qc, bc, gc)]
    assert torch.autograd.gradcheck(lambda *x: chunk_algebra(*x, groups, combine, 0.3, 1e-6), leaves)
    args = (*leaves, groups, combine, 0.3, 1e-6)
    torch.library.opcheck(torch.ops.polyattn.deltakata_algebra.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    outs = chunk_algebra(*args)
    back = (*(torch.randn_like(x) for x in outs), *(x.detach() for x in leaves), outs[0].detach(), groups, combine, 0.3, 1e-6)
    torch.library.opcheck(torch.ops.polyattn.deltakata_algebra_backward.default, back, test_utils=("test_schema", "test_faketensor"))


def _algebra_inputs(C, groups, seed, NC=3):
    """Chunked fp32 keys, queries, β and log-decays `[NC, H, C, ...]` as `deltakata_coefficients` forms them: the last
    chunk padded (zero rows past its 5th-to-last token), a reset-sized log-decay inside the second."""
    gen = torch.Generator().manual_seed(seed)
    Kx = _width(groups)
    kc, qc = (torch.randn(NC, H, C, Kx, generator=gen) * Kx**-0.25 for _ in range(2))
    bc, gc = torch.rand(NC, H, C, generator=gen), -0.3 * torch.rand(NC, H, C, generator=gen)
    kc[-1, :, -5:], qc[-1, :, -5:], bc[-1, :, -5:], gc[-1, :, -5:] = 0.0, 0.0, 0.0, 0.0
    gc[1, 0, C // 2 + 3] = -110.0
    return [x.to(DEVICE) for x in (kc, qc, bc, gc)]


ALGEBRA_CASES = [(16, 1, "concat"), (64, 1, "concat"), (64, 2, "concat"), (64, 2, "sum"), (128, 1, "concat")]


@pytest.mark.parametrize("C, groups, combine", ALGEBRA_CASES, ids=[f"C{C}-G{G}-{c}" for C, G, c in ALGEBRA_CASES])
def test_algebra_kernel_matches_twin(C, groups, combine):
    """`deltakata_algebra_kernel` (M through the blocked inverse: C / 16 diagonal blocks) against its twin in float64,
    within the fp32 bound of the Triton tests (twice the fp32 twin's error, or the floor), every output."""
    x = _algebra_inputs(C, groups, seed=C + groups)
    args = (groups, combine, _width(groups) ** -0.5, 1e-6)
    with use_config(KERNELS):
        got = chunk_algebra(*x, *args)
    fp32 = chunk_algebra_ref(*x, *args)
    want = chunk_algebra_ref(*(t.double() for t in x), *args)
    for name, a, b, ref in zip(("M", "A", "alpha", "omega", "rho", "lam"), got, fp32, want):
        bound = min(max(2 * rel_err(b, ref), LOW_PRECISION_FLOOR[torch.float32]), LOW_PRECISION_CEILING[torch.float32])
        assert rel_err(a, ref) <= bound, f"{name}: {rel_err(a, ref):.2e} > {bound:.2e}"
    assert bool((torch.triu(got[0], 1) == 0).all()) and bool((torch.triu(got[1], 1) == 0).all())


@pytest.mark.parametrize("C, groups, combine", ALGEBRA_CASES, ids=[f"C{C}-G{G}-{c}" for C, G, c in ALGEBRA_CASES])
def test_algebra_grad_kernel_matches_twin(C, groups, combine):
    """`deltakata_algebra_grad_kernel` (row blocks of 32: C / 32 of them, one at C = 16) against its twin in float64,
    within the fp32 bound of the Triton tests, for dk, dq, dβ and dg from random cotangents of every output."""
    x = _algebra_inputs(C, groups, seed=C + groups + 1)
    args = (groups, combine, _width(groups) ** -0.5, 1e-6)
    M = chunk_algebra_ref(*x, *args)[0]
    NC = x[0].shape[0]
    gen = torch.Generator().manual_seed(C)
    cot = [torch.randn(shape, generator=gen).to(DEVICE) for shape in [(NC, H, C, C)] * 2 + [(NC, H, C)] * 3 + [(NC, H)]]
    with use_config(KERNELS):
        got = chunk_algebra_backward(*cot, *x, M, *args)
    fp32 = chunk_algebra_backward_ref(*cot, *x, M, *args)
    want = chunk_algebra_backward_ref(*(t.double() for t in (*cot, *x, M)), *args)
    for name, a, b, ref in zip(("dk", "dq", "dbeta", "dg"), got, fp32, want):
        bound = min(max(2 * rel_err(b, ref), LOW_PRECISION_FLOOR[torch.float32]), LOW_PRECISION_CEILING[torch.float32])
        assert rel_err(a, ref) <= bound, f"{name}: {rel_err(a, ref):.2e} > {bound:.2e}"


@pytest.mark.parametrize("field", ["k", "beta", "g"])
def test_algebra_kernel_keeps_rows_before_a_nonfinite_token(field):
    """A NaN or Inf at token p of a chunk (p = 37 of 64: the third diagonal block of the inverse, not its first row)
    leaves M's and A's rows before p bit-identical, and M's and A's upper triangles exact zeros."""
    x = _algebra_inputs(64, 1, seed=5)
    args = (1, "concat", _width(1) ** -0.5, 1e-6)
    with use_config(KERNELS):
        clean = chunk_algebra(*x, *args)
    for value in ("nan", "inf") if field != "g" else ("nan",):
        bad = [t.clone() for t in x]
        target = bad[("k", "q", "beta", "g").index(field)]
        target[0, 1, 37] = float(value)
        with use_config(KERNELS):
            M, A, *_ = chunk_algebra(*bad, *args)
        assert torch.equal(M[0, 1, :37], clean[0][0, 1, :37]) and torch.equal(A[0, 1, :37], clean[1][0, 1, :37]), field
        assert bool((torch.triu(M, 1) == 0).all()) and bool((torch.triu(A, 1) == 0).all()), field
        assert torch.equal(M[1:], clean[0][1:]) and torch.equal(M[0, 0], clean[0][0, 0]), f"{field}: another chunk changed"


def _walk_grads(lengths, config, seed=15):
    """The walk op's output and every input's gradient, fp32, M1, packed `lengths` from initial states."""
    with use_config(config):
        _, flat, coefs, _, h0 = _walk_inputs(lengths, 1, "concat", seed, seed)
        leaves = [t.clone().requires_grad_() for t in (flat[0], flat[1], *coefs, h0)]
        o, ht, *_ = deltakata_walk(*leaves, list(lengths), 1, "concat", torch.float32, True)
        gen = torch.Generator().manual_seed(seed)
        do, dht = (torch.randn(t.shape, generator=gen).to(DEVICE) for t in (o, ht))
        return (o, ht, *torch.autograd.grad((o * do).sum() + (ht * dht).sum(), leaves))


def test_backward_rounds_give_the_same_bits():
    """The backward recomputes the entering states round by round from the checkpoints with the forward's own write,
    so every gradient is bit for bit the same at any checkpoint interval: every chunk a checkpoint, the default
    (rounds of two chunks here, the last one short), one round a sequence."""
    C = CONFIG.deltakata_chunk_size
    lengths = (4 * C + 6, 5, 2 * C + 1)  # 5, 1 and 3 chunks
    runs = [_walk_grads(lengths, dataclasses.replace(CONFIG, deltakata_state_interval=r)) for r in (1, None, 100)]
    names = ("o", "ht", "dq", "dk", "dM", "dA", "db", "dalpha", "domega", "drho", "dlam", "dh0")
    for run in runs[1:]:
        for name, a, b in zip(names, run, runs[0]):
            assert torch.equal(a, b), f"{name} differs between checkpoint intervals"


def test_state_rounds_cover_every_chunk_once():
    """The checkpoint layout (a checkpoint every R chunks of each sequence) and the backward's rounds: every chunk in
    exactly one round, in its sequence's order, its slot inside the round buffer, every token in one lift tile;
    the default interval ⌈√(c / 2)⌉."""
    lengths, C, R = (70, 33, 16, 5), 16, 2  # 5, 3, 1, 1 chunks
    firsts = [0, 5, 8, 9, 10]
    with use_config(KernelConfig(deltakata_state_interval=R)):
        layout = state_rounds(lengths, C, 8, "cpu")
    assert layout["ckpt"].tolist() == [0, -1, 1, -1, 2, 3, -1, 4, 5, 6] and layout["NK"] == 7
    spans = [(bos + s, bos + min(s + C, n))  # every chunk's tokens
             for bos, n in zip((0, 70, 103, 119), lengths) for s in range(0, n, C)]
    seen, tokens = [], torch.zeros(sum(lengths), dtype=torch.int64)
    for r, rnd in enumerate(layout["rounds"]):
        chunk_of = {}  # round-buffer slot -> chunk
        for n, (lo, hi, base, k) in enumerate(rnd["bounds"].tolist()):
            count = firsts[n + 1] - firsts[n]
            assert (lo, hi) == (firsts[n] + min(r * R, count), firsts[n] + min((r + 1) * R, count))
            if lo < hi:
                assert layout["ckpt"][lo] == k and 0 <= base and base + hi - lo <= layout["NS"]
            chunk_of.update({base + c - lo: c for c in range(lo, hi)})
            seen += range(lo, hi)
        for t0, t1, slot, _ in rnd["tiles"].tolist():
            tokens[t0:t1] += 1
            assert spans[chunk_of[slot]][0] <= t0 < t1 <= spans[chunk_of[slot]][1]  # the tile's state is its chunk's
    assert sorted(seen) == list(range(10))
    assert tokens.eq(1).all()
    with use_config(KernelConfig(deltakata_state_interval=1)):
        every = state_rounds(lengths, C, 8, "cpu")  # every state kept: one round reading the checkpoints themselves
    assert not every["recompute"] and every["ckpt"].tolist() == list(range(10)) and every["NS"] == every["NK"] == 10
    assert [row[:3] for row in every["rounds"][0]["bounds"].tolist()] == [[0, 5, 0], [5, 8, 5], [8, 9, 8], [9, 10, 9]]
    with use_config(KernelConfig()):
        assert state_interval((8192,) * 8, 128) == 6  # 64 chunks: 11 checkpoints + 2 x 6 buffered states a sequence
        assert state_interval((5, 100), 16) == 2
    with pytest.raises(ValueError, match="deltakata_state_interval"), use_config(KernelConfig(deltakata_state_interval=0)):
        state_interval((5,), 16)


def test_triton_routes_psd_maps_to_the_chunked_kernels():
    """`impl="triton"` runs PSD DeltaKATA of a power-of-two group width on the chunked kernels (the same result
    as `"triton_chunk"`), any width (P = 256 > 128 here) included."""
    x = seeded_inputs(1, 20, H, K, V, decay=True, beta=True, seed=8, device=DEVICE, dtype=torch.float32)
    args = [x[n] for n in ("q", "k", "v", "g")]
    with use_config(CONFIG), torch.no_grad():
        o, S = ops.kata(*args, beta=x["beta"], normalize=False, impl="triton", output_final_state=True)
        o_chunk, S_chunk = ops.kata(*args, beta=x["beta"], normalize=False, impl="triton_chunk", output_final_state=True)
    assert torch.equal(o, o_chunk) and torch.equal(S, S_chunk)


def test_triton_chunk_refuses_other_maps():
    y = seeded_inputs(1, 8, H, 32, V, beta=True, device=DEVICE, dtype=torch.float32)
    with pytest.raises(ValueError, match="power of two >= 16"):
        ops.kata(y["q"], y["k"], y["v"], beta=y["beta"], groups=4, normalize=False, impl="triton_chunk")  # E = 8
    with pytest.raises(ValueError, match="feature='psd'"):
        ops.kata(y["q"], y["k"], y["v"], beta=y["beta"], feature="lorentz", normalize=False, impl="triton_chunk")
    with pytest.raises(ValueError, match="deltakata_chunk_size a power of two"), use_config(KernelConfig(deltakata_chunk_size=48)):
        ops.kata(y["q"], y["k"], y["v"], beta=y["beta"], normalize=False, impl="triton_chunk")


def test_auto_takes_the_kernels_for_fitting_widths():
    """`impl="auto"` (on CUDA) picks from the Triton forms for PSD DeltaKATA of group width a power of two >= 16 and
    from the PyTorch forms otherwise (beyond one-token decoding calls)."""
    from polyattn.ops.kata import kata_auto_forms

    assert {"triton", "triton_chunk"} <= set(kata_auto_forms("psd", False, delta=True, group_width=16))
    for width in (8, 24):
        assert not any("triton" in n for n in kata_auto_forms("psd", False, delta=True, group_width=width))
    assert "triton" in kata_auto_forms("psd", True, delta=True, group_width=8)  # decoding: the fused step, any width


def test_custom_ops_pass_opcheck():
    """The walk and its backward as custom ops: schema, fake tensors (shapes and dtypes without running), the
    autograd registration."""
    lengths = [20, 13]
    with use_config(CONFIG):
        _, flat, coefs, _, h0 = _walk_inputs(lengths, 1, "concat", 5, 6)
        for dtype in (torch.float32, torch.bfloat16):  # fp32 copies, the kernels in dtype
            args = (flat[0], flat[1], *coefs, h0, lengths, 1, "concat", dtype, True)
            torch.library.opcheck(torch.ops.polyattn.deltakata_walk.default, args,
                                  test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
            o, ht, hs, u, yk, yq = torch.ops.polyattn.deltakata_walk(*args)
            for want_dh0 in (True, False):  # q, k as the forward saves them, in dtype
                back = (torch.randn_like(o), torch.randn_like(ht), flat[0].to(dtype), flat[1].to(dtype), *coefs, hs, u, yk, yq,
                        lengths, 1, "concat", dtype, want_dh0)
                torch.library.opcheck(torch.ops.polyattn.deltakata_walk_backward.default, back,
                                      test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("p", [16, 20], ids=["chunk-start", "inside"])
def test_future_nonfinite_leaves_earlier_outputs_bit_identical(p):
    """A NaN or Inf at token p (head 0) never changes an output before it, and one in k, v or g reaches an output from p
    on (chunks of 16 on the CPU: p on a chunk's first token and inside one)."""
    Kx = _width(1)
    clean = {n: t for n, t in seeded_inputs(1, 40, H, Kx, V, decay=True, beta=True, seed=11, device=DEVICE,
                                             dtype=torch.float32).items() if n in ("q", "k", "v", "beta", "g")}
    run = functools.partial(deltakata_chunk_fused, groups=1, combine="concat", eps=1e-6, scale=Kx**-0.5)
    with use_config(CONFIG), torch.no_grad():
        o_clean, _ = run(*clean.values())
        assert bool(torch.isfinite(o_clean).all())
        for field, value in [(f, v) for f in ("q", "k", "v", "beta") for v in ("nan", "inf")] + [("g", "nan")]:
            x = {n: t.clone() for n, t in clean.items()}
            x[field][:, p, 0] = float(value)
            o, _ = run(*x.values())
            assert torch.equal(o[:, :p], o_clean[:, :p]), f"{field}={value} at {p} changed an earlier output"
            if field in ("k", "v", "g"):
                assert not bool(torch.isfinite(o[:, p:, 0]).all()), f"{field}={value} at {p} never reached an output"


@pytest.mark.parametrize("packing", ["batch", "varlen"])
def test_nonfinite_token_stays_in_its_sequence(packing):
    """A NaN or Inf in one sequence (a batch row, or a packed document) changes no output or final state of another,
    earlier or later: the chunks past a sequence's end are padded with zeros, never with the next sequence's tokens
    times zero (0 * NaN is NaN). Lengths 21 and 19 in chunks of 16 on the CPU: both sequences end inside a chunk."""
    Kx = _width(1)
    lengths = [21, 19]
    rows = (2, 20) if packing == "batch" else (1, sum(lengths))
    clean = {n: t for n, t in seeded_inputs(rows[0], rows[1], H, Kx, V, decay=True, beta=True, seed=15, device=DEVICE,
                                             dtype=torch.float32).items() if n in ("q", "k", "v", "beta", "g")}
    cu = None if packing == "batch" else torch.tensor([0, *lengths], device=DEVICE).cumsum(0)
    run = functools.partial(deltakata_chunk_fused, groups=1, combine="concat", eps=1e-6, scale=Kx**-0.5, cu_seqlens=cu,
                            output_final_state=True)
    # (the poisoned sequence, its token, the other sequence's outputs): each sequence poisons the other in turn
    cases = [(1, (1, 3), (0, slice(None))), (0, (0, 18), (1, slice(None)))] if packing == "batch" else \
            [(1, (0, 24), (0, slice(0, 21))), (0, (0, 18), (0, slice(21, None)))]
    with use_config(CONFIG), torch.no_grad():
        o_clean, S_clean = run(*clean.values())
        for field, value in [(f, v) for f in ("q", "k", "v", "beta", "g") for v in ("nan", "inf")]:
            for bad, (row, t), (other, span) in cases:
                x = {n: t_.clone() for n, t_ in clean.items()}
                x[field][row, t, 0] = float(value)
                o, S = run(*x.values())
                where = f"{field}={value} in sequence {bad}"
                assert torch.equal(o[other, span], o_clean[other, span]), f"{where} changed the other's outputs"
                assert torch.equal(S[1 - bad], S_clean[1 - bad]), f"{where} changed the other's final state"


@pytest.mark.parametrize("layout", ["transposed", "stepped", "expanded"])
def test_strided_fp32_inputs_equal_contiguous_ones(layout):
    """fp32 q and k that are views (heads and time transposed in memory, every other token of a longer tensor, one
    head's row expanded over the heads) give the contiguous inputs' output, final state and gradients exactly: the
    kernels read flat row-major copies, with an initial state (the walk reads q and k)."""
    Kx = _width(1)
    x = seeded_inputs(1, 40, H, Kx, V, decay=True, beta=True, seed=16, device=DEVICE, dtype=torch.float32)
    if layout == "transposed":
        views = {n: x[n].transpose(1, 2).contiguous().transpose(1, 2) for n in ("q", "k")}
    elif layout == "stepped":
        views = {n: torch.repeat_interleave(x[n], 2, dim=1)[:, ::2] for n in ("q", "k")}
    else:
        views = {n: x[n][:, :, :1].expand_as(x[n]) for n in ("q", "k")}
    dense = {n: v.contiguous() for n, v in views.items()}
    h0 = _state(1, make_feature_map("psd", Kx), 17).float()
    run = functools.partial(deltakata_chunk_fused, groups=1, combine="concat", eps=1e-6, scale=Kx**-0.5, output_final_state=True)
    outs = []
    with use_config(CONFIG):
        for qk in (views, dense):
            leaves = [qk["q"].detach().requires_grad_(), qk["k"].detach().requires_grad_(), *(x[n].clone().requires_grad_()
                      for n in ("v", "beta", "g"))]
            o, S = run(*leaves, initial_state=h0)
            outs.append((o, S, *torch.autograd.grad(o.square().sum() + S.sum(), leaves)))
    assert not views["q"].is_contiguous()
    for name, a, b in zip(("o", "S", "dq", "dk", "dv", "dbeta", "dg"), *outs):
        assert torch.equal(a, b), f"{layout}: {name} differs from the contiguous inputs'"


@pytest.mark.parametrize("value", [-1e4, float("-inf")], ids=["huge", "reset"])
def test_exact_under_extreme_gates(value):
    """A huge negative log-decay or a reset (g = -inf) inside a chunk: o, the final state and the gradients of the
    others as the float64 naive form gives them (the decays are raised to the kernels' reset limit first)."""
    Kx = _width(1)
    x = seeded_inputs(1, 40, H, Kx, V, decay=True, beta=True, seed=12, device=DEVICE)
    x = {n: x[n] for n in ("q", "k", "v", "beta", "g")}
    x["g"][:, 21, 0] = value
    x["g"][:, 16, 1] = value  # a chunk's first token
    opts = dict(groups=1, combine="concat", eps=1e-6)
    forms = [functools.partial(deltakata_naive, feature="psd", **opts), functools.partial(deltakata_chunk, feature="psd", **opts),
             functools.partial(deltakata_chunk_fused, **opts)]
    with use_config(CONFIG), torch.no_grad():
        assert_low_precision_matches(*forms, x, _state(1, make_feature_map("psd", Kx), 13), torch.float32, backward=False)


def test_compiles_as_one_graph():
    """`torch.compile(fullgraph=True)` traces the custom ops (the chunk-local algebra is one of them); the
    gradients equal eager's."""
    x = seeded_inputs(1, 40, H, _width(1), V, decay=True, beta=True, seed=14, device=DEVICE, dtype=torch.float32)
    leaves = [x[n].clone().requires_grad_() for n in ("q", "k", "v", "beta", "g")]

    def loss(q, k, v, beta, g):
        o, S = ops.kata(q, k, v, g, beta=beta, normalize=False, impl="triton_chunk", output_final_state=True)
        return o.square().sum() + S.sum()

    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    with use_config(CONFIG):
        got = torch.autograd.grad(compiled(*leaves), leaves)
        want = torch.autograd.grad(loss(*leaves), leaves)
    for name, a, b in zip(("q", "k", "v", "beta", "g"), got, want):
        assert_close_rel(a, b, 1e-6, f"d{name}")


def test_value_tile_fills_the_multiprocessors(monkeypatch):
    """The walks' value tile: `deltakata_block_v` (32), halved to 16 while sequences x heads x tiles stay below the
    multiprocessor count (132 here), never wider than the padded V."""
    from types import SimpleNamespace

    from polyattn.ops.kata.triton.delta import value_tile

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    with use_config(KernelConfig()):
        assert value_tile(128, 64, "cuda") == 32  # 8 sequences x 16 heads: 256 programs
        assert value_tile(32, 64, "cuda") == 16  # 2 x 16: 64 programs at 32, 128 at 16
        assert value_tile(1024, 12, "cuda") == 16  # V padded to 16
        assert value_tile(16, 64, "cpu") == 32  # no multiprocessor count off CUDA
