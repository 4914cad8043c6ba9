"""CPU timing of the PyTorch forms of linear_attn and delta_rule (a benchmark, not a test).

    python benchmarks/cpu_forms.py [--T 4096] [--out benchmarks/results/cpu-forms.json]

Times ``naive`` (dense T×T) against ``chunk``/``scan``/``recurrent`` at B=1, H=4, K=V=64, float32, and
prints the ratios.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from polyattn import ops
from polyattn.testing import seeded_inputs


def _time(fn, repeat):
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--T", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    x = seeded_inputs(1, args.T, 4, 64, 64, dtype=torch.float32, beta=True)
    x["k"] = torch.nn.functional.normalize(x["k"], dim=-1)
    rows = []
    cases = [
        ("linear_attn", ops.linear_attn, ("q", "k", "v", "g"), ("naive", "chunk", "scan", "recurrent")),
        ("delta_rule", ops.delta_rule, ("q", "k", "v", "beta", "g"), ("naive", "chunk", "recurrent")),
    ]
    for name, op, keys, impls in cases:
        with torch.no_grad():
            times = {impl: _time(lambda: op(*(x[n] for n in keys), impl=impl), args.repeat) for impl in impls}
        for impl, seconds in times.items():
            rows.append({"op": name, "impl": impl, "T": args.T, "B": 1, "H": 4, "K": 64, "V": 64, "ms": 1e3 * seconds})
            print(f"{name:<12} {impl:<10} {1e3 * seconds:9.1f} ms   naive / {impl} = {times['naive'] / seconds:6.1f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
