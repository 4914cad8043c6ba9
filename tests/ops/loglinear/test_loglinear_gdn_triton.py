"""Triton `loglinear_attn` over Gated DeltaNet (`beta` given; the forward, without gradients) against
the float64 naive spec (ops/README.md, "Tests: a ladder of equivalences", rung 3).

The bound per tensor is `polyattn.testing.assert_low_precision_matches`'s (`backward=False`): at most
twice the error of the PyTorch chunk form on the same low-precision inputs (or one rounding floor), and
always under a hard ceiling, for o and the final state's levels. Keys are unit vectors (the delta rule's
contractive regime). Initial states are real states at their position (naive on a random prefix); the
references read only the levels such a state can occupy, as the Triton form does. The delta rule's WY
stage fixes the chunk at 64 tokens, so on a CPU-only machine (CI, TRITON_INTERPRET=1) 300 tokens cross
three chunk-levels; with CUDA the same tests run at real shapes.
"""
from __future__ import annotations

import pytest
import torch

from polyattn import ops
from polyattn.ops.common import num_levels
from polyattn.ops.loglinear import loglinear_attn_chunk, loglinear_attn_naive
from polyattn.ops.loglinear.triton import loglinear_attn_triton
from polyattn.testing import (
    assert_close_rel, assert_low_precision_matches, dtype_id, loglinear_occupied_only, loglinear_prefix_state, rel_err,
    seeded_inputs,
)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
B, H, K, V = (2, 16, 128, 96) if CUDA else (2, 2, 8, 12)
LONG_T = 4096 if CUDA else 300
DTYPES = [torch.float32, torch.bfloat16]


def _inputs(Bx, T, decay=True, seed=0, L=None):
    x = seeded_inputs(Bx, T, H, K, V, decay=decay, beta=True, seed=seed, device=DEVICE)
    x["k"] = torch.nn.functional.normalize(x["k"], dim=-1)
    L = L or num_levels(T + 200) + 1  # room for a state up to position 200, plus an unused column
    lam = torch.rand(Bx, T, H, L, generator=torch.Generator().manual_seed(seed + 100), dtype=torch.float64) + 0.5
    return {"q": x["q"], "k": x["k"], "v": x["v"], "lam": lam.to(DEVICE), "g": x["g"], "beta": x["beta"]}


def _state(positions, L, seed=1):
    """A state reached by the naive form after a random prefix, per sequence at its own position."""
    return loglinear_prefix_state(lambda P, s, L: _inputs(1, P, seed=s, L=L), positions, L, (H, K, V), device=DEVICE, seed=seed)


def _gdn(form):
    """`form` with beta passed by name (the positional order of `low_precision_errors` is the dict's)."""

    def run(q, k, v, lam, g, beta, **kwargs):
        return form(q, k, v, lam, g, beta=beta, **kwargs)

    run.native_varlen = getattr(form, "native_varlen", False)
    return run


NAIVE, CHUNK = _gdn(loglinear_occupied_only(loglinear_attn_naive)), _gdn(loglinear_occupied_only(loglinear_attn_chunk))
TRITON = _gdn(loglinear_attn_triton)


def _check(x, dtype, lengths=None, state=None):
    assert_low_precision_matches(NAIVE, CHUNK, TRITON, x, state, dtype, lengths=lengths, backward=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("T", [1, 63, 64, 65, 300], ids=lambda t: f"T{t}")
def test_gdn_triton_matches_naive(T, dtype):
    _check(_inputs(B, T), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_gdn_triton_without_decay(dtype):
    _check(_inputs(B, 200, decay=False, seed=2), dtype)


def test_gdn_triton_long_sequence():
    """Many chunks and chunk-levels in bf16."""
    _check(_inputs(1, LONG_T, seed=4), torch.bfloat16)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16], ids=dtype_id)
def test_gdn_triton_varlen(dtype):
    """Packed sequences of lengths around the chunk size and across several chunk-levels."""
    lengths = [1, 64, 130, 20, 200, 65] if not CUDA else [1, 64, 1000, 37, 4095, 130]
    _check(_inputs(1, sum(lengths), seed=6), dtype, lengths=lengths)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_gdn_triton_from_states_at_odd_positions(dtype):
    """Packed sequences, each continuing a state at its own position: 2^k - 1, 2^k, 2^k + 1 around the
    chunk boundary (64) and inside a chunk (7, 129), and a fresh one; some stay in their first chunk,
    some leave it."""
    lengths = [1, 64, 80, 20, 70, 3] if not CUDA else [1, 64, 1000, 37, 4095, 130]
    positions = [63, 64, 65, 0, 7, 129]
    x = _inputs(1, sum(lengths), seed=12)
    _check(x, dtype, lengths=lengths, state=_state(positions, x["lam"].shape[-1], seed=13))


