"""Triton `loglinear_attn` (Mamba-2 base) against the float64 naive spec (ops/README.md, "Tests: a ladder
of equivalences", rung 3).

The bound per tensor is `polyattn.testing.assert_low_precision_matches`'s: at most twice the error of
the PyTorch chunk form on the same low-precision inputs (or one rounding floor), and always under a
hard ceiling, for o, the final state's levels and the gradients of q, k, v, lam, g and the initial
levels (random cotangents for o and the final state). Initial states are real states at their
position (naive on a random prefix); the references read only the levels such a state can occupy
(`occupied_levels`), as the Triton form does. On a CPU-only machine (CI) the kernels run under
TRITON_INTERPRET=1 at tiny shapes with chunks of 16 tokens (so 65 tokens cross three chunk-levels);
with CUDA the same tests run at real shapes with the default chunks of 64.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from polyattn import ops
from polyattn.ops.common import num_levels
from polyattn.ops.loglinear import LogLinearState, loglinear_attn_chunk, loglinear_attn_naive
from polyattn.ops.loglinear.triton import loglinear_attn_triton
from polyattn.ops.triton.plan import KernelConfig, get_config, use_config
from polyattn.testing import (
    assert_close_rel, assert_low_precision_matches, dtype_id, loglinear_occupied_only, loglinear_prefix_state, rel_err,
    seeded_inputs,
)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if CUDA:
    B, H, K, V = 2, 16, 128, 96
    LONG_T = 4096
    CONFIG = get_config()
    # these few sequences x heads narrow the level pass's value tiles (run at num_warps); "wide" keeps 64 columns
    # at level_wide_warps, as the benchmark's many sequences do
    TILES = {"narrowed": CONFIG, "wide": dataclasses.replace(CONFIG, level_programs_per_sm=0)}
    SPLIT_T, SPLITS = 300, [63, 64, 65, 129]
else:
    B, H, K, V = 2, 2, 8, 12
    LONG_T = 1000
    CONFIG = KernelConfig(chunk_size=16, block_c=16)
    TILES = {"interpreter": CONFIG}
    SPLIT_T, SPLITS = 50, [15, 16, 17, 33]  # around the chunk size 2^k, and past two chunks
DTYPES = [torch.float32, torch.bfloat16]


def _inputs(Bx, T, decay=True, seed=0, L=None):
    x = seeded_inputs(Bx, T, H, K, V, decay=decay, seed=seed, device=DEVICE)
    x.pop("beta")
    L = L or num_levels(T + 200) + 1  # room for a state up to position 200, plus an unused column
    lam = torch.rand(Bx, T, H, L, generator=torch.Generator().manual_seed(seed + 100), dtype=torch.float64) + 0.5
    g = x.pop("g")
    return {**x, "lam": lam.to(DEVICE), "g": g}


def _state(positions, L, seed=1):
    """A state reached by the naive form after a random prefix, per sequence at its own position."""
    return loglinear_prefix_state(lambda P, s, L: _inputs(1, P, seed=s, L=L), positions, L, (H, K, V), device=DEVICE, seed=seed)


NAIVE, CHUNK = loglinear_occupied_only(loglinear_attn_naive), loglinear_occupied_only(loglinear_attn_chunk)


def _triton_with(config):
    def run(*tensors, **kwargs):
        with use_config(config):
            return loglinear_attn_triton(*tensors, **kwargs)

    run.native_varlen = True
    return run


_triton = _triton_with(CONFIG)


def _check(x, state, dtype, lengths=None, config=CONFIG):
    assert_low_precision_matches(NAIVE, CHUNK, _triton_with(config), x, state, dtype, lengths=lengths)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("T", [1, 63, 64, 65], ids=lambda t: f"T{t}")
def test_triton_matches_naive(T, dtype):
    x = _inputs(B, T)
    _check(x, _state([0] * B, x["lam"].shape[-1]), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_triton_without_decay(dtype):
    x = _inputs(B, 65, decay=False, seed=2)
    _check(x, _state([0, 17], x["lam"].shape[-1], seed=3), dtype)


@pytest.mark.parametrize("tiles", list(TILES))
def test_triton_long_sequence(tiles):
    """Many chunks and chunk-levels, from a state off the chunk grid."""
    x = _inputs(1, LONG_T, seed=4)
    with use_config(TILES[tiles] if CUDA else KernelConfig()):  # the interpreter affords 1000 tokens in chunks of 64
        assert_low_precision_matches(NAIVE, CHUNK, loglinear_attn_triton, x, _state([33], x["lam"].shape[-1], seed=5), torch.bfloat16)


@pytest.mark.parametrize("tiles", list(TILES))
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16], ids=dtype_id)
def test_triton_varlen_from_states_at_odd_positions(dtype, tiles):
    """Packed sequences, each continuing a state at its own position: 2^k - 1, 2^k, 2^k + 1 around a
    chunk boundary (16) and inside a chunk (7, 9), and a fresh one."""
    lengths = [1, 64, 37, 20, 50, 3] if not CUDA else [1, 64, 1000, 37, 4095, 130]
    positions = [15, 16, 17, 0, 7, 9] if not CUDA else [63, 64, 65, 0, 127, 129]
    x = _inputs(1, sum(lengths), seed=6)
    _check(x, _state(positions, x["lam"].shape[-1], seed=7), dtype, lengths=lengths, config=TILES[tiles])


@pytest.mark.parametrize("lengths", [None, "packed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
def test_triton_training_call(dtype, lengths):
    """A call without initial or final state, as training makes: the forward's level adds take their decayed values
    rounded (`KernelConfig.decay_update_dot`, the default); o and every gradient within the same bound."""
    lengths = ([1, 64, 1000, 37, 4095, 130] if CUDA else [1, 64, 37, 20, 50, 3]) if lengths else None
    # 2 x 2,048 tokens on the GPU: at 2 x 4,096 each [B, H, T, T] float64 tensor of the spec is 4.3 GB, and the file's
    # workers ran out of memory beside each other
    Bx, T = (1, sum(lengths)) if lengths else (B, LONG_T // 2 if CUDA else 200)
    assert_low_precision_matches(NAIVE, CHUNK, _triton, _inputs(Bx, T, seed=12), None, dtype, lengths=lengths, final_state=False)


def test_training_forward_modes():
    """`decay_update_dot` reaches the forward without a final state: "split" and "rounded" give different bf16
    outputs (both finite), a final state asked for gives the split's, and another name is a ValueError."""
    x = {n: t.to(torch.bfloat16) if n in ("q", "k", "v") else t.float() for n, t in _inputs(1, 150, seed=13).items()}
    runs = {}
    for mode in ("split", "rounded"):
        with use_config(dataclasses.replace(CONFIG, decay_update_dot=mode)):
            runs[mode] = loglinear_attn_triton(**x, scale=0.3)[0]
    with use_config(dataclasses.replace(CONFIG, decay_update_dot="rounded")):
        with_state = loglinear_attn_triton(**x, scale=0.3, output_final_state=True)[0]
    assert all(torch.isfinite(o).all() for o in runs.values())
    assert not torch.equal(runs["split"], runs["rounded"])
    assert torch.equal(with_state, runs["split"])
    with use_config(dataclasses.replace(CONFIG, decay_update_dot="tf32")), pytest.raises(ValueError, match="decay_update_dot"):
        loglinear_attn_triton(**x, scale=0.3)


