"""What context parallelism costs one rank: its local work plus the combine, beside the plain op on its shard.

The last rank of R is simulated in one process (it folds the most summaries, R - 1): the collective is
replaced by R copies of this rank's own summary, so the figure is the compute a rank adds (summary,
fold, read correction or rerun), not the network time; the exchanged bytes are printed beside it.

    python benchmarks/context_parallel_cost.py                # CUDA: bf16, H = 16, shards of 8K tokens, R = 2 and 8
    python benchmarks/context_parallel_cost.py --device cpu   # a CPU smoke run at tiny shapes (fp32)

Writes ``context_parallel_cost.json`` under ``--out`` (default ``benchmarks/results/<date>-<device>``).
"""

from __future__ import annotations

import argparse
import datetime
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from polyattn import ops
from polyattn.bench.timing import bench_ms, environment, parse_sized_args, write_json
from polyattn.distributed import ContextParallel, shard_bounds
from polyattn.ops.common import num_levels


class SimulatedLastRank(ContextParallel):
    """Rank R - 1 of R equal shards in this process alone; every rank's summary is this rank's own."""

    def __init__(self, world_size: int, shard: int):
        self.group, self.rank, self.world_size = None, world_size - 1, world_size
        self.bounds = shard_bounds(shard * world_size, world_size)
        self.sent_bytes, self._anchor, self._chain, self._previous = 0, None, False, None

    def gather(self, flat):
        self.sent_bytes += flat.numel() * flat.element_size()
        self._anchor = flat.expand(self.world_size, -1)  # [R, n]
        return self._anchor


def inputs(B, T, H, K, V, dtype, device, L):
    """Seeded per-token inputs (unit keys, so the delta rule stays contractive), leaves of the graph."""
    gen = torch.Generator(device=device).manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)  # noqa: E731
    q, k, v = rand(B, T, H, K), F.normalize(rand(B, T, H, K), dim=-1), rand(B, T, H, V)
    g = -torch.rand(B, T, H, generator=gen, device=device) * 0.1
    beta = torch.rand(B, T, H, generator=gen, device=device)
    lam = torch.rand(B, T, H, L, generator=gen, device=device) + 0.5
    x = dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g, beta=beta, lam=lam)
    return {name: t.requires_grad_(True) for name, t in x.items()}


# name -> (op, inputs, options, head dims K, V)
CASES = {
    "linear_attn (decay)": ("linear_attn", ("q", "k", "v", "g"), {}, 128, 128),
    "delta_rule": ("delta_rule", ("q", "k", "v", "beta", "g"), {}, 128, 128),
    "hla2": ("hla", ("q", "k", "v", "g"), {"order": 2}, 64, 64),
    "ahla": ("hla", ("q", "k", "v", "g"), {"order": 2, "asymmetric": True}, 64, 64),
    "hla3": ("hla", ("q", "k", "v", "g"), {"order": 3}, 64, 64),
    "loglinear mamba2": ("loglinear_attn", ("q", "k", "v", "lam", "g"), {}, 64, 64),
    "loglinear gdn": ("loglinear_attn", ("q", "k", "v", "lam", "g"), {"beta": "beta"}, 64, 64),
    "kata-m1": ("kata", ("q", "k", "v", "g"), {}, 16, 64),
    "deltakata-m1": ("kata", ("q", "k", "v", "g"), {"beta": "beta", "normalize": False}, 16, 64),
}


SIZES = {"cuda": {"shard": 8192, "heads": 16, "head_cap": 128}, "cpu": {"shard": 64, "heads": 2, "head_cap": 8}}


def cpu_ms(fn, reps=3):
    """Mean milliseconds of ``fn()`` after one warm-up call (host timer; CPU smoke runs)."""
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,8")
    parser.add_argument("--out", default=None)
    args, device = parse_sized_args(parser, argv, SIZES)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    measure = bench_ms if device.type == "cuda" else cpu_ms
    shard, H = args.shard, args.heads
    tag = "h200" if "H200" in environment(device)["device"] else device.type
    out = Path(args.out or f"benchmarks/results/{datetime.date.today()}-{tag}")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "context_parallel_cost.json"
    rows = []
    for R in (int(r) for r in args.ranks.split(",")):
        L = num_levels(shard * R)
        for name, (op, names, options, K, V) in CASES.items():
            K, V = min(K, args.head_cap), min(V, args.head_cap)
            x = inputs(1, shard, H, K, V, dtype, device, L)
            args_ = [x[n] for n in names]
            kwargs = {key: x[value] if value in x else value for key, value in options.items()}
            cp = SimulatedLastRank(R, shard)
            plain = lambda: getattr(ops, op)(*args_, **kwargs)[0]  # noqa: E731
            sharded = lambda: getattr(cp, op)(*args_, **kwargs)[0]  # noqa: E731
            row = dict(case=name, ranks=R, shard=shard, H=H, K=K, V=V, L=L, dtype=str(dtype))
            for label, fn in (("plain", plain), ("context_parallel", sharded)):
                row[f"{label}_fwd_ms"] = measure(lambda fn=fn: fn())
                row[f"{label}_fwdbwd_ms"] = measure(lambda fn=fn: fn().float().square().sum().backward())
            cp.sent_bytes = 0
            sharded()
            row["summary_bytes_per_rank"] = cp.sent_bytes
            row["fwd_overhead"] = row["context_parallel_fwd_ms"] / row["plain_fwd_ms"]
            row["fwdbwd_overhead"] = row["context_parallel_fwdbwd_ms"] / row["plain_fwdbwd_ms"]
            rows.append(row)
            print(
                f"R={R:<2} {name:<20} plain {row['plain_fwd_ms']:8.3f} / {row['plain_fwdbwd_ms']:8.3f} ms   "
                f"cp {row['context_parallel_fwd_ms']:8.3f} / {row['context_parallel_fwdbwd_ms']:8.3f} ms   "
                f"x{row['fwd_overhead']:.2f} / x{row['fwdbwd_overhead']:.2f}   summary {row['summary_bytes_per_rank'] / 2**20:.2f} MiB",
                flush=True,
            )
            write_json(dict(environment=environment(device), rows=rows), path)  # after every row: a timeout keeps them
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
