"""Triton `kata(impl="triton_chunk")` (the chunked lifted-state form, forward) against the float64 naive spec.

The kernels are called directly (`kata_chunk_fused`), so that T = 1 runs them too and not the decoding step.

The bound per tensor is `polyattn.testing.assert_low_precision_matches`'s without gradients: at most twice the
error of the PyTorch `chunk` form on the same low-precision inputs (or one rounding floor), under a hard
ceiling, for o and the final state (S and z). On a CPU-only machine the kernels run under TRITON_INTERPRET=1
at tiny shapes with small tiles and state chunks (several chunks and sub-tiles per sequence); with CUDA at
real shapes and the default tiles. Each kernel stage is compared with its PyTorch twin.
"""
from __future__ import annotations

import functools
import importlib

import pytest
import torch

from polyattn import ops
from polyattn.ops.kata import kata_chunk, kata_naive, make_feature_map
from polyattn.ops.kata.state import join_state
from polyattn.ops.kata.triton.function import kata_chunk_fused
from polyattn.ops.kata.triton.chunk import chunk_lengths, kata_read_ref, kata_states_ref
from polyattn.ops.triton.plan import KernelConfig, chunk_table, segment_table, sequence_starts, use_config
from polyattn.testing import (
    assert_close_rel, assert_continuation, assert_low_precision_matches, dtype_id, kata_case_id, kata_gpu_cases,
    random_kata_state, seeded_inputs,
)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if CUDA:
    B, H, K, V = 2, 16, 64, 48
    T_GRID = [1, 63, 64, 65, 1000, 2100]
    CONFIG = KernelConfig(kata_chunk_size=256)  # several chunks at T = 1000
else:
    B, H, K, V = 2, 2, 16, 12  # K / groups: a power of two >= 4 for every variant
    T_GRID = [1, 63, 64, 65, 130]
    CONFIG = KernelConfig(kata_block_m=32, kata_block_n=16, kata_chunk_size=32)  # 2 sub-tiles a chunk, 5 chunks at T = 130
VARIANTS = [(1, "concat"), (2, "concat"), (4, "concat"), (2, "sum"), (4, "sum")]


def _state(N, groups, combine, seed):
    return random_kata_state(N, H, make_feature_map("psd", K, groups, combine).dim(), V, seed=seed, device=DEVICE)


def _check(T, dtype, groups, combine, decay, normalize, with_state, Bx=1, seed=0, lengths=None):
    N = Bx if lengths is None else len(lengths)
    h0 = _state(N, groups, combine, seed + 1) if with_state else None
    x = seeded_inputs(Bx, T if lengths is None else sum(lengths), H, K, V, decay=decay, seed=seed, device=DEVICE)
    x = {n: x[n] for n in ("q", "k", "v", "g")}
    opts = dict(groups=groups, combine=combine, normalize=normalize, eps=1e-6)
    forms = [functools.partial(f, **opts) for f in (kata_naive, kata_chunk, kata_chunk_fused)]  # the kernels, also at T = 1
    with use_config(CONFIG):
        assert_low_precision_matches(*forms, x, h0, dtype, lengths=lengths, backward=False)


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
    """o and the final state: each (groups, combine), with and without decay, normalized or not, with and
    without an initial state (read by the first chunk), over the T grid (a chunk boundary inside or not)."""
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
    """The state walk and the read against `kata_states_ref` / `kata_read_ref` on packed sequences from
    initial states, with a huge log-decay or a reset planted inside a sub-tile."""
    from polyattn.ops.kata.triton.chunk import kata_read_kernel, kata_states_kernel
    from polyattn.ops.kata.triton.function import feature_blocks
    from polyattn.ops.triton.precision import dot_f32

    lengths = (70, 5, 40)
    N_tok, N = sum(lengths), len(lengths)
    fmap = make_feature_map("psd", K, groups, combine)
    x = seeded_inputs(1, N_tok, H, K, V, decay=True, seed=3, device=DEVICE, dtype=torch.float32)
    q, k, v, g = (x[n][0].contiguous() for n in ("q", "k", "v", "g"))  # [N_tok, H, *]
    if decay is not None:
        g[37, 0] = decay
    h0 = join_state(_state(N, groups, combine, 5), torch.float32)  # [N, H, P, V + 1]
    with use_config(CONFIG) as config:
        CS, BS = config.kata_chunk_size, config.kata_block_n
        tiling = feature_blocks(K, V, groups, combine)
        P = tiling["P"]
        _, cu_chunks, NC = chunk_table(lengths, CS, DEVICE)
        hs, zs = torch.empty(NC, H, P, V, device=DEVICE), torch.empty(NC, H, P, device=DEVICE)
        ht, zt = torch.empty(N, H, P, V, device=DEVICE), torch.empty(N, H, P, device=DEVICE)
        meta = dict(G=groups, SUM=combine == "sum", BF=tiling["BF"], BV=tiling["BV"], USE_G=True, F32=dot_f32(q.dtype))
        sizes = (H, K, V, tiling["E"], P)
        kata_states_kernel[(tiling["slots"] * tiling["NE"], N, H)](
            k, v, g, h0[..., :-1].contiguous(), h0[..., -1].contiguous(), hs, zs, ht, zt,
            segment_table(lengths, 1, CS, DEVICE)[0], cu_chunks, *sizes, tiling["NE"], BE=tiling["BE"], BS=BS, SUB=CS // BS,
            USE_H0=True, STORE_HT=True, **meta)
        states, finals = kata_states_ref(k, v, g, h0, lengths, CS, fmap)
        assert_close_rel(hs, states[..., :-1], 1e-5, "chunk states S")
        assert_close_rel(zs, states[..., -1], 1e-5, "chunk states z")
        assert_close_rel(ht, finals[..., :-1], 1e-5, "final S")
        assert_close_rel(zt, finals[..., -1], 1e-5, "final z")
        pieces = chunk_lengths(lengths, CS)
        tiles, _, NT = chunk_table(pieces, BS, DEVICE)
        prior = torch.empty(N_tok, H, V + 1, device=DEVICE)
        kata_read_kernel[(NT, H)](q, g, hs, zs, prior, tiles, sequence_starts(pieces, DEVICE), 0.09, *sizes, BT=BS, **meta)
        assert_close_rel(prior, kata_read_ref(q, g, states, lengths, CS, fmap, 0.3), 1e-5, "prior")


