"""`python -m polyattn.bench {kernels,decode} --out DIR`."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("suite", choices=["kernels", "decode"], help="which benchmark to run")
    parser.add_argument("--out", type=Path, required=True, help="directory for JSON, markdown and PNG results")
    parser.add_argument("--dims", type=int, nargs="+", default=[128, 64], help="head dims K = V (kernels)")
    parser.add_argument("--seqlens", type=int, nargs="+", default=None, help="T values (kernels) or contexts (decode)")
    parser.add_argument("--impls", nargs="+", default=None, help="kernels: time only these impls (e.g. polyattn-triton)")
    parser.add_argument("--ops", nargs="+", default=None, help="kernels: time only these ops (e.g. kata_m1 softmax)")
    parser.add_argument("--skip", nargs="+", default=[], help="kernels: skip IMPL:D pairs (e.g. sdpa-flash:128)")
    parser.add_argument("--modes", nargs="+", choices=["fwd", "fwdbwd"], default=["fwd", "fwdbwd"],
                        help="kernels: time these modes (fwd, fwdbwd)")
    parser.add_argument("--compile-only", action="store_true", help="kernels: run our kernels once to compile them, no timing")


def parse_skip(items: list[str]) -> set[tuple[str, int]]:
    """``["sdpa-flash:128", ...]`` -> ``{("sdpa-flash", 128), ...}``."""
    pairs = set()
    for item in items:
        impl, _, dim = item.rpartition(":")
        if not impl or not dim.isdigit():
            raise ValueError(f"--skip: expected IMPL:D pairs like sdpa-flash:128, got {item!r}")
        pairs.add((impl, int(dim)))
    return pairs


def run(args: argparse.Namespace) -> int:
    """Every argument, the GPU and the output folder checked before any work; ``polyattn: error: ...``, exit 2."""
    import torch

    from polyattn.train.loop import prepare_out_dir

    try:
        skip = parse_skip(args.skip)
        for flag, values in (("--dims", args.dims), ("--seqlens", args.seqlens or [])):
            if any(n < 1 for n in values):
                raise ValueError(f"{flag}: expected positive integers, got {values}")
        from polyattn.bench.kernels import OPS

        unknown = sorted(set(args.ops or ()) - set(OPS))
        if unknown:
            raise ValueError(f"--ops: unknown {unknown}; expected some of {list(OPS)}")
        if not torch.cuda.is_available():
            raise ValueError("bench: needs a CUDA GPU, found none")
        prepare_out_dir(args.out)
    except ValueError as err:
        print(f"polyattn: error: {err}", file=sys.stderr)
        return 2
    if args.suite == "kernels":
        from polyattn.bench import kernels

        t_grid = tuple(args.seqlens or kernels.T_GRID)
        if args.compile_only:
            kernels.compile_only(dims=tuple(args.dims), t_grid=t_grid, ops=args.ops)
        else:
            kernels.run(args.out, dims=tuple(args.dims), t_grid=t_grid, modes=tuple(args.modes), impls=args.impls,
                        ops=args.ops, skip=skip)
    else:
        from polyattn.bench import decode

        decode.run(args.out, contexts=tuple(args.seqlens or decode.CONTEXTS))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m polyattn.bench", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