def test_triton_reset_gates():
    """A very negative log-decay empties every level (the chunk decay takes its exact path)."""
    x = _inputs(B, 65, seed=8)
    x["g"][:, 20] = -1e4
    x["g"][:, 41] = -float("inf")
    _check(x, _state([0, 5], x["lam"].shape[-1], seed=9), torch.float32)


@pytest.mark.parametrize("split", SPLITS)
def test_triton_continues_exactly(split):
    """Prefill then continue from the final state: the same outputs and final state as one call."""
    x = {n: t.float() for n, t in _inputs(1, SPLIT_T, seed=10).items()}
    o, s = _triton(**x, scale=0.5, output_final_state=True)
    first = {n: t[:, :split] for n, t in x.items()}
    second = {n: t[:, split:] for n, t in x.items()}
    o1, s1 = _triton(**first, scale=0.5, output_final_state=True)
    o2, s2 = _triton(**second, scale=0.5, initial_state=s1, output_final_state=True)
    assert torch.equal(s2.position, s.position)
    assert_close_rel(torch.cat([o1, o2], 1), o, 1e-5, "output")
    assert_close_rel(s2.levels, s.levels, 1e-5, "final state")


# (DA, DC) of the level passes' twin test: tiles that overhang the states (masked state loads and stores) or cover
# them exactly; the interpreter's value tiles are 16 wide (ragged: three of them, the last partial)
TWIN_SHAPES = {"ragged": (120, 100), "even": (128, 96)} if CUDA else {"ragged": (8, 40), "even": (16, 32)}


@pytest.mark.parametrize(("reverse", "deterministic"), [(False, False), (True, False), (True, True)],
                         ids=["causal", "anticausal", "anticausal-deterministic"])
