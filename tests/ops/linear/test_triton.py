"""Triton `linear_attn` against the float64 naive spec (ops/README.md, "Tests: a ladder of equivalences", rung 3).

Error bound per tensor: `rel_err(triton) <= max(2 * rel_err(chunk), FLOOR[dtype])`, where
`chunk` is the PyTorch chunk form run on the same low-precision inputs, and always under a hard
ceiling. The floors are rounding noise: one bf16 ulp (the chunk form rounds once, at the end,
so its own error can sit anywhere under that), and for fp32 ~40 ulps, which varies case to case
by more than 2x (exp of a rounded log-decay sum), yet stays 60x under a tf32 product's error. Gradients flow through `o` and `final_state` (random cotangents for both).
On a CPU-only machine (CI) the kernels run under TRITON_INTERPRET=1 (set in tests/conftest.py)
at tiny shapes; with CUDA the same tests run at real shapes on the GPU.
"""
from __future__ import annotations

import pytest
import torch

from polyattn.ops.linear import linear_attn_chunk, linear_attn_naive
from polyattn.ops.linear.recurrent import linear_attn_step as linear_attn_step_reference
from polyattn.ops.linear.triton import linear_attn_step, linear_attn_triton
from polyattn.testing import rel_err, seeded_inputs

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
FLOOR = {torch.float32: 5e-6, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
CEILING = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}

if CUDA:
    B, H, K, V = 2, 16, 128, 96
    LONG_T, SPLIT_T = 1000, 4096
else:
    B, H, K, V = 2, 2, 8, 12
    LONG_T, SPLIT_T = 1000, 300
T_GRID = [1, 63, 64, 65, LONG_T]
DTYPES = [torch.float32, torch.bfloat16]


def _dtype_id(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def _run(form, inputs: dict, h0, cotangents, *, cu_seqlens=None):
    """Forward + backward of one form; returns {name: tensor} for o, final state and gradients."""
    leaves = {n: x.detach().clone().requires_grad_() for n, x in inputs.items() if x is not None}
    h0 = h0.detach().clone().requires_grad_()
    kwargs = dict(scale=inputs["q"].shape[-1] ** -0.5, initial_state=h0, output_final_state=True)
    if cu_seqlens is None:
        o, ht = form(leaves["q"], leaves["k"], leaves["v"], leaves.get("g"), **kwargs)
    else:
        o, ht = form(leaves["q"], leaves["k"], leaves["v"], leaves.get("g"), cu_seqlens=cu_seqlens, **kwargs)
    do, dht = cotangents
    loss = (o.double() * do).sum() + (ht.double() * dht).sum()
    grads = torch.autograd.grad(loss, [*leaves.values(), h0])
    out = {"o": o, "final_state": ht}
    out.update({f"d{n}": gr for n, gr in zip([*leaves, "h0"], grads)})
    return out


def _per_sequence(form, lengths):
    """A form over packed sequences, run one sequence at a time (the reference for varlen)."""
    def run(q, k, v, g, *, scale, initial_state, output_final_state):
        outs, states, bos = [], [], 0
        for i, n in enumerate(lengths):
            piece = [None if x is None else x[:, bos:bos + n] for x in (q, k, v, g)]
            o, s = form(*piece, scale=scale, initial_state=initial_state[i:i + 1], output_final_state=output_final_state)
            outs.append(o)
            states.append(s)
            bos += n
        return torch.cat(outs, 1), torch.cat(states, 0)  # N x [1, T_i, H, V] -> [1, T, H, V]
    return run


def _check(inputs: dict, h0, dtype, *, lengths=None):
    """Compare triton and chunk (both in `dtype`) with naive in float64."""
    gen = torch.Generator().manual_seed(1)
    Bx, T = inputs["q"].shape[:2]
    N = Bx if lengths is None else len(lengths)
    Hx, Vx = inputs["v"].shape[2:]
    do = torch.randn(Bx, T, Hx, Vx, generator=gen, dtype=torch.float64).to(DEVICE)
    dht = torch.randn(N, Hx, inputs["q"].shape[-1], Vx, generator=gen, dtype=torch.float64).to(DEVICE)
    low = {n: None if x is None else x.to(dtype) for n, x in inputs.items()}
    exact = {n: None if x is None else x.double() for n, x in low.items()}  # the same rounded inputs
    naive, chunk = linear_attn_naive, linear_attn_chunk
    cu = None
    if lengths is not None:
        naive, chunk = _per_sequence(naive, lengths), _per_sequence(chunk, lengths)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEVICE)
    ref = _run(naive, exact, h0.double(), (do, dht))
    base = _run(chunk, low, h0, (do, dht))
    got = _run(linear_attn_triton, low, h0, (do, dht), cu_seqlens=cu)
    for name, expected in ref.items():
        assert got[name].dtype == base[name].dtype, f"{name}: dtype {got[name].dtype} != {base[name].dtype}"
        assert bool(torch.isfinite(got[name]).all()), f"{name}: non-finite values"
        err, err_chunk = rel_err(got[name], expected), rel_err(base[name], expected)
        bound = min(max(2 * err_chunk, FLOOR[dtype]), CEILING[dtype])
        assert err <= bound, f"{name}: triton rel err {err:.2e} > {bound:.2e} (chunk {err_chunk:.2e})"


def _inputs(Bx, T, decay, seed=0):
    x = seeded_inputs(Bx, T, H, K, V, decay=decay, seed=seed, device=DEVICE)
    x.pop("beta")
    return x


@pytest.mark.parametrize("decay", [False, True], ids=["nodecay", "decay"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("T", T_GRID, ids=lambda t: f"T{t}")
def test_triton_matches_naive(T, dtype, decay):
    Bx = 1 if T == LONG_T else B
    h0 = torch.randn(Bx, H, K, V, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(DEVICE)
    _check(_inputs(Bx, T, decay), h0, dtype)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16], ids=_dtype_id)
def test_triton_varlen(dtype):
    lengths = [1, 64, 37, 130] if not CUDA else [1, 64, 1000, 4095, 130]
    h0 = torch.randn(len(lengths), H, K, V, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(DEVICE)
    _check(_inputs(1, sum(lengths), decay=True, seed=4), h0, dtype, lengths=lengths)


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_triton_segment_split(dtype):
    """One sequence, few heads: the sequence is split into segments combined by the scan."""
    from polyattn.ops.linear.triton.common import KernelConfig, use_config

    config = KernelConfig(chunk_size=16, block_c=16, min_segment_chunks=1) if not CUDA else KernelConfig()
    h0 = torch.randn(1, H, K, V, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(DEVICE)
    with use_config(config):
        _check(_inputs(1, SPLIT_T, decay=True, seed=6), h0, dtype)


@pytest.mark.parametrize("decay", [False, True], ids=["nodecay", "decay"])
def test_triton_step_matches_reference(decay):
    x = _inputs(B, 3, decay, seed=7)
    state = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(8), dtype=torch.float64).to(DEVICE)
    fused = state.float().contiguous()
    reference = state.clone()
    for t in range(3):
        step = [None if x[n] is None else x[n][:, t] for n in ("q", "k", "v", "g")]
        o, same = linear_attn_step(*(None if s is None else s.float() for s in step), fused, scale=0.3)
        o_ref, reference = linear_attn_step_reference(*step, reference, scale=0.3)
        assert same is fused
        assert rel_err(o, o_ref) <= 1e-5, f"step {t}: o rel err {rel_err(o, o_ref):.2e}"
        assert rel_err(fused, reference) <= 1e-5, f"step {t}: state rel err {rel_err(fused, reference):.2e}"
