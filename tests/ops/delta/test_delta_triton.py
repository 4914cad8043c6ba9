"""Triton `delta_rule` against the float64 naive spec (ops/README.md, "Tests: a ladder of equivalences", rung 3).

The bound per tensor is `polyattn.testing.assert_low_precision_matches`'s: at most twice the
error of the PyTorch chunk form on the same low-precision inputs (or one rounding floor), and
always under a hard ceiling, for o, the final state and every gradient (dq, dk, dv, dbeta, dg,
dh0; cotangents on o and final_state). On a CPU-only machine the kernels run under
TRITON_INTERPRET=1 (tests/conftest.py) at tiny shapes; with CUDA at real shapes. Each kernel
stage is also compared with its PyTorch twin.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from polyattn.ops.delta import delta_rule_chunk, delta_rule_naive
from polyattn.ops.delta.recurrent import delta_rule_step
from polyattn.ops.delta.triton import delta_rule_step_inplace, delta_rule_triton
from polyattn.ops.triton.plan import get_config, use_config
from polyattn.testing import assert_fused_steps, assert_low_precision_matches, assert_one_token_step, dtype_id, rel_err, seeded_inputs

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if CUDA:
    B, H, K, V = 2, 16, 128, 96
    LONG_T = 1000
else:
    B, H, K, V = 2, 2, 8, 12
    LONG_T = 300
T_GRID = [1, 63, 64, 65, LONG_T]
DTYPES = [torch.float32, torch.bfloat16]


def _inputs(Bx, T, decay, seed=0, K=K):
    x = seeded_inputs(Bx, T, H, K, V, decay=decay, beta=True, seed=seed, device=DEVICE)
    x["k"] = torch.nn.functional.normalize(x["k"], dim=-1)  # the contractive rule: |k| = 1, 0 < beta < 1
    return {n: x[n] for n in ("q", "k", "v", "beta", "g")}


def _h0(N, seed, K=K):
    return 0.5 * torch.randn(N, H, K, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(DEVICE)


@pytest.mark.parametrize("decay", [False, True], ids=["nodecay", "decay"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("T", T_GRID, ids=lambda t: f"T{t}")
def test_triton_matches_naive(T, dtype, decay):
    Bx = 1 if T == LONG_T else B
    assert_low_precision_matches(delta_rule_naive, delta_rule_chunk, delta_rule_triton, _inputs(Bx, T, decay), _h0(Bx, 2), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_triton_key_tiles(dtype):
    """K over one 64-wide key tile: the gradient kernel splits keys across programs."""
    Kx = 72 if not CUDA else 96
    assert_low_precision_matches(
        delta_rule_naive, delta_rule_chunk, delta_rule_triton, _inputs(1, 130, True, seed=11, K=Kx), _h0(1, 12, K=Kx), dtype,
    )


@pytest.mark.parametrize("fused", [True, False], ids=["fused-outputs", "output-kernel"])
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16], ids=dtype_id)
def test_triton_varlen(dtype, fused):
    """Packed sequences with states, the outputs formed in the recurrence or by the per-chunk kernel."""
    lengths = [1, 64, 37, 130] if not CUDA else [1, 64, 1000, 2047, 130]
    with use_config(replace(get_config(), delta_fused_outputs=fused)):
        assert_low_precision_matches(
            delta_rule_naive, delta_rule_chunk, delta_rule_triton, _inputs(1, sum(lengths), True, seed=4),
            _h0(len(lengths), 3), dtype, lengths=lengths,
        )


@pytest.mark.parametrize("mode", ["split", "rounded"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused-outputs", "output-kernel"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
def test_output_products(dtype, fused, mode):
    """`delta_out_dot`: the outputs' two products take their fp32 operands (the score tile, U, the entering
    state) split in two halves or rounded to the input dtype (the default, one product each); o, the final
    state and every gradient within the same bound either way, on packed sequences with states, the outputs
    formed in the recurrence or by the per-chunk kernel."""
    lengths = [1, 64, 37, 130] if not CUDA else [1, 64, 1000, 2047, 130]
    with use_config(replace(get_config(), delta_out_dot=mode, delta_fused_outputs=fused)):
        assert_low_precision_matches(
            delta_rule_naive, delta_rule_chunk, delta_rule_triton, _inputs(1, sum(lengths), True, seed=24),
            _h0(len(lengths), 25), dtype, lengths=lengths,
        )


def test_fp32_dot_names():
    """`delta_fp32_dot` and `delta_out_dot` take "split" or "rounded"; another name is a ValueError before any launch."""
    x = [t.to(torch.bfloat16) for t in _inputs(1, 65, True).values()]
    for field in ("delta_fp32_dot", "delta_out_dot"):
        with use_config(replace(get_config(), **{field: "tf32"})), pytest.raises(ValueError, match=field):
            delta_rule_triton(*x, scale=K**-0.5)


def _flat(x):
    return None if x is None else x.reshape(-1, *x.shape[2:]).contiguous()  # [B, T, H, ...] -> [B*T, H, ...]


@pytest.mark.parametrize("decay", [False, True], ids=["nodecay", "decay"])
def test_stages_match_twins(decay):
    """wy, WY factors, forward and backward kernels against their PyTorch twins on the same fp32 inputs."""
    from polyattn.ops.delta.triton.backward import delta_backward_ref, delta_score_grads
    from polyattn.ops.delta.triton.forward import delta_forward_ref
    from polyattn.ops.delta.triton.function import _apply as delta_rule_kernels
    from polyattn.ops.delta.triton.wy import wy_factors, wy_factors_ref, wy_ref, wy_solve
    from polyattn.ops.triton.plan import chunk_table

    lengths = [70, 5, 64] if not CUDA else [700, 5, 640]
    x = {n: None if t is None else t.float() for n, t in _inputs(1, sum(lengths), decay, seed=9).items()}
    q, k, v, beta, g = (_flat(x[n]) for n in ("q", "k", "v", "beta", "g"))
    C = get_config().chunk_size
    chunks = chunk_table(tuple(lengths), C, k.device)
    t_inv, firsts = wy_solve(k, beta, g, chunk_size=C, chunks=chunks)
    assert bool((firsts == C).all()), "finite inputs: no chunk has a first non-finite row"
    t_ref = wy_ref(k, beta, g, tuple(lengths), chunk_size=C)
    assert rel_err(t_inv, t_ref) <= 1e-5, f"t_inv: {rel_err(t_inv, t_ref):.2e}"
    for name, got, want in zip(("w", "u_bar"), wy_factors(k, v, beta, g, t_inv, firsts, chunks=chunks), wy_factors_ref(k, v, beta, g, t_ref, tuple(lengths), chunk_size=C)):
        assert rel_err(got, want) <= 1e-5, f"{name}: {rel_err(got, want):.2e}"

    h0 = _h0(len(lengths), 5).float()
    do = torch.randn_like(v)
    dht = torch.randn_like(h0)
    leaves = [t.clone().requires_grad_() for t in (x["q"], x["k"], x["v"], x["beta"])]
    gl = None if x["g"] is None else x["g"].clone().requires_grad_()
    h0l = h0.clone().requires_grad_()
    o, ht = delta_rule_kernels(*leaves, gl, h0l, K**-0.5, tuple(lengths), True)
    o_ref, ht_ref, hs_ref, us_ref = delta_forward_ref(q, k, v, beta, g, t_ref, tuple(lengths), scale=K**-0.5, chunk_size=C, initial_state=h0)
    assert rel_err(o.reshape(o_ref.shape), o_ref) <= 1e-5
    assert rel_err(ht, ht_ref) <= 1e-5
    grads = torch.autograd.grad((o * do.view_as(o)).sum() + (ht * dht).sum(), [*leaves, h0l])
    ref = delta_backward_ref(q, k, v, beta, g, t_ref, do, dht, hs_ref, us_ref, tuple(lengths), scale=K**-0.5, chunk_size=C)
    for name, got, want in zip(("dq", "dk", "dv", "dbeta", "dh0"), grads, (ref[0], ref[1], ref[2], ref[3], ref[5])):
        assert rel_err(got.reshape(want.shape), want) <= 1e-5, f"{name}: {rel_err(got.reshape(want.shape), want):.2e}"
    dss, mms, dv, _, _ = delta_score_grads(
        k, v, beta, g, do, us_ref.float(), ref[7].float(), scale=K**-0.5, chunks=chunks, chunk_size=C, block_v=32,
        fp32_dot=0, num_warps=4,
    )
    for name, got, want in zip(("dS", "M + M^T", "dv"), (dss, mms, dv), (ref[8], ref[9], ref[2])):
        assert rel_err(got, want) <= 1e-5, f"{name}: {rel_err(got, want):.2e}"


@pytest.mark.parametrize("decay", [False, True], ids=["nodecay", "decay"])
def test_triton_step_matches_reference(decay):
    x = _inputs(B, 3, decay, seed=7)
    steps = [[None if x[n] is None else x[n][:, t] for n in ("q", "k", "v", "beta", "g")] for t in range(3)]
    assert_fused_steps(delta_rule_step_inplace, delta_rule_step, steps, _h0(B, 8))


@pytest.mark.parametrize("decay", [False, True], ids=["nodecay", "decay"])
def test_one_token_call_runs_the_step(decay):
    """T = 1 without gradients (decoding through the op) runs the fused step: same result as the
    chunk kernels, the caller's state untouched."""
    x = {n: None if t is None else t.float() for n, t in _inputs(B, 1, decay, seed=13).items()}
    assert_one_token_step(delta_rule_triton, list(x.values()), _h0(B, 14).float())


