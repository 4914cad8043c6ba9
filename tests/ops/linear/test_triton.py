"""Triton `linear_attn` against the float64 naive spec (ops/README.md, "Tests: a ladder of equivalences", rung 3).

The bound per tensor is `polyattn.testing.assert_low_precision_matches`'s: at most twice the
error of the PyTorch chunk form on the same low-precision inputs (or one rounding floor), and
always under a hard ceiling. Gradients flow through `o` and `final_state` (random cotangents for
both). On a CPU-only machine (CI) the kernels run under TRITON_INTERPRET=1 (set in
tests/conftest.py) at tiny shapes; with CUDA the same tests run at real shapes on the GPU.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from polyattn.ops.linear import linear_attn_chunk, linear_attn_naive
from polyattn.ops.linear.recurrent import linear_attn_step as linear_attn_step_reference
from polyattn.ops.linear.triton import linear_attn_step_inplace, linear_attn_triton
from polyattn.testing import assert_fused_steps, assert_low_precision_matches, assert_one_token_step, dtype_id, seeded_inputs

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if CUDA:
    B, H, K, V = 2, 16, 128, 96
    LONG_T, SPLIT_T = 1000, 2048
else:
    B, H, K, V = 2, 2, 8, 12
    LONG_T, SPLIT_T = 1000, 300
T_GRID = [1, 63, 64, 65, LONG_T]
DTYPES = [torch.float32, torch.bfloat16]


def _inputs(Bx, T, decay, seed=0):
    x = seeded_inputs(Bx, T, H, K, V, decay=decay, seed=seed, device=DEVICE)
    x.pop("beta")
    return x


@pytest.mark.parametrize("decay", [False, True], ids=["nodecay", "decay"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("T", T_GRID, ids=lambda t: f"T{t}")
def test_triton_matches_naive(T, dtype, decay):
    Bx = 1 if T == LONG_T else B
    h0 = torch.randn(Bx, H, K, V, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(DEVICE)
    assert_low_precision_matches(linear_attn_naive, linear_attn_chunk, linear_attn_triton, _inputs(Bx, T, decay), h0, dtype)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16], ids=dtype_id)
def test_triton_varlen(dtype):
    lengths = [1, 64, 37, 130] if not CUDA else [1, 64, 1000, 4095, 130]
    h0 = torch.randn(len(lengths), H, K, V, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(DEVICE)
    assert_low_precision_matches(
        linear_attn_naive, linear_attn_chunk, linear_attn_triton, _inputs(1, sum(lengths), decay=True, seed=4), h0, dtype, lengths=lengths
    )


@pytest.mark.parametrize("lengths", [None, "packed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
def test_triton_training_call(dtype, lengths):
    """A call without initial or final state, as training makes: the forward stores no final state, so its
    updates take the decayed values rounded (`KernelConfig.decay_update_dot`, the default); o and every
    gradient within the same bound."""
    lengths = [1, 64, 1000, 4095, 130] if lengths and CUDA else [1, 64, 37, 130] if lengths else None
    Bx, T = (1, sum(lengths)) if lengths else (B, LONG_T)
    assert_low_precision_matches(
        linear_attn_naive, linear_attn_chunk, linear_attn_triton, _inputs(Bx, T, decay=True, seed=7), None, dtype,
        lengths=lengths, final_state=False,
    )


def test_decay_update_dot_names():
    """`decay_update_dot` takes "rounded" or "split"; another name is a ValueError before any launch."""
    from polyattn.ops.triton.plan import KernelConfig, use_config

    x = _inputs(1, 65, decay=True)
    with use_config(KernelConfig(decay_update_dot="tf32")), pytest.raises(ValueError, match="decay_update_dot"):
        linear_attn_triton(*(t.to(torch.bfloat16) for t in x.values()), scale=0.1)


@pytest.mark.parametrize("layout", ["one", "two", "packed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_triton_segment_split(dtype, layout):
    """Sequences cut into segments combined by the scan, however many programs there are (`split_fill`): one
    sequence, two, and packed sequences of several lengths."""
    from polyattn.ops.triton.plan import KernelConfig, use_config

    fields = dict(chunk_size=16, block_c=16, min_segment_chunks=1) if not CUDA else {}
    lengths = [SPLIT_T // 3, 1, SPLIT_T // 2 + 5] if layout == "packed" else None
    Bx, T = (1, sum(lengths)) if lengths else (2 if layout == "two" else 1, SPLIT_T)
    h0 = torch.randn(len(lengths) if lengths else Bx, H, K, V, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(DEVICE)
    with use_config(KernelConfig(split_fill=float("inf"), **fields)):
        assert_low_precision_matches(
            linear_attn_naive, linear_attn_chunk, linear_attn_triton, _inputs(Bx, T, decay=True, seed=6), h0, dtype, lengths=lengths
        )


@pytest.mark.parametrize("decay", [False, True], ids=["nodecay", "decay"])
def test_segment_states_own_tile(decay):
    """The split's local-state kernel on its own value tile and warps (`states_block_c`, `states_warps`), wider than
    the other kernels' and past the values (masked columns): o and every gradient within the same bound."""
    from polyattn.ops.triton.plan import KernelConfig, use_config

    fields = dict(chunk_size=16, block_c=4, min_segment_chunks=1) if not CUDA else {}
    lengths = [SPLIT_T // 3, 1, SPLIT_T // 2 + 5]
    h0 = torch.randn(len(lengths), H, K, V, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(DEVICE)
    config = KernelConfig(split_fill=float("inf"), states_block_c=2 * V, states_warps=8, **fields)
    with use_config(config):
        assert_low_precision_matches(
            linear_attn_naive, linear_attn_chunk, linear_attn_triton, _inputs(1, sum(lengths), decay=decay, seed=6), h0,
            torch.bfloat16, lengths=lengths
        )


@pytest.mark.parametrize("field", ["k", "v"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
def test_low_precision_nonfinite_input_stays_causal(dtype, field, p=100):
    """bf16 and fp16 inputs: a NaN at token p (head 0) leaves every earlier output bit-identical and reaches the
    outputs from p on; the guarded rerun finds the row in the input dtype (`precision.first_nonfinite_row`)."""
    x = {n: t.to(dtype) for n, t in _inputs(1, 150, decay=True, seed=13).items()}
    o_clean, _ = linear_attn_triton(*x.values(), scale=0.1)
    x[field][:, p, 0] = float("nan")
    o, _ = linear_attn_triton(*x.values(), scale=0.1)
    assert torch.equal(o[:, :p], o_clean[:, :p]), f"{field}=nan at {p} changed an earlier output"
    assert not bool(torch.isfinite(o[:, p:, 0]).all()), f"{field}=nan at {p} never reached an output"


@pytest.mark.parametrize("split", [False, True], ids=["unsplit", "split"])
@pytest.mark.parametrize("DK", [128, 136])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_triton_state_in_two_tiles(dtype, DK, split):
    """Keys of 128 or more hold the pass's state as two row tiles (`launch.state_rows`), a and b loaded as
    two column halves; at 136 the second tile runs past the keys (masked rows). Packed sequences with an initial
    state, gradients through o and the final state, with and without the segment split (the entering state read
    from the scan in two tiles)."""
    from polyattn.ops.triton.plan import KernelConfig, use_config

    lengths = [70, 1, 130]
    x = seeded_inputs(1, sum(lengths), 1, DK, V, decay=True, seed=11, device=DEVICE)
    x.pop("beta")
    h0 = torch.randn(len(lengths), 1, DK, V, generator=torch.Generator().manual_seed(12), dtype=torch.float64).to(DEVICE)
    fields = dict(split_fill=float("inf"), chunk_size=16, block_c=16, min_segment_chunks=1) if split else {}
    with use_config(KernelConfig(**fields)):
        assert_low_precision_matches(linear_attn_naive, linear_attn_chunk, linear_attn_triton, x, h0, dtype, lengths=lengths)


@pytest.mark.parametrize("field", ["k", "v"])
def test_state_in_two_tiles_keeps_nonfinite_input_causal(field, p=100):
    """With the state in two tiles (keys of 128), a NaN at token p leaves every earlier output bit-identical and
    reaches the outputs from p on: the guarded rerun holds both tiles."""
    x = seeded_inputs(1, 150, 1, 128, V, decay=True, seed=13, device=DEVICE)
    x.pop("beta")
    x = {n: t.to(torch.bfloat16) for n, t in x.items()}
    o_clean, _ = linear_attn_triton(*x.values(), scale=0.1)
    x[field][:, p, 0] = float("nan")
    o, _ = linear_attn_triton(*x.values(), scale=0.1)
    assert torch.equal(o[:, :p], o_clean[:, :p])
    assert not bool(torch.isfinite(o[:, p:]).all())


def test_split_only_below_fill():
    """A pass splits its sequences only while its unsplit programs number at most `split_fill` per multiprocessor,
    and then aims at `programs_per_sm` of them."""
    from polyattn.ops.triton.plan import KernelConfig, num_sms, plan_segments

    device = torch.device(DEVICE)
    sms, config = num_sms(device), KernelConfig(programs_per_sm=4, split_fill=1.0, min_segment_chunks=1)
    long = (config.chunk_size * 8 * sms,)  # chunks enough for any segment count below

    def segments(N, H):  # value tiles of 64 at DC = 64: N * H programs unsplit
        return plan_segments(long * N, H, 64, config, device)

    assert segments(1, sms) == 4, "one program per multiprocessor: four segments"
    assert segments(1, sms + 1) == 1, "more programs than multiprocessors: no split"
    assert segments(2, sms // 2) == 4
    assert plan_segments(long, sms + 1, 64, replace(config, split_fill=2.0), device) == -(-4 * sms // (sms + 1))
    assert plan_segments(long, sms, 64, replace(config, programs_per_sm=1), device) == 1, "the target already met"


@pytest.mark.parametrize("scratch", ["zeros", "nan"])
@pytest.mark.parametrize("where", ["middle", "last"], ids=["middle-segment", "last-segment"])
@pytest.mark.parametrize("field, value", [("k", "nan"), ("v", "inf"), ("g", "nan")])
def test_segment_split_keeps_nonfinite_input_causal(field, value, where, scratch, monkeypatch):
    """With the segment split (the scan flags the segment that holds the token, the rerun takes it
    alone), a NaN or Inf in a key, value or log-decay leaves every earlier output bit-identical and
    reaches the outputs from it on; the segments after it are not rerun and are NaN by their state.
    The flags must not depend on what the pass's scratch memory held before (every fresh buffer filled
    with zeros, then with NaN): the last segment's local state is computed for them, not read unwritten."""
    from polyattn.ops.triton.plan import KernelConfig, plan_segments, use_config

    empty = torch.empty
    fill = 0.0 if scratch == "zeros" else float("nan")
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: (x := empty(*a, **kw)).fill_(fill if x.is_floating_point() else 0))

    config = KernelConfig(chunk_size=16, block_c=16, min_segment_chunks=1) if not CUDA else KernelConfig()
    x = {n: t.float() for n, t in _inputs(1, SPLIT_T, decay=True, seed=15).items()}
    position = SPLIT_T // 2 + 3 if where == "middle" else SPLIT_T - 5  # the last: inside the last segment's last chunk
    with use_config(config):
        assert plan_segments((SPLIT_T,), H, V, config, torch.device(DEVICE)) > 2
        clean, _ = linear_attn_triton(x["q"], x["k"], x["v"], x["g"], scale=0.5)
        x[field][:, position, 0] = float(value)
        o, _ = linear_attn_triton(x["q"], x["k"], x["v"], x["g"], scale=0.5)
    assert torch.equal(o[:, :position], clean[:, :position]), f"{field}={value} changed an earlier output"
    assert not bool(torch.isfinite(o[:, position:, 0]).all()), f"{field}={value} never reached an output"
    assert not bool(torch.isfinite(o[:, -1, 0]).all()), "the last segment did not see the non-finite state"


@pytest.mark.parametrize("decay", [False, True], ids=["nodecay", "decay"])
def test_triton_step_matches_reference(decay):
    x = _inputs(B, 3, decay, seed=7)
    steps = [[None if x[n] is None else x[n][:, t] for n in ("q", "k", "v", "g")] for t in range(3)]
    assert_fused_steps(linear_attn_step_inplace, linear_attn_step_reference, steps, torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(8), dtype=torch.float64).to(DEVICE))


@pytest.mark.parametrize("decay", [False, True], ids=["nodecay", "decay"])
def test_one_token_call_runs_the_step(decay):
    """T = 1 without gradients (decoding through the op) runs the fused step: same result as the
    chunk kernels, the caller's state untouched."""
    x = {n: None if t is None else t.float() for n, t in _inputs(B, 1, decay, seed=13).items()}
    assert_one_token_step(linear_attn_triton, list(x.values()), torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(14)).to(DEVICE))
