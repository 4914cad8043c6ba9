"""The Triton forms under a non-finite input at a future position (ops/README.md, "Guarantees of the Triton forms").

A NaN or Inf planted in `q`, `k`, `v` (or `beta`) at position p leaves every output before p
bit-identical to a clean run of the same shape, on a chunk's first token and inside a chunk, also when
the sequence is cut into segments; the plant in `k` or `v` reaches the outputs at and after p. A plant
in one packed sequence (`cu_seqlens`) leaves the other sequences bit-identical. On CPU
the kernels run under TRITON_INTERPRET=1 at tiny shapes; with CUDA at real shapes in fp32 and bf16.
"""
from __future__ import annotations

import pytest
import torch

from polyattn import ops
from polyattn.ops.triton.plan import KernelConfig, use_config
from polyattn.testing import dtype_id, seeded_inputs

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if CUDA:
    H, K, V, T, POSITIONS = 16, 128, 96, 1000, (64, 100, 700)
    DTYPES = [torch.float32, torch.bfloat16]
else:
    H, K, V, T, POSITIONS = 2, 8, 6, 150, (64, 100)
    DTYPES = [torch.float32]

# The delta rule's Triton kernels still multiply by their masks (a NaN in a later row of a chunk
# reaches the earlier rows through the in-chunk products); set True once they select.
DELTA_TRITON_CAUSAL = False

HLA = {"hla2": dict(order=2), "ahla": dict(order=2, asymmetric=True), "hla3": dict(order=3),
       "hla2-norm": dict(order=2, normalize=True)}
OPS = ["linear_attn", *HLA, *(["delta_rule"] if DELTA_TRITON_CAUSAL else [])]


def _inputs(dtype, length=T, seed=21):
    x = seeded_inputs(1, length, H, K, V, decay=True, beta=True, seed=seed, device=DEVICE)
    x["k"] = torch.nn.functional.normalize(x["k"], dim=-1)
    return {n: t.to(dtype) for n, t in x.items()}


def _call(op, x, **kwargs):
    q, k, v, g, beta = x["q"], x["k"], x["v"], x["g"], x["beta"]
    if op == "linear_attn":
        return ops.linear_attn(q, k, v, g, impl="triton", **kwargs)[0]
    if op == "delta_rule":
        return ops.delta_rule(q, k, v, beta, g, impl="triton", **kwargs)[0]
    options = HLA[op]
    if options.get("normalize"):  # normalized HLA needs nonnegative features
        q, k = q.abs(), k.abs()
    return ops.hla(q, k, v, g, impl="triton", **options, **kwargs)[0]


def _fields(op):
    return ("q", "k", "v", "beta") if op == "delta_rule" else ("q", "k", "v")


SEGMENTS = KernelConfig(chunk_size=16, block_c=16, min_segment_chunks=1)  # cut the sequence into segments
# (op, dtype, config): every op in every dtype; under the interpreter, where one sequence stays in one
# segment, linear_attn once more with the segment split forced (with CUDA the real shapes split it).
CASES = [(op, dtype, None) for op in OPS for dtype in DTYPES]
if not CUDA:
    CASES += [("linear_attn", torch.bfloat16, None), ("linear_attn", torch.float32, SEGMENTS)]


@pytest.mark.parametrize(
    "op, dtype, config", CASES, ids=[f"{op}-{dtype_id(dtype)}{'-segments' if c else ''}" for op, dtype, c in CASES],
)
def test_future_nonfinite_leaves_earlier_outputs_bit_identical(op, dtype, config):
    with use_config(config or KernelConfig()):
        clean = _inputs(dtype)
        o_clean = _call(op, clean)
        assert bool(torch.isfinite(o_clean).all())
        for field in _fields(op):
            for value in ("nan", "inf"):
                for p in POSITIONS:
                    x = {n: t.clone() for n, t in clean.items()}
                    x[field][:, p, 0] = float(value)  # head 0
                    o = _call(op, x)
                    assert torch.equal(o[:, :p], o_clean[:, :p]), f"{field}={value} at {p} changed an earlier output"
                    if field in ("k", "v"):
                        assert not bool(torch.isfinite(o[:, p:, 0]).all()), f"{field}={value} at {p} never reached an output"


@pytest.mark.parametrize("op", OPS if CUDA else [op for op in OPS if op in ("linear_attn", "hla3", "delta_rule")])
def test_nonfinite_stays_in_its_packed_sequence(op):
    """Packed sequences (`cu_seqlens`): a NaN in the middle one leaves the other two and its own earlier
    tokens bit-identical."""
    lengths = [37, 64, 49] if not CUDA else [1000, 1500, 700]
    bounds = torch.tensor([0, *lengths], device=DEVICE).cumsum(0)
    clean = _inputs(torch.float32, sum(lengths), seed=22)
    o_clean = _call(op, clean, cu_seqlens=bounds)
    p = lengths[0] + lengths[1] // 2
    for field in _fields(op):
        x = {n: t.clone() for n, t in clean.items()}
        x[field][:, p, 0] = float("nan")
        o = _call(op, x, cu_seqlens=bounds)
        assert torch.equal(o[:, :p], o_clean[:, :p]), f"{field}: the earlier tokens changed"
        assert torch.equal(o[:, bounds[2]:], o_clean[:, bounds[2]:]), f"{field}: the next sequence changed"