@pytest.mark.parametrize("fused", [True, False], ids=["fused-outputs", "output-kernel"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_forward_without_backward(dtype, fused):
    """Without gradients (nothing kept for a backward): the same o and final state as the path a
    backward follows, on packed sequences with states, the outputs formed in the recurrence or by the
    per-chunk kernel."""
    lengths = [1, 64, 37, 130] if not CUDA else [1, 64, 1000, 130]
    x = {n: None if t is None else t.to(dtype) for n, t in _inputs(1, sum(lengths), True, seed=21).items()}
    h0 = _h0(len(lengths), 22).float()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEVICE)
    kwargs = dict(scale=K**-0.5, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    with use_config(replace(get_config(), delta_fused_outputs=fused)):
        with torch.no_grad():
            o, ht = delta_rule_triton(*x.values(), **kwargs)
        leaves = [t.clone().requires_grad_() for t in x.values()]
        o_ref, ht_ref = delta_rule_triton(*leaves, **kwargs)
    rtol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: o rounded once on each path
    assert rel_err(o, o_ref) <= rtol, f"o: {rel_err(o, o_ref):.2e}"
    assert rel_err(ht, ht_ref) <= 1e-5, f"final state: {rel_err(ht, ht_ref):.2e}"


def test_backward_refuses_one_pipeline_stage():
    """`KernelConfig.num_stages = 1`: the forward runs; the backward is a ValueError, not a launch (at one stage
    its reverse walk reads shared memory out of bounds on an H100: wrong gradients or an illegal access)."""
    leaves = [t.float().clone().requires_grad_() for t in _inputs(1, 70, True, seed=23).values()]
    with use_config(replace(get_config(), num_stages=1)):
        o, _ = delta_rule_triton(*leaves, scale=K**-0.5)
        with pytest.raises(ValueError, match="num_stages"):
            o.sum().backward()


# both recurrences in segments of one chunk or more at these shapes, however many walks there are
SPLIT = dict(delta_split_per_sm=64, delta_split_fill=float("inf"), delta_split_backward=True, min_segment_chunks=1)


@pytest.mark.parametrize("decay", [False, True], ids=["nodecay", "decay"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_triton_segments(dtype, decay):
    """The recurrence cut into segments (`KernelConfig.delta_split_per_sm`): packed sequences with states, every
    gradient; a one-chunk sequence and one of three chunks beside longer ones."""
    lengths = [64, 150, 37, 300] if not CUDA else [64, 150, 1000, 2047]
    with use_config(replace(get_config(), **SPLIT)):
        assert_low_precision_matches(
            delta_rule_naive, delta_rule_chunk, delta_rule_triton, _inputs(1, sum(lengths), decay, seed=41),
            _h0(len(lengths), 42), dtype, lengths=lengths,
        )


def test_segment_states_match_twin():
    """Each segment's entering state (`entering_states`: the affine maps of the segments before it, chained)
    against the PyTorch twin's state entering that chunk, in fp32."""
    from polyattn.ops.delta.triton.forward import delta_forward_ref
    from polyattn.ops.delta.triton.function import entering_states, split_plan
    from polyattn.ops.delta.triton.wy import wy_solve
    from polyattn.ops.triton.plan import block, chunk_table

    lengths = [64, 256, 5, 450] if not CUDA else [64, 1500, 5, 2300]
    x = {n: t.float() for n, t in _inputs(1, sum(lengths), True, seed=43).items()}
    q, k, v, beta, g = (_flat(x[n]) for n in ("q", "k", "v", "beta", "g"))
    C = get_config().chunk_size
    chunks = chunk_table(tuple(lengths), C, k.device)
    t_inv, firsts = wy_solve(k, beta, g, chunk_size=C, chunks=chunks)
    h0 = _h0(len(lengths), 44).float()
    plan = split_plan(tuple(lengths), 4, C, str(k.device))
    assert plan["walks"].shape[0] == 1 + 4 + 1 + 4, "four segments where the chunks allow"
    got = entering_states(k, v, beta, g, t_inv, firsts, h0, plan, C=C, BV=min(32, block(V)), config=get_config())
    _, _, hs_ref, _ = delta_forward_ref(q, k, v, beta, g, t_inv, tuple(lengths), scale=K**-0.5, chunk_size=C, initial_state=h0)
    want = hs_ref[plan["walk_chunks"].long()]  # [S, H, K, V]
    assert rel_err(got, want) <= 1e-5, f"entering states: {rel_err(got, want):.2e}"


def test_split_policy():
    """The forward splits only while its walks fill at most `delta_split_fill` of the multiprocessors, the backward
    only with `delta_split_backward`; the segments aim at `delta_split_per_sm` walks per multiprocessor."""
    from polyattn.ops.delta.triton.function import split
    from polyattn.ops.triton.plan import KernelConfig, num_sms

    device = torch.device(DEVICE)
    sms, C = num_sms(device), 64
    long = (C * 64 * sms,)  # one sequence with chunks enough for any segment count below

    def segments(config, seq_lens, H, backward=False):
        plan = split(config, seq_lens, H, 32, 32, C, device, backward=backward)  # V = BV: one walk per head
        return 1 if plan is None else plan["walks"].shape[0] // len(seq_lens)

    config = KernelConfig(delta_split_per_sm=4, delta_split_fill=0.5)
    H = max(1, sms // 2)  # H walks: at most half the multiprocessors
    assert segments(config, long, H) == -(-4 * sms // H), "forward on a half-idle GPU: split to 4 walks per SM"
    assert segments(config, long, H, backward=True) == 1, "reverse recurrence: not without delta_split_backward"
    assert segments(replace(config, delta_split_backward=True), long, H, backward=True) > 1
    assert segments(config, long * 2, H) == 1, "two sequences' walks fill more than half: no split"
    assert segments(replace(config, delta_split_per_sm=0), long, H) == 1, "0 turns the split off"


def test_value_tile_policy():
    """An unsplit recurrence halves its value tile, down to 16, while its walks number at most
    `delta_narrow_per_sm` per multiprocessor."""
    from polyattn.ops.delta.triton.function import value_tile
    from polyattn.ops.triton.plan import KernelConfig, num_sms

    device = torch.device(DEVICE)
    sms, config = num_sms(device), KernelConfig(delta_block_v=64, delta_narrow_per_sm=1.0)
    assert value_tile(config, 1, sms, 128, device) == 64, "two walks per multiprocessor: the configured tile"
    assert value_tile(config, 1, sms, 64, device) == 32, "one walk per multiprocessor: halved once"
    assert value_tile(replace(config, delta_narrow_per_sm=sms), 1, 1, 128, device) == 16, "halved down to 16, no further"
    assert value_tile(config, 1, 1, 12, device) == 16, "V under the tile: its power of two"
    assert value_tile(replace(config, delta_narrow_per_sm=0), 1, 1, 128, device) == 64, "0 never narrows"


@pytest.mark.parametrize("narrow", [1.0, 0.0], ids=["narrowed", "configured"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_triton_value_tiles(dtype, narrow):
    """The walks at the configured value tile and at the narrowed one (`value_tile`: on the GPU the tests' few walks
    narrow it to 16; `delta_narrow_per_sm = 0` keeps the configured 32), every gradient through o and the final state."""
    with use_config(replace(get_config(), delta_narrow_per_sm=narrow)):
        assert_low_precision_matches(
            delta_rule_naive, delta_rule_chunk, delta_rule_triton, _inputs(1, 300, True, seed=45), _h0(1, 46), dtype,
        )


@pytest.mark.parametrize("split", [False, True], ids=["one-walk", "segments"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused-outputs", "output-kernel"])
@pytest.mark.parametrize("field", ["k", "v"])
def test_nonfinite_token_under_both_output_paths(field, fused, split):
    """A NaN key or value at one token (head 0, value column 0) leaves every earlier output bit-identical
    and reaches the outputs from that token on, whether the recurrence or the per-chunk kernel forms them,
    in one walk per sequence or in segments."""
    lengths, p = [40, 150], 40 + 100
    x = {n: t.float() for n, t in _inputs(1, sum(lengths), True, seed=31).items()}
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEVICE)
    with use_config(replace(get_config(), delta_fused_outputs=fused, **(SPLIT if split else {}))), torch.no_grad():
        clean = delta_rule_triton(*x.values(), scale=K**-0.5, cu_seqlens=cu)[0]
        x[field][:, p, 0, 0] = float("nan")
        o = delta_rule_triton(*x.values(), scale=K**-0.5, cu_seqlens=cu)[0]
    assert bool(torch.isfinite(clean).all())
    assert torch.equal(o[:, :p], clean[:, :p]), f"{field}=nan at {p} changed an earlier output"
    assert bool(torch.isnan(o[:, p, 0]).any()) and bool(torch.isnan(o[:, -1, 0]).any()), "the NaN never reached the outputs"