@pytest.mark.parametrize("with_state", [False, True], ids=["fresh", "state"])
@pytest.mark.parametrize("shape", TWIN_SHAPES)
def test_level_pass_matches_its_twin(reverse, deterministic, with_state, shape):
    """The causal pass (with its row dots and per-level dlam: `sum_l lam * dlam` is the row dot), and the anticausal
    pair (its second pass on the transposed states, summed over value tiles: added atomically, or under
    `torch.use_deterministic_algorithms` stored per tile and summed after, the same bits on a second run), against
    their float64 twins."""
    from polyattn.ops.loglinear.triton.level_pass import anticausal_pair, anticausal_pair_ref, level_pass, level_pass_ref

    gen = torch.Generator().manual_seed(11)
    lengths, positions = (50, 1, 70), [0, 5, 37]
    N_tok, L = sum(lengths), 10
    K, DC = TWIN_SHAPES[shape]
    C = CONFIG.chunk_size
    NLC = max(L - C.bit_length(), 1)
    a, b = (torch.randn(N_tok, H, K, generator=gen).to(DEVICE) for _ in range(2))
    c, a2 = (torch.randn(N_tok, H, DC, generator=gen).to(DEVICE) for _ in range(2))
    g = (-0.3 * torch.rand(N_tok, H, generator=gen)).to(DEVICE)
    lam = torch.rand(N_tok, H, L, generator=gen).to(DEVICE)
    h0 = torch.randn(len(lengths), H, NLC, K, DC, generator=gen).to(DEVICE) if with_state else None
    position = torch.tensor(positions, device=DEVICE)
    kw = dict(scale=0.5, initial_state=h0)
    if reverse:
        was = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(deterministic)
        try:
            with use_config(CONFIG):
                out, out2, state, rowdot = anticausal_pair(a, b, c, a2, g, lam, position, lengths, dot_x=a, **kw)
                if deterministic:
                    again = anticausal_pair(a, b, c, a2, g, lam, position, lengths, dot_x=a, **kw)[1]
                    assert torch.equal(out2, again), "out2 differs between two runs under deterministic algorithms"
        finally:
            torch.use_deterministic_algorithms(was)
        out_ref, out2_ref, state_ref = anticausal_pair_ref(a, b, c, a2, g, lam, position, lengths, chunk_size=C, **kw)
        assert rel_err(out2, out2_ref) <= 1e-5, f"out2: {rel_err(out2, out2_ref):.2e}"
        rowdot_ref = (a.double() * out2_ref).sum(-1)  # [N_tok, H]
        assert rel_err(rowdot, rowdot_ref) <= 1e-5, f"rowdot: {rel_err(rowdot, rowdot_ref):.2e}"
    else:
        with use_config(CONFIG):
            out, state, rowdot, dlam = level_pass(a, b, c, g, lam, position, lengths, dot_x=a2, want_dlam=True, **kw)
        out_ref, state_ref = level_pass_ref(a, b, c, g, lam, position, lengths, reverse=False, chunk_size=C, **kw)
        rowdot_ref = (a2.double() * out_ref).sum(-1)  # [N_tok, H]
        assert rel_err(rowdot, rowdot_ref) <= 1e-5, f"rowdot: {rel_err(rowdot, rowdot_ref):.2e}"
        lam_dlam = (lam.double() * dlam).sum(-1)  # [N_tok, H]
        assert rel_err(lam_dlam, rowdot_ref) <= 1e-5, f"sum(lam * dlam): {rel_err(lam_dlam, rowdot_ref):.2e}"
    assert rel_err(out, out_ref) <= 1e-5, f"out: {rel_err(out, out_ref):.2e}"
    assert rel_err(state, state_ref) <= 1e-5, f"state: {rel_err(state, state_ref):.2e}"


def test_triton_rejects_what_it_lacks():
    x = {n: t.float() for n, t in _inputs(1, 8).items()}
    with pytest.raises(ValueError, match="bf16/fp16/fp32"):
        ops.loglinear_attn(**{n: t.double() for n, t in x.items()}, impl="triton")
    with pytest.raises(ValueError, match="num_levels"):
        ops.loglinear_attn(**{**x, "lam": x["lam"][..., :3]}, impl="triton")


