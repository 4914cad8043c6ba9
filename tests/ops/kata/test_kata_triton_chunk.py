"""Triton `kata(impl="triton_chunk")` (the chunked lifted-state form) against the float64 naive spec.

The kernels are called directly (`kata_chunk_fused`), so that T = 1 runs them too and not the decoding step.

The bound per tensor is `polyattn.testing.assert_low_precision_matches`'s: at most twice the error of the
PyTorch `chunk` form on the same low-precision inputs (or one rounding floor), under a hard ceiling, for o,
the final state (S and z) and every gradient (dq, dk, dv, dg and the initial state's, through o and the
final state). On a CPU-only machine the kernels run under TRITON_INTERPRET=1
at tiny shapes with small tiles and state chunks (several chunks and sub-tiles per sequence); with CUDA at
real shapes and the default tiles. Each kernel stage is compared with its PyTorch twin.
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import replace

import pytest
import torch

from polyattn import ops
from polyattn.ops.kata import kata_chunk, kata_naive, make_feature_map
from polyattn.ops.kata.state import join_state
from polyattn.ops.kata.triton.function import kata_chunk_fused
from polyattn.ops.kata.triton.chunk import kata_lift_grad_ref, kata_read_ref, kata_state_grads_ref, kata_states_ref
from polyattn.ops.triton.plan import KernelConfig, use_config
from polyattn.testing import (
    assert_close_rel, assert_continuation, assert_low_precision_matches, dtype_id, kata_case_id, kata_gpu_cases,
    random_kata_state, seeded_inputs,
)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if CUDA:
    B, H, K, V = 2, 16, 64, 48
    T_GRID = [1, 63, 64, 65, 1000, 2100]
    CONFIG = KernelConfig(kata_chunk_size=256, kata_wide_chunk_size=256)  # several chunks at T = 1000
else:
    B, H, K, V = 2, 2, 16, 12  # K / groups: a power of two >= 4 for every variant
    T_GRID = [1, 63, 64, 65, 130]
    # 2 sub-tiles a chunk, 5 chunks at T = 130; reads in tiles of 32 (not the walks' 16); feature blocks of
    # 32 lifted features (several per slot)
    CONFIG = KernelConfig(kata_block_m=32, kata_block_n=16, kata_chunk_size=32, kata_read_block=32, kata_state_block=32)
VARIANTS = [(1, "concat"), (2, "concat"), (4, "concat"), (2, "sum"), (4, "sum")]


def _state(N, groups, combine, seed):
    return random_kata_state(N, H, make_feature_map("psd", K, groups, combine), V, seed=seed, device=DEVICE)


def _check(T, dtype, groups, combine, decay, normalize, with_state, Bx=1, seed=0, lengths=None, config=CONFIG):
    N = Bx if lengths is None else len(lengths)
    h0 = _state(N, groups, combine, seed + 1) if with_state else None
    x = seeded_inputs(Bx, T if lengths is None else sum(lengths), H, K, V, decay=decay, seed=seed, device=DEVICE)
    x = {n: x[n] for n in ("q", "k", "v", "g")}
    opts = dict(groups=groups, combine=combine, normalize=normalize, eps=1e-6)
    forms = [functools.partial(f, **opts) for f in (kata_naive, kata_chunk, kata_chunk_fused)]  # the kernels, also at T = 1
    with use_config(config):
        assert_low_precision_matches(*forms, x, h0, dtype, lengths=lengths)


# (T, dtype, groups, combine, decay, normalize, with_state). CPU: every variant once in fp32, bf16 cases, the T
# grid on KATA-M1; CUDA: KATA-M1 over the T grid, both dtypes and every flag, the other variants at 65 and 1000.
if CUDA:
    CASES = kata_gpu_cases(T_GRID, VARIANTS)
else:
    CASES = [(70, torch.float32, G, c, True, True, True) for G, c in VARIANTS] + [
        (T, torch.float32, 1, "concat", True, n, s) for T in T_GRID for n, s in ((True, True), (False, False))
    ] + [
        (65, torch.bfloat16, 1, "concat", True, True, True),
        (70, torch.bfloat16, 2, "sum", True, False, True),
        (64, torch.bfloat16, 2, "concat", False, True, False),
        (130, torch.float16, 1, "concat", True, True, False),
    ]


@pytest.mark.parametrize("case", CASES, ids=[kata_case_id(c) for c in CASES])
def test_triton_chunk_matches_naive(case):
    """o, the final state and every gradient: each (groups, combine), with and without decay, normalized or
    not, with and without an initial state (read by the first chunk), over the T grid (a chunk boundary inside
    or not)."""
    T, dtype, groups, combine, decay, normalize, with_state = case
    _check(T, dtype, groups, combine, decay, normalize, with_state, Bx=B if T <= 65 else 1)


VARLEN = [(torch.float32, 1, "concat"), (torch.bfloat16, 2, "sum")]


@pytest.mark.parametrize("dtype, groups, combine", VARLEN, ids=[f"{dtype_id(d)}-{c}-G{g}" for d, g, c in VARLEN])
def test_triton_chunk_varlen_matches_naive(dtype, groups, combine):
    """Packed sequences of lengths around the chunk size, each from its own state."""
    lengths = [1, 40, 17, 70] if not CUDA else [1, 256, 1000, 2047, 130]
    _check(None, dtype, groups, combine, True, True, True, lengths=lengths, seed=4)


@pytest.mark.parametrize("split", [1, 31, 33, 64, 97])
def test_triton_chunk_prefill_continues(split):
    """A prefill on the chunked form, continued from its final state at a split inside or on a chunk's edge."""
    x = seeded_inputs(1, 130, H, K, V, decay=True, seed=2, device=DEVICE, dtype=torch.float32)
    inputs = {n: x[n] for n in ("q", "k", "v", "g")}
    with use_config(CONFIG), torch.no_grad():
        assert_continuation(ops.kata, inputs, split, 2e-5, groups=2, impl="triton_chunk")


