"""Context parallelism on several processes: each rank's shard against the one-process op, and its time.

    torchrun --standalone --nproc-per-node 4 benchmarks/context_parallel_run.py --T 131072 524288 1048576
    torchrun --standalone --nproc-per-node 2 benchmarks/context_parallel_run.py --device cpu   # a CPU smoke run (gloo)

One packed row of T tokens is split over the launch's ranks (`shard_bounds`); every rank builds only its own
tokens, block by block from seeded generators, so any rank can rebuild any stretch of the row. Per case and T:

- the step: `ContextParallel` forward and forward + backward on every rank, the slowest rank's median (CUDA events
  on the GPU, the host clock on the CPU), and tokens/s of the whole row;
- the compute alone: the plain op on the rank's shard (no summary, no collective), the slowest rank's;
- the communication apart: the all-gather of a tensor as large as the summary each rank sends, timed alone;
- with `T <= --check-max`, the check: rank 0 runs the plain op on the whole row, forward and backward, and every
  rank's outputs and input gradients must match it within `--rtol` (relative Frobenius error; the gradients of
  `Σ o · w` for seeded weights w), else the run stops with a `ValueError` naming the case.

Rank 0 writes `context_parallel_run.json` under `--out` (default `benchmarks/results/<date>-<device>-x<ranks>`)
after every row, so a time limit keeps the rows done. Weak scaling: the same tokens per rank at 1, 2, 4, 8 ranks
(`--T` scaled with the launch); strong scaling: the same `--T` at every launch size.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from polyattn import ops
from polyattn.bench.timing import bench_ms, environment, write_json
from polyattn.distributed import ContextParallel, shard_bounds
from polyattn.ops.common import num_levels

BLOCK = 4096  # tokens per seeded generator block of the row

# name -> (op, per-token inputs in call order, options, K, V)
CASES = {
    "linear_attn_decay": ("linear_attn", ("q", "k", "v", "g"), {}, 128, 128),
    "delta_rule": ("delta_rule", ("q", "k", "v", "beta", "g"), {}, 128, 128),
    "loglinear_mamba2": ("loglinear_attn", ("q", "k", "v", "lam", "g"), {}, 64, 64),
    "kata_m2": ("kata", ("q", "k", "v", "g"), {"groups": 2}, 64, 64),
}
SIZES = {"cuda": dict(T=[131072], heads=16, head_cap=128), "cpu": dict(T=[256], heads=2, head_cap=8)}


def row_slice(start: int, end: int, H: int, K: int, V: int, L: int, dtype, device, seed: int = 0) -> dict:
    """Tokens `[start, end)` of the seeded row as `[1, end - start, H, ...]` tensors (unit keys, log-decays in
    (-0.1, 0), β in (0, 1), level weights in (0.5, 1.5)), the same whichever rank builds them."""
    parts = []
    for b in range(start // BLOCK, (end - 1) // BLOCK + 1):
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + b)
        rand = lambda *s: torch.rand(BLOCK, H, *s, generator=gen, device=device)  # noqa: E731
        normal = lambda *s: torch.randn(BLOCK, H, *s, generator=gen, device=device)  # noqa: E731
        block = dict(q=normal(K), k=F.normalize(normal(K), dim=-1), v=normal(V), g=-0.1 * rand(), beta=rand(), lam=rand(L) + 0.5)
        lo, hi = max(start, b * BLOCK) - b * BLOCK, min(end, (b + 1) * BLOCK) - b * BLOCK
        parts.append({name: t[lo:hi] for name, t in block.items()})
    out = {name: torch.cat([p[name] for p in parts])[None] for name in parts[0]}  # [1, end - start, H, ...]
    for name in ("q", "k", "v"):
        out[name] = out[name].to(dtype)
    return out


def output_weights(start: int, end: int, H: int, V: int, device, seed: int) -> torch.Tensor:
    """The seeded weights `w [1, end - start, H, V]` of the loss `Σ o · w` over one shard `[start, end)`."""
    return torch.randn(1, end - start, H, V, generator=torch.Generator(device=device).manual_seed(seed + 7 + start), device=device)


class CountingGather(ContextParallel):
    """`ContextParallel` that counts the bytes of the summaries it sends (one all-gather per call)."""

    sent_bytes = 0

    def gather(self, flat):
        self.sent_bytes += flat.numel() * flat.element_size()
        return super().gather(flat)


def host_ms(fn, reps: int = 3) -> float:
    """Median host milliseconds of `fn()` after a warm-up call (the CPU runs)."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def slowest(ms: float, device) -> float:
    """The largest of every rank's `ms`: a step ends when its slowest rank does."""
    t = torch.tensor([ms], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def run_case(name, T, args, device, dtype, rank, world):
    op, names, options, K, V = CASES[name]
    K, V, H = min(K, args.head_cap), min(V, args.head_cap), args.heads
    L = num_levels(T)
    bounds = shard_bounds(T, world)
    s, e = bounds[rank], bounds[rank + 1]
    x = {n: t.requires_grad_(n in names) for n, t in row_slice(s, e, H, K, V, L, dtype, device, args.seed).items()}
    cp = CountingGather(dist.group.WORLD, bounds)
    call = lambda impl: impl(*[x[n] for n in names], **options)[0]  # noqa: E731
    cp_op, plain_op = getattr(cp, op), getattr(ops, op)
    weights = output_weights(s, e, H, V, device, args.seed)

    def fwd(impl):
        with torch.no_grad():
            call(impl)

    def fwdbwd(impl):
        torch.autograd.grad((call(impl).float() * weights).sum(), [x[n] for n in names])

    measure = bench_ms if device.type == "cuda" else host_ms
    row = dict(case=name, op=op, world_size=world, T=T, shard=e - s, H=H, K=K, V=V, L=L, dtype=str(dtype).replace("torch.", ""))
    for label, impl in (("cp", cp_op), ("local", plain_op)):
        for mode, fn in (("fwd", fwd), ("fwdbwd", fwdbwd)):
            dist.barrier()
            row[f"{label}_{mode}_ms"] = slowest(measure(lambda fn=fn, impl=impl: fn(impl)), device)
    cp.sent_bytes = 0
    fwd(cp_op)
    summary = torch.zeros(max(1, cp.sent_bytes // 4), dtype=torch.float32, device=device)
    gathered = [torch.empty_like(summary) for _ in range(world)]
    dist.barrier()
    row["comm_ms"] = slowest(measure(lambda: dist.all_gather(gathered, summary)), device)
    row["summary_bytes_per_rank"] = cp.sent_bytes
    row["tokens_per_s_fwdbwd"] = T / (row["cp_fwdbwd_ms"] / 1e3)
    if T <= args.check_max:
        row.update(check(name, T, args, device, dtype, rank, world, x, weights, call, cp_op, names, (H, K, V, L)))
    return row


def check(name, T, args, device, dtype, rank, world, x, weights, call, cp_op, names, dims):
    """This rank's outputs and gradients against the one-process op on the whole row (built on rank 0)."""
    o = call(cp_op)
    grads = torch.autograd.grad((o.float() * weights).sum(), [x[n] for n in names])
    mine = [o.detach().cpu()] + [gr.cpu() for gr in grads]
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    errors = {}
    if rank == 0:
        op, _, options, _, _ = CASES[name]
        whole = {n: t.requires_grad_(n in names) for n, t in row_slice(0, T, *dims, dtype, device, args.seed).items()}
        bounds = shard_bounds(T, world)
        w_all = torch.cat([output_weights(bounds[r], bounds[r + 1], dims[0], dims[2], device, args.seed) for r in range(world)], dim=1)
        o_ref = getattr(ops, op)(*[whole[n] for n in names], **options)[0]
        g_ref = torch.autograd.grad((o_ref.float() * w_all).sum(), [whole[n] for n in names])
        for i, label in enumerate(["o"] + [f"d{n}" for n in names]):
            got = torch.cat([parts[i] for parts in everyone], dim=1)
            want = (o_ref.detach() if i == 0 else g_ref[i - 1]).cpu()
            errors[f"rel_err_{label}"] = rel(got, want)
    box = [errors]
    dist.broadcast_object_list(box, src=0)
    bad = {k: v for k, v in box[0].items() if not v <= args.rtol}
    if bad:
        raise ValueError(f"context_parallel_run: {name} at T = {T} on {world} ranks differs from one process: {bad}")
    return box[0]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--T", type=int, nargs="+", default=None, help="tokens of the row (default 131072 on CUDA, 256 on CPU)")
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--head-cap", type=int, default=None, help="the largest K and V (default 128 on CUDA, 8 on CPU)")
    parser.add_argument("--check-max", type=int, default=131072, help="the longest row checked against one process")
    parser.add_argument("--rtol", type=float, default=None, help="default 2e-2 in bf16 (CUDA), 1e-4 in fp32 (CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    for key, value in SIZES[device.type if device.type == "cuda" else "cpu"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    args.rtol = args.rtol if args.rtol is not None else (2e-2 if dtype == torch.bfloat16 else 1e-4)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        tag = "h200" if device.type == "cuda" and "H200" in environment(device)["device"] else device.type
        out = Path(args.out or f"benchmarks/results/{datetime.date.today()}-{tag}-x{world}")
        rows = []
        for T in args.T:
            for name in args.cases:
                row = run_case(name, T, args, device, dtype, rank, world)
                rows.append(row)
                if rank == 0:
                    print(f"x{world} {name:<18} T {T:>8}  cp {row['cp_fwd_ms']:9.3f} / {row['cp_fwdbwd_ms']:9.3f} ms  "
                          f"local {row['local_fwd_ms']:9.3f} / {row['local_fwdbwd_ms']:9.3f} ms  "
                          f"comm {row['comm_ms']:7.3f} ms ({row['summary_bytes_per_rank'] / 2**20:.2f} MiB)  "
                          + " ".join(f"{k[8:]} {v:.1e}" for k, v in row.items() if k.startswith("rel_err_")), flush=True)
                    out.mkdir(parents=True, exist_ok=True)
                    write_json(dict(environment=environment(device), world_size=world, rows=rows), out / "context_parallel_run.json")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