@pytest.mark.parametrize("base", ["mamba2", "gdn"])
def test_decoding_step_matches_the_recurrent_form(base):
    """The fused step, token for token, against `loglinear_attn_step` for a batch whose sequences sit at
    their own positions (fresh, 2^k - 1, 2^k, 2^k + 1), through the op (one token, no gradients), for
    both bases (Gated DeltaNet: unit keys, the delta rule on every level)."""
    from polyattn.ops.loglinear import loglinear_attn_step

    positions = [0, 1, 7, 8, 15, 16]
    L = num_levels(16 + 5) + 1
    state = _state(positions, L, seed=12)
    x = {n: t.float() for n, t in _inputs(len(positions), 5, seed=13, L=L).items()}
    beta = None
    if base == "gdn":
        x["k"] = torch.nn.functional.normalize(x["k"], dim=-1)
        beta = torch.rand(len(positions), 5, H, generator=torch.Generator().manual_seed(14)).to(DEVICE)
    fused = LogLinearState(state.levels.float(), state.position)
    reference = state
    for t in range(5):
        token = {n: x[n][:, t : t + 1] for n in ("q", "k", "v", "lam", "g")}
        b_t = None if beta is None else beta[:, t : t + 1]
        with torch.no_grad():
            o, fused = loglinear_attn_triton(**token, beta=b_t, scale=0.5, initial_state=fused, output_final_state=True)
        o_ref, reference = loglinear_attn_step(*(token[n][:, 0].double() for n in ("q", "k", "v", "lam", "g")),
                                               None if b_t is None else b_t[:, 0].double(), reference, scale=0.5)
        assert torch.equal(fused.position, reference.position)
        assert rel_err(o[:, 0], o_ref) <= 1e-5, f"step {t}: o rel err {rel_err(o[:, 0], o_ref):.2e}"
        assert rel_err(fused.levels, reference.levels) <= 1e-5, f"step {t}: state rel err {rel_err(fused.levels, reference.levels):.2e}"


@pytest.mark.parametrize("base", ["mamba2", "gdn"])
def test_decoding_step_touches_only_the_levels_it_changes(base):
    """A level that holds no keys at a sequence's position is neither read nor written by the fused step
    (only the carry's target is filled): with NaN planted in every such level the outputs and the touched
    levels equal those of the zero-filled state, and the NaN stays where it was, outside the target."""
    from polyattn.ops.loglinear.state import occupied_levels
    from polyattn.ops.loglinear.triton.step import loglinear_attn_step_inplace

    positions = [1, 6, 8, 11, 16]
    L = num_levels(16 + 1) + 2
    state = _state(positions, L, seed=21)
    x = {n: t.float()[:, 0] for n, t in _inputs(len(positions), 1, seed=22, L=L).items()}
    x["k"] = torch.nn.functional.normalize(x["k"], dim=-1)
    beta = torch.rand(len(positions), H, generator=torch.Generator().manual_seed(23)).to(DEVICE) if base == "gdn" else None
    position = state.position
    empty = ~occupied_levels(position, L)  # [N, L]
    target = torch.zeros_like(empty)
    target[torch.arange(len(positions)), (position & -position).log2().long() + 1] = True  # level ctz(t) + 1
    clean = state.levels.float().contiguous()
    planted = clean.clone()
    planted[empty[:, None, :, None, None].expand_as(planted)] = float("nan")
    o_clean, after_clean = loglinear_attn_step_inplace(x["q"], x["k"], x["v"], x["lam"], x["g"], clean, position, scale=0.5, beta=beta)
    o, after = loglinear_attn_step_inplace(x["q"], x["k"], x["v"], x["lam"], x["g"], planted, position, scale=0.5, beta=beta)
    assert torch.equal(o, o_clean)
    touched = (~empty | target)[:, None, :, None, None].expand_as(after)
    assert torch.equal(after[touched], after_clean[touched])
    assert bool(after[~touched].isnan().all())


def test_auto_offers_the_kernels_for_both_bases(monkeypatch):
    """`impl="auto"` offers the Triton form to the dispatcher (it picks it for CUDA inputs) for both bases,
    with gradients and without (the Gated DeltaNet base's backward passed at real shapes on the H200)."""
    import polyattn.ops.loglinear as loglinear

    offered = []
    resolve = loglinear.resolve_impl
    monkeypatch.setattr(loglinear, "resolve_impl", lambda name, impl, forms, q: offered.append(set(forms)) or resolve(name, impl, forms, q))
    x = {n: t.float() for n, t in _inputs(1, 8).items()}
    beta = torch.rand(1, 8, H, device=DEVICE)
    ops.loglinear_attn(**x, impl="auto")
    ops.loglinear_attn(**x, beta=beta, impl="auto")
    ops.loglinear_attn(**x, beta=beta.requires_grad_(), impl="auto")
    with torch.no_grad():
        ops.loglinear_attn(**x, beta=beta, impl="auto")
    assert len(offered) == 4 and all({"triton", "chunk"} <= forms for forms in offered)