@pytest.mark.parametrize("decay", [None, -1e4, float("-inf")], ids=["no-decay", "huge", "reset"])
@pytest.mark.parametrize("groups, combine", [(1, "concat"), (2, "concat"), (4, "sum")], ids=["M1", "M2", "S4"])
def test_chunk_stages_match_twins(groups, combine, decay):
    """The state walk and the read against `kata_states_ref` / `kata_read_ref`, the backward's reverse walk
    against `kata_state_grads_ref` and its lift gradient against `kata_lift_grad_ref` (autograd of the read in
    float64), on packed sequences from initial states, with a huge log-decay or a reset planted inside a sub-tile."""
    from polyattn.ops.kata.triton.function import Cotangents, _chunk_plan, chunk_lift_grad, chunk_read, chunk_states

    lengths = (70, 5, 40)
    N_tok, N = sum(lengths), len(lengths)
    fmap = make_feature_map("psd", K, groups, combine)
    x = seeded_inputs(1, N_tok, H, K, V, decay=True, seed=3, device=DEVICE, dtype=torch.float32)
    q, k, v, g = (x[n][0].contiguous() for n in ("q", "k", "v", "g"))  # [N_tok, H, *]
    if decay is not None:
        g[37, 0] = decay
    h0 = join_state(_state(N, groups, combine, 5), torch.float32)  # [N, H, P, V + 1]
    with use_config(CONFIG) as config:
        CS = config.kata_chunk_size
        plan = _chunk_plan(q[None], v[None], lengths, groups, combine)  # the launchers' plan ([1, N_tok, H, *] views)
        hs, zs, ht, zt = chunk_states(k, v, g, h0[..., :-1].contiguous(), h0[..., -1].contiguous(), plan, N, True)
        states, finals = kata_states_ref(k, v, g, h0, lengths, CS, fmap)
        assert_close_rel(hs, states[..., :-1], 1e-5, "chunk states S")
        assert_close_rel(zs, states[..., -1], 1e-5, "chunk states z")
        assert_close_rel(ht, finals[..., :-1], 1e-5, "final S")
        assert_close_rel(zt, finals[..., -1], 1e-5, "final z")
        prior = chunk_read(q, g, hs, zs, 0.09, plan)
        assert_close_rel(prior, kata_read_ref(q, g, states, lengths, CS, fmap, 0.3), 1e-5, "prior")
        # the backward's stages: the reverse walk of the state gradient, the lift gradient of a read, the read
        # of the state gradients; the reads' cotangents as the kernels take them, rows [a·y | b] (y in bf16)
        gen = torch.Generator().manual_seed(6)
        rows = Cotangents(*(torch.randn(N_tok, H, *d, generator=gen).to(DEVICE) for d in ((V,), (), ())))
        rows = rows._replace(y=rows.y.bfloat16())
        y = torch.cat([rows.a[..., None] * rows.y.float(), rows.b[..., None]], -1)  # [N_tok, H, V + 1]: the rows formed
        dfinal = torch.randn(N, H, fmap.dim(), V + 1, generator=gen).to(DEVICE)
        ds, dzs, dh0, dz0 = chunk_states(q, rows, g, dfinal[..., :-1].contiguous(), dfinal[..., -1].contiguous(), plan, N, True, reverse=True)
        grads, initial = kata_state_grads_ref(q, y, g, dfinal, lengths, CS, fmap)
        assert_close_rel(ds, grads[..., :-1], 1e-5, "gradients of the chunks' leaving states, S")
        assert_close_rel(dzs, grads[..., -1], 1e-5, "gradients of the chunks' leaving states, z")
        assert_close_rel(dh0, initial[..., :-1], 1e-5, "gradient of the initial S")
        assert_close_rel(dz0, initial[..., -1], 1e-5, "gradient of the initial z")
        assert_close_rel(chunk_lift_grad(q, rows, hs, zs, plan), kata_lift_grad_ref(q, y, states, lengths, CS, fmap), 1e-5, "lift gradient")
        added = chunk_lift_grad(q, rows, hs, zs, plan, into=torch.ones(N_tok, H, K, device=DEVICE))  # into a buffer holding ones
        assert_close_rel(added - 1.0, kata_lift_grad_ref(q, y, states, lengths, CS, fmap), 1e-5, "lift gradient, added")
        # the writes' dk and dv in one pass on the state gradients: the read weighted by the rows' a, added into ones
        read = torch.ones(N_tok, H, V, device=DEVICE)
        dk = chunk_lift_grad(k, rows, ds, dzs, plan, into=torch.ones(N_tok, H, K, device=DEVICE), read_into=read)
        assert_close_rel(dk - 1.0, kata_lift_grad_ref(k, y, grads, lengths, CS, fmap), 1e-5, "lift gradient on the state gradients")
        expected = rows.a[..., None] * kata_read_ref(k, None, grads, lengths, CS, fmap, 1.0)[..., :V]
        assert_close_rel(read - 1.0, expected, 1e-5, "weighted read of the state gradients, added")