def test_gdn_triton_reset_gates():
    """A very negative log-decay and a reset (-inf) inside and at the start of a chunk."""
    x = _inputs(B, 200, seed=8)
    x["g"][:, 20] = -1e4
    x["g"][:, 64] = -float("inf")
    x["g"][:, 150] = -float("inf")
    _check(x, torch.float32)


def test_gdn_kernels_match_their_twin():
    """`gdn_chunk_kernel` and `gdn_levels_kernel` against `gdn_forward_ref` (float64) on the same WY
    factors: the outputs and every chunk-level's leaving state, packed sequences."""
    from polyattn.ops.loglinear.triton.gdn import gdn_forward, gdn_forward_ref

    lengths, positions = (300, 1, 130), [0, 5, 70]
    x = {n: t.float().reshape(sum(lengths), *t.shape[2:]).contiguous() for n, t in _inputs(1, sum(lengths), seed=9).items()}
    NLC = x["lam"].shape[-1] - 7
    r0 = torch.randn(len(lengths), H, NLC, K, V, generator=torch.Generator().manual_seed(10)).to(DEVICE)
    position = torch.tensor(positions, device=DEVICE)
    o, R, t_inv, w, _ = gdn_forward(x["q"], x["k"], x["v"], x["g"], x["beta"], x["lam"], lengths, position, scale=0.5, r0=r0)
    u_bar = _pseudo_values(x, lengths, position, t_inv)
    o_ref, R_ref = gdn_forward_ref(x["q"], x["k"], x["v"], x["g"], x["beta"], x["lam"], w, u_bar, t_inv, lengths, positions,
                                   scale=0.5, chunk_size=64, r0=r0)
    assert rel_err(o, o_ref) <= 1e-5, f"o: {rel_err(o, o_ref):.2e}"
    assert rel_err(R, R_ref) <= 1e-5, f"states: {rel_err(R, R_ref):.2e}"


def _pseudo_values(x, lengths, position, t_inv):
    """Ū of the WY stage on the grid's chunks (the twin's input)."""
    from polyattn.ops.delta.triton.wy import wy_factors, wy_solve
    from polyattn.ops.triton.plan import grid_chunk_table

    chunks = grid_chunk_table(lengths, position, 64)
    _, firsts = wy_solve(x["k"], x["beta"], x["g"], chunk_size=64, chunks=chunks)
    return wy_factors(x["k"], x["v"], x["beta"], x["g"], t_inv, firsts, chunks=chunks)[1]


@pytest.mark.parametrize("split", [63, 64, 65, 129])
@pytest.mark.parametrize("then", ["triton", "chunk"])
def test_gdn_triton_prefill_then_continue(split, then):
    """A Triton prefill's final state continued by the Triton form or the chunk form, and by the fused
    decoding step, gives the outputs and final state of one call."""
    x = {n: t.float() for n, t in _inputs(1, 200, seed=10).items()}
    L = x["lam"].shape[-1]
    with torch.no_grad():
        o, s = ops.loglinear_attn(**x, scale=0.5, output_final_state=True, impl="chunk")
        first = {n: t[:, :split] for n, t in x.items()}
        o1, s1 = ops.loglinear_attn(**first, scale=0.5, output_final_state=True, impl="triton")
        assert s1.levels.shape[2] == L
        second = {n: t[:, split:] for n, t in x.items()}
        o2, s2 = ops.loglinear_attn(**second, scale=0.5, initial_state=s1, output_final_state=True, impl=then)
        assert torch.equal(s2.position, s.position)
        assert_close_rel(torch.cat([o1, o2], 1), o, 1e-5, "output")
        assert_close_rel(s2.levels, s.levels, 1e-5, "final state")
        step = {n: t[:, split : split + 1] for n, t in x.items()}
        o3, s3 = ops.loglinear_attn(**step, scale=0.5, initial_state=s1, output_final_state=True, impl="triton")
        _, s_ref = ops.loglinear_attn(**{n: t[:, : split + 1] for n, t in x.items()}, scale=0.5, output_final_state=True, impl="chunk")
        assert_close_rel(o3[:, 0], o[:, split], 1e-5, "decoded output")
        assert_close_rel(s3.levels, s_ref.levels, 1e-5, "decoded state")


def test_gdn_triton_rejects_what_it_lacks():
    x = {n: t.float() for n, t in _inputs(1, 70).items()}
    with pytest.raises(ValueError, match="without gradients"):
        ops.loglinear_attn(**{**x, "q": x["q"].clone().requires_grad_()}, impl="triton")
