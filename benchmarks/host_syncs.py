"""Host synchronisations and idle GPU time of a forward + backward: the benchmark's ms beside the sum of its kernels.

python benchmarks/host_syncs.py [--cases linear_attn_decay:8192 delta_rule:8192 ...] [--out FILE]
For each `op:T` of `python -m polyattn.bench kernels` (our Triton impl; bf16, H = 16, K = V = 128, B = 65536 // T):
the median ms of one fwd+bwd (`bench_ms`), the sum of its kernels' CUDA times (torch.profiler), the host's time
to enqueue it (median of ten, each from an idle GPU) and the source lines that synchronised the host with the GPU
(`torch.cuda.set_sync_debug_mode`). A sync makes the host wait for the GPU, which then idles while the host
enqueues what follows, so the benchmark's ms exceed the kernels' sum; without one they agree. Writes the rows,
with the kernels by launch, as JSON.
"""
import argparse
import json
import time
import warnings

import torch

from polyattn.bench import kernels
from polyattn.bench.timing import bench_ms, kernel_times

DEFAULT = ["linear_attn_decay:8192", "linear_attn:8192", "hla2_decay:8192", "delta_rule:8192"]


def enqueue_ms(call, reps: int = 10) -> float:
    """Median host ms to enqueue `call()` on an idle GPU (a sync inside it counts the GPU's time too)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()
    return sorted(times)[reps // 2]


def sync_lines(call) -> list[str]:
    """The source lines (`file:line`) at which `call()` synchronised the host with the GPU."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call()
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return sorted({f"{w.filename.split('polyattn/')[-1]}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=DEFAULT, metavar="OP:T")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    rows = {}
    for spec in args.cases:
        op, T = spec.split(":")
        case = next(c for c in kernels.cases() if c.op == op and c.impl == "polyattn-triton")
        call = kernels.row_call(case, *kernels.inputs(kernels.TOKENS // int(T), int(T), 128, requires_grad=True), "fwdbwd")
        launches = kernel_times(call, by_launch=True)
        rows[spec] = dict(bench_ms=bench_ms(call), kernel_sum_ms=sum(launches.values()), host_enqueue_ms=enqueue_ms(call),
                          syncs=sync_lines(call), launches=launches)
        print(spec, {key: value for key, value in rows[spec].items() if key != "launches"}, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