def test_wide_maps_take_the_wide_state_chunk():
    """Maps of at least `kata_wide_features` lifted features cut their sequences into `kata_wide_chunk_size` chunks,
    narrower ones into `kata_chunk_size`; the wide chunks give the same results (here M1, P = K², made "wide")."""
    from polyattn.ops.kata.triton.function import _chunk_plan

    x = seeded_inputs(1, 70, H, K, V, decay=True, seed=8, device=DEVICE, dtype=torch.float32)
    wide = replace(CONFIG, kata_wide_features=K * K, kata_wide_chunk_size=2 * CONFIG.kata_chunk_size)
    with use_config(wide):
        assert _chunk_plan(x["q"], x["v"], (70,), 1, "concat")["CS"] == 2 * CONFIG.kata_chunk_size  # P = K²
        assert _chunk_plan(x["q"], x["v"], (70,), 2, "concat")["CS"] == CONFIG.kata_chunk_size  # P = K² / 2
    _check(70, torch.float32, 1, "concat", True, True, True, seed=8, config=wide)


def test_triton_chunk_refuses_other_group_widths():
    y = seeded_inputs(1, 20, H, 12, V, device=DEVICE, dtype=torch.float32)
    with pytest.raises(ValueError, match="power of two"):
        ops.kata(y["q"], y["k"], y["v"], groups=3, impl="triton_chunk")
    with pytest.raises(ValueError, match="power of two >= 4"):
        ops.kata(y["q"], y["k"], y["v"], groups=4, impl="triton_chunk")  # E = 3


def test_triton_takes_the_chunked_form_past_its_crossover(monkeypatch):
    """`impl="triton"` (and so `auto` on CUDA) runs a PSD call on the chunked form once the longest sequence
    reaches the crossover, with or without gradients, and the quadratic kernel below it."""
    kt = importlib.import_module("polyattn.ops.kata.triton")  # the package (`polyattn.ops.kata` is also the op's name)
    calls = []
    for name in ("kata_triton_chunk", "kata_triton_parallel"):
        form = getattr(kt, name)
        monkeypatch.setattr(kt, name, lambda *a, _f=form, _n=name, **kw: calls.append(_n) or _f(*a, **kw))
    x = seeded_inputs(1, 70, H, K, V, decay=True, seed=6, device=DEVICE, dtype=torch.float32)
    args = [x[n] for n in ("q", "k", "v", "g")]
    P = make_feature_map("psd", K, 2).dim()
    with use_config(replace(CONFIG, kata_chunk_crossover=70 / (P + 1024))):
        with torch.no_grad():
            o_long, _ = ops.kata(*args, groups=2, impl="triton")
            o_short, _ = ops.kata(*(a[:, :69] for a in args), groups=2, impl="triton")
        leaves = [a.clone().requires_grad_() for a in args]
        o_grad, _ = ops.kata(*leaves, groups=2, impl="triton")
        o_grad.sum().backward()
        o_grad_short, _ = ops.kata(*(a[:, :69] for a in leaves), groups=2, impl="triton")
        assert calls == ["kata_triton_chunk", "kata_triton_parallel", "kata_triton_chunk", "kata_triton_parallel"]
        o_quadratic, _ = ops.kata(*args, groups=2, impl="triton_parallel")
    assert_close_rel(o_long, o_quadratic, 1e-5, "chunked against quadratic")
    assert_close_rel(o_grad.detach(), o_quadratic, 1e-5, "chunked with gradients against quadratic")
    assert_close_rel(o_short, o_grad_short.detach(), 1e-5, "quadratic")
    assert all(x.grad is not None and bool(torch.isfinite(x.grad).all()) for x in leaves)
