"""Sweep the launch parameters of the Triton linear_attn kernels on one GPU (prints a table).

python benchmarks/tune_linear_triton.py [--out results.json] [--seqlens 2048 ...] [--configs 0 1 ...]
Times forward and forward+backward (bf16, H=16, K=V=128, B*T=65536) per KernelConfig against
fla chunk_linear_attn when importable.
"""
import argparse
import json
import sys

import torch

from polyattn import ops
from polyattn.bench.kernels import TOKENS, inputs
from polyattn.bench.timing import try_bench
from polyattn.ops.triton.plan import KernelConfig, use_config

CONFIGS = [
    KernelConfig(),
    KernelConfig(num_warps=8),
    KernelConfig(num_stages=1),
    KernelConfig(num_stages=3),
    KernelConfig(block_c=128, num_warps=8),
    KernelConfig(block_c=32),
    KernelConfig(programs_per_sm=2),
    KernelConfig(programs_per_sm=8),
    KernelConfig(chunk_size=128, num_warps=8),
    KernelConfig(chunk_size=32),
]


def time_case(T, decay, mode):
    B = max(1, TOKENS // T)
    q, k, v, g, _ = inputs(B, T, 128, requires_grad=mode == "fwdbwd")
    g = g if decay else None
    fn = lambda: ops.linear_attn(q, k, v, g, impl="triton")[0]  # noqa: E731
    if mode == "fwd":
        with torch.no_grad():
            return try_bench(fn)
    do = torch.randn_like(fn())
    leaves = [q, k, v] + ([g] if decay else [])
    return try_bench(lambda: torch.autograd.grad(fn(), leaves, do))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[2048, 16384, 131072])
    parser.add_argument("--configs", type=int, nargs="+", default=list(range(len(CONFIGS))), help="indices into CONFIGS")
    args = parser.parse_args()
    rows = []
    for i, config in enumerate(CONFIGS):
        if i not in args.configs:
            continue
        with use_config(config):
            for T in args.seqlens:
                for decay in (False, True):
                    for mode in ("fwd", "fwdbwd"):
                        ms = time_case(T, decay, mode)
                        rows.append(dict(config=i, **config.__dict__, T=T, decay=decay, mode=mode, ms=ms))
                        print(i, config, T, "decay" if decay else "nodecay", mode, ms, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    print("\nconfig  " + "  ".join(f"{'d' if d else 'n'}{T // 1024}K-{m}" for T in args.seqlens for d in (False, True) for m in ("fwd", "fwdbwd")))
    for i in args.configs:
        cells = [r["ms"] for r in rows if r["config"] == i]
        print(f"{i:6d}  " + "  ".join(f"{c:8.3f}" if isinstance(c, float) else "   error" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
