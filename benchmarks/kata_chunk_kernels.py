"""Time each kernel of KATA's chunked form alone, under several KernelConfigs, on one GPU.

python benchmarks/kata_chunk_kernels.py OUT.json --T 131072 [--decay] [--ops kata_m2 kata_m1] --configs '{}' '{"kata_chunk_warps": 8}' ...
Per op (K = V = 64, H = 16, bf16, one sequence of T tokens) and config: the forward state walk, the
backward's reverse walk, the read of the states, the lift gradient, and the lift gradient with the read
fused as the backward runs it for the writes' dk and dv (function.py's launchers on random inputs,
`--decay` with a log-decay), ms per call (`polyattn.bench.timing.bench_ms`: the median of
do_bench). Prints one JSON line per (op, config) and writes them all to OUT.json.
"""
import argparse
import json

import torch

from polyattn.bench.kernels import KATA
from polyattn.bench.timing import bench_ms
from polyattn.ops.kata.triton.function import Cotangents, _chunk_plan, _flat, chunk_lift_grad, chunk_read, chunk_states
from polyattn.ops.triton.plan import KernelConfig, use_config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--T", type=int, default=131072)
    parser.add_argument("--ops", nargs="+", default=["kata_m2", "kata_m1"], choices=sorted(KATA))
    parser.add_argument("--decay", action="store_true")
    parser.add_argument("--configs", nargs="+", default=["{}"], metavar="JSON")
    args = parser.parse_args()
    T, H, K, V = args.T, 16, 64, 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, T, H, K, device="cuda", generator=gen).bfloat16() for _ in range(3))
    g = -0.1 * torch.rand(1, T, H, device="cuda", generator=gen) if args.decay else None  # [1, T, H]
    do = torch.randn(T, H, V, device="cuda", generator=gen).bfloat16()
    y = Cotangents(do, *(torch.rand(T, H, device="cuda", generator=gen) for _ in range(2)))  # the reads' cotangent rows
    qf, kf, vf, gf = (_flat(x) for x in (q, k, v, g))
    rows = []
    for op in args.ops:
        groups, combine = KATA[op]
        for fields in map(json.loads, args.configs):
            row = dict(op=op, T=T, decay=args.decay, config=fields)
            with use_config(KernelConfig(**fields)):
                plan = _chunk_plan(q, v, [T], groups, combine)
                hs, zs, _, _ = chunk_states(kf, vf, gf, None, None, plan, 1, False)
                row["states"] = bench_ms(lambda: chunk_states(kf, vf, gf, None, None, plan, 1, False))
                row["reverse"] = bench_ms(lambda: chunk_states(qf, y, gf, None, None, plan, 1, False, reverse=True))
                row["read"] = bench_ms(lambda: chunk_read(qf, gf, hs, zs, 0.125, plan))
                row["lift_grad"] = bench_ms(lambda: chunk_lift_grad(qf, y, hs, zs, plan))
                dv = torch.zeros(T, H, V, device="cuda")  # the writes' dk and dv in one pass, as the backward runs it
                row["lift_grad_read"] = bench_ms(lambda: chunk_lift_grad(kf, y, hs, zs, plan, read_into=dv))
            print(json.dumps(row), flush=True)
            rows.append(row)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