def test_triton_chunk_refuses_gradients():
    x = seeded_inputs(1, 20, H, K, V, decay=True, device=DEVICE, dtype=torch.float32)
    q = x["q"].requires_grad_()
    with pytest.raises(NotImplementedError, match="without gradients"):
        ops.kata(q, x["k"], x["v"], x["g"], impl="triton_chunk")
    y = seeded_inputs(1, 20, H, 12, V, device=DEVICE, dtype=torch.float32)
    with pytest.raises(ValueError, match="power of two"):
        ops.kata(y["q"], y["k"], y["v"], groups=3, impl="triton_chunk")
    with pytest.raises(ValueError, match="power of two >= 4"):
        ops.kata(y["q"], y["k"], y["v"], groups=4, impl="triton_chunk")  # E = 3


def test_triton_takes_the_chunked_form_past_its_crossover(monkeypatch):
    """`impl="triton"` (and so `auto` on CUDA) runs a PSD call without gradients on the chunked form once the
    longest sequence reaches the crossover, the quadratic kernel below it and whenever a gradient is wanted."""
    kt = importlib.import_module("polyattn.ops.kata.triton")  # the package (`polyattn.ops.kata` is also the op's name)
    calls = []
    for name in ("kata_triton_chunk", "kata_triton_parallel"):
        form = getattr(kt, name)
        monkeypatch.setattr(kt, name, lambda *a, _f=form, _n=name, **kw: calls.append(_n) or _f(*a, **kw))
    x = seeded_inputs(1, 70, H, K, V, decay=True, seed=6, device=DEVICE, dtype=torch.float32)
    args = [x[n] for n in ("q", "k", "v", "g")]
    P = make_feature_map("psd", K, 2).dim()
    with use_config(KernelConfig(kata_block_m=32, kata_block_n=16, kata_chunk_size=32, kata_chunk_crossover=70 / (P + 1024))):
        with torch.no_grad():
            o_long, _ = ops.kata(*args, groups=2, impl="triton")
            o_short, _ = ops.kata(*(a[:, :69] for a in args), groups=2, impl="triton")
        o_grad, _ = ops.kata(args[0].requires_grad_(), *args[1:], groups=2, impl="triton")
    assert calls == ["kata_triton_chunk", "kata_triton_parallel", "kata_triton_parallel"]
    assert_close_rel(o_long, o_grad.detach(), 1e-5, "chunked against quadratic")
    assert_close_rel(o_short, o_grad.detach()[:, :69], 1e-5, "quadratic")
