"""Per-kernel CUDA time of any row of the kernel benchmark (torch.profiler): where a call's time goes.

python benchmarks/profile_kernels.py --ops loglinear_mamba2 kata_m1 [--impls polyattn-triton ...] [--T 2048 32768]
    [--dims 128] [--modes fwd fwdbwd] [--by-launch] [--out FILE]
The cases, inputs and shapes are `python -m polyattn.bench kernels`'s (bf16, H = 16, B = 65536 // T); prints
each call's total and its slowest kernels, and writes `{"op/impl/D/T/mode": {kernel: ms}}` as JSON.
"""
import argparse
import json

import torch

from polyattn.bench import kernels
from polyattn.bench.timing import kernel_times, print_kernel_times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", nargs="+", required=True, choices=kernels.OPS)
    parser.add_argument("--impls", nargs="+", default=None, help="default: every polyattn impl of the ops")
    parser.add_argument("--T", type=int, nargs="+", default=[8192])
    parser.add_argument("--dims", type=int, nargs="+", default=[128])
    parser.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    parser.add_argument("--by-launch", action="store_true",
                        help="one row per launch, in call order (tells the passes of one kernel apart)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    chosen = [c for c in kernels.cases() if c.op in args.ops
              and (c.impl in args.impls if args.impls else c.impl.startswith("polyattn"))]
    results = {}
    for D in args.dims:
        for T in args.T:
            B = max(1, kernels.TOKENS // T)
            for mode in args.modes:
                for case in chosen:
                    key = f"{case.op}/{case.impl}/D{D}/T{T}/{mode}"
                    results[key] = kernel_times(step(case, B, T, D, mode), by_launch=args.by_launch)
                    print_kernel_times(key, results[key], top=len(results[key]) if args.by_launch else 8)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


def step(case, B, T, D, mode):
    """One call of `case` (forward, or forward + backward into every leaf the benchmark differentiates)."""
    return kernels.row_call(case, *kernels.inputs(B, T, D, requires_grad=mode == "fwdbwd"), mode)


if __name__ == "__main__":
    main()
