"""What the causal in-chunk products cost the Triton linear_attn and HLA: before/after in one run.

python benchmarks/causal_overhead.py [--seqlens 2048 16384 131072] [--out results.json]

"after" is the kernel as shipped (`ops/triton/causal.py`: masked scores selected, one reduction per
chunk over the value tile); "before" is the same `chunk_outputs_kernel` compiled with the plain
multiply-by-mask stages swapped in (what the kernel did before), launched through the same passes.
Both run on the same inputs (bf16, H=16, K=V=128, B*T=65536), forward and forward+backward, with and
without decay, alternating; the outputs on finite inputs must be bit-identical. Without CUDA it runs
one tiny shape under TRITON_INTERPRET=1 and checks only that.
"""
import argparse
import json
import os
import sys
import types
from contextlib import contextmanager

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from polyattn import ops  # noqa: E402
from polyattn.bench.kernels import TOKENS, inputs  # noqa: E402
from polyattn.bench.timing import try_bench  # noqa: E402
from polyattn.ops.linear.triton import chunk_outputs, launch  # noqa: E402
from polyattn.ops.triton.precision import mma_left_fp32  # noqa: E402
from polyattn.testing import seeded_inputs  # noqa: E402


@triton.jit
def multiplied_scores(b_att, b_d, scale):
    return b_att * (tl.exp2(b_d) * scale)  # [C, C]


@triton.jit
def plain_product(b_att, b_v, REVERSE: tl.constexpr, F32: tl.constexpr):
    return mma_left_fp32(b_att, b_v, F32)  # [C, C] @ [C, BC] -> [C, BC]


def _before_kernel():
    shipped = chunk_outputs.chunk_outputs_kernel
    scope = dict(shipped.fn.__globals__, causal_scores=multiplied_scores, causal_product=plain_product)
    fn = types.FunctionType(shipped.fn.__code__, scope, shipped.fn.__name__)
    return triton.jit(do_not_specialize=["N_tok", "s_h0n", "s_h0h", "s_h0a", "s_h0c"])(fn)


BEFORE = _before_kernel()
AFTER = launch.chunk_outputs_kernel


@contextmanager
def kernel(which):
    launch.chunk_outputs_kernel = which
    try:
        yield
    finally:
        launch.chunk_outputs_kernel = AFTER


def calls(op, q, k, v, g):
    if op == "linear_attn":
        return lambda: ops.linear_attn(q, k, v, g, impl="triton")[0]
    return lambda: ops.hla(q, k, v, g, impl="triton")[0]


def time_pair(op, T, decay, mode, B=None):
    B = B or max(1, TOKENS // T)
    q, k, v, g, _ = inputs(B, T, 128, requires_grad=mode == "fwdbwd")
    fn = calls(op, q, k, v, g if decay else None)
    leaves = [q, k, v] + ([g] if decay else [])
    out = {}
    for name, which in (("before", BEFORE), ("after", AFTER), ("before2", BEFORE), ("after2", AFTER)):
        with kernel(which):
            if mode == "fwd":
                with torch.no_grad():
                    out[name] = try_bench(fn)
            else:
                do = torch.randn_like(fn())
                out[name] = try_bench(lambda: torch.autograd.grad(fn(), leaves, do))
    return out


def check_identical(op, B, T, H, D, decay):
    dtype, device = (torch.bfloat16, "cuda") if torch.cuda.is_available() else (torch.float32, "cpu")
    x = seeded_inputs(B, T, H, D, D, dtype=dtype, decay=decay, seed=1, device=device)
    fn = calls(op, x["q"], x["k"], x["v"], x["g"])
    with torch.no_grad():
        with kernel(BEFORE):
            before = fn()
        after = fn()
    assert torch.equal(before, after), f"{op}: before and after differ on finite inputs"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlens", type=int, nargs="+", default=[2048, 16384, 131072])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        for op in ("linear_attn", "hla2"):
            check_identical(op, 1, 70, 2, 16, decay=True)
        print("interpreter: before == after on finite inputs")
        return 0
    rows = []
    for op in ("linear_attn", "hla2"):
        for T in args.seqlens:
            check_identical(op, 1, T, 16, 128, decay=True)
            for decay in (False, True):
                for mode in ("fwd", "fwdbwd"):
                    ms = time_pair(op, T, decay, mode)
                    rows.append(dict(op=op, T=T, decay=decay, mode=mode, **ms))
                    cells = "  ".join(f"{n} {m:.3f}" if isinstance(m, float) else f"{n} {m}" for n, m in ms.items())
                    print(f"{op:12s} T={T:6d} {'decay' if decay else 'nodecay':7s} {mode:6s} {cells}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
