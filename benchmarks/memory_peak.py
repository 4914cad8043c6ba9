"""The peak memory of a DeltaKATA-M1 forward + backward on the Triton chunk path, counted on the CPU and carried
to the GPU benchmark's shapes.

A `TorchDispatchMode` registers every storage an op returns, with a weak finalizer that fires when the storage is
freed, and keeps the running sum of live bytes: at each allocation, which storages are alive. That is what the
GPU caching allocator's `max_memory_allocated` counts (live blocks), so the peak is device-independent; the kernels
run under `TRITON_INTERPRET=1`. Custom ops (`torch.library.custom_op`) run their Python implementation under the
mode, and an op that reaches it whole with a composite decomposition (matmul, einsum inside a custom op) runs that
decomposition, so that the copies inside them are counted. The interpreter keeps each launch's arguments in reference
cycles, so the garbage collector runs after every launch (a GPU launch holds nothing after it returns).

Every counted storage is one of a few kinds whose size is a formula in the shapes (an fp32 `[C, C]` tile per chunk
and head, fp32 or bf16 rows per token and head of width V or K, one lifted state per checkpoint, round slot or
sequence, ...). The live set after each allocation, as counts of those kinds, does not depend on the shapes (the
same code runs in the same order), so the peak at the benchmark's shapes is the largest of those counts times the
kinds' sizes there. Checked against the H200: the replay of a run of the code of call 25 gave that call's measured
peaks (17.92 / 12.41 / 10.09 / 17.96 GiB at 2K / 8K / 32K / 128K) to 0.01 GiB.

usage: TRITON_INTERPRET=1 python benchmarks/memory_peak.py [--B 2 --T 1024 --H 2 --K 16 --V 32 --C 64] [--out FILE.json]
(about a minute; the defaults keep the benchmark's 32 chunks a sequence at 2K, in chunks of 64)
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import traceback
import weakref
from collections import Counter

import torch
import torch.nn.functional as F
from torch._library.custom_ops import OPDEFS
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from polyattn import ops
from polyattn.ops.kata.triton import delta
from polyattn.ops.triton.plan import get_config, use_config

GiB = 2**30
BENCH = [(2048, 32), (8192, 8), (32768, 2), (131072, 1)]  # (T, B): 65,536 tokens a call, H = 16, K = V = 64, C = 128


class LiveBytes(TorchDispatchMode):
    """Counts the live bytes of the storages ops create (those of `exclude`d tensors never); `events` holds, after
    each allocation, the ids of the storages alive; `records` their shape, dtype and creating line."""

    def __init__(self, *exclude):
        super().__init__()
        self.skip = {t.untyped_storage().data_ptr() for t in exclude}
        self.live, self.records, self.events = {}, {}, []
        self.now = self.peak = 0

    def _free(self, key):
        self.now -= self.live.pop(key)[1]

    def _register(self, t: torch.Tensor, op: str):
        s = t.untyped_storage()
        key, n = s.data_ptr(), s.nbytes()
        if n == 0 or key in self.live or key in self.skip:
            return
        frames = [f"{f.filename.split('/polyattn/')[-1]}:{f.lineno}" for f in traceback.extract_stack() if "/polyattn/" in f.filename]
        seq = len(self.records)
        self.records[seq] = dict(shape=list(t.shape), dtype=str(t.dtype).removeprefix("torch."), nbytes=n, op=op,
                                 line=frames[-1] if frames else "autograd")
        self.live[key] = (seq, n)
        self.now += n
        weakref.finalize(s, self._free, key)
        self.events.append([s_ for s_, _ in self.live.values()])
        self.peak = max(self.peak, self.now)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.name()
        opdef = OPDEFS.get(name.split(".")[0]) if "::" in name else None
        out = NotImplemented
        if opdef is not None:  # a Python custom op: its implementation, counted
            with self:
                out = opdef._init_fn(*args, **kwargs)
        elif torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd"):
            with self:
                out = func.decompose(*args, **kwargs)
        if out is NotImplemented:
            out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._register(t, name)
        return out


def sizes(B, T, H, K, V, C, R=None):
    """The kinds' sizes in bytes at a shape (M1: P = K^2 lifted features; R the state interval, default the
    config's rule `state_interval`)."""
    c = -(-T // C)
    R = R or max(1, math.ceil(math.sqrt(c / 2)))
    n, NC, P = B * T * H, B * c, K * K
    NK, NS = B * -(-c // R), B * min(R, c) if R > 1 else B * c
    state = 4 * H * P * V
    return dict(CC=4 * NC * H * C * C, RV=4 * n * V, RK=4 * n * K, BV=2 * n * V, BK=2 * n * K, ST_NK=state * NK,
                ST_NS=state * NS, ST_N=state * B, Z_NS=4 * NS * H * P, VEC=4 * n, VECB=2 * n, CH=4 * NC * H,
                TOK8=8 * B * T, TOK4=4 * B * T, TOK1=B * T, BYTE=1), dict(H=H, P=P, V=V, NK=NK, NS=NS, N=B)


FLOAT32 = ("Z_NS", "CC", "RV", "RK", "VEC", "CH")  # the kinds by dtype (sizes alone coincide at small shapes)
KINDS = dict(float32=FLOAT32, bfloat16=("BV", "BK", "VECB"), int64=("TOK8",), int32=("TOK4",), bool=("TOK1",))


def kind(rec, size, dims) -> tuple[str, int]:
    """`(kind, multiple)` of a record at the run's own shape (BYTE: a constant, counted in bytes)."""
    shape, nb = tuple(rec["shape"]), rec["nbytes"]
    if len(shape) == 4 and shape[1:] == (dims["H"], dims["P"], dims["V"]) and rec["dtype"] == "float32":
        for name in ("NK", "NS", "N"):
            if shape[0] == dims[name]:
                return f"ST_{name}", 1
    for name in KINDS.get(rec["dtype"], ()):
        if nb == size[name]:
            return name, 1
    return "BYTE", nb


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in dict(B=2, T=1024, H=2, K=16, V=32, C=64).items():
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--out", default=None, help="JSON: the peak, the live set there and the replayed peaks")
    a = ap.parse_args(argv)
    import triton.runtime.interpreter as interpreter

    launch = interpreter.GridExecutor.__call__

    def launch_and_collect(self, *args, **kwargs):
        try:
            return launch(self, *args, **kwargs)
        finally:
            gc.collect()

    interpreter.GridExecutor.__call__ = launch_and_collect
    try:
        return count(a)
    finally:
        interpreter.GridExecutor.__call__ = launch


def count(a) -> dict:
    """`main` after the arguments: count, replay, print, and return what `--out` writes."""
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(a.B, a.T, a.H, a.K, generator=gen).bfloat16() for _ in range(2))
    k = F.normalize(k.float(), dim=-1).bfloat16()
    v = torch.randn(a.B, a.T, a.H, a.V, generator=gen).bfloat16()
    g = F.logsigmoid(torch.randn(a.B, a.T, a.H, generator=gen) + 4.0)
    beta = torch.sigmoid(torch.randn(a.B, a.T, a.H, generator=gen)).bfloat16()
    do = torch.randn(a.B, a.T, a.H, a.V, generator=gen).bfloat16()
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta)]
    config = dataclasses.replace(get_config(), deltakata_chunk_size=a.C, kata_read_block=min(a.C, get_config().kata_read_block))

    def fwd():  # as `python -m polyattn.bench kernels --ops deltakata_m1 --impls polyattn-triton-chunk` calls it
        return ops.kata(q, k, v, g, beta=beta, groups=1, combine="concat", normalize=False, impl="triton_chunk")[0]

    with use_config(config):
        fwd()  # plan tables and round layouts cached, as after the benchmark's warm-up
        counter = LiveBytes(*leaves, do)
        with counter:
            torch.autograd.grad(fwd(), leaves, do)
    size, dims = sizes(a.B, a.T, a.H, a.K, a.V, a.C)
    R = delta.state_interval((a.T,) * a.B, a.C)
    assert (dims["NK"], dims["NS"]) == (sum(delta.checkpoint_counts((a.T,) * a.B, a.C)), a.B * min(R, -(-a.T // a.C)))
    kinds = {seq: kind(rec, size, dims) for seq, rec in counter.records.items()}
    counts = [sum((Counter({kinds[s][0]: kinds[s][1]}) for s in live), Counter()) for live in counter.events]
    top = max(range(len(counts)), key=lambda i: sum(size[u] * m for u, m in counts[i].items()))
    assert sum(size[u] * m for u, m in counts[top].items()) == counter.peak  # the kinds account for every byte
    live = sorted(counter.events[top], key=lambda s: -counter.records[s]["nbytes"])  # event i: after record i
    print(f"peak {counter.peak / 2**20:.3f} MiB (B={a.B} T={a.T} H={a.H} K={a.K} V={a.V} C={a.C}), at "
          f"{counter.records[top]['line']} ({counter.records[top]['op']}), {len(live)} storages live:")
    for s in live[:24]:
        rec = counter.records[s]
        print(f"  {rec['nbytes'] / 2**20:9.3f} MiB {str(tuple(rec['shape'])):22} {rec['dtype']:9} {kinds[s][0]:6} {rec['line']}")
    replayed = {}
    for T, B in BENCH:
        at, _ = sizes(B, T, 16, 64, 64, 128)
        peaks = [sum(at[u] * m for u, m in c.items()) for c in counts]
        i = max(range(len(peaks)), key=peaks.__getitem__)
        terms = " + ".join(f"{m}·{u}" if u != "BYTE" else f"{m} B" for u, m in counts[i].most_common())
        replayed[T] = dict(B=B, gib=peaks[i] / GiB, at=counter.records[i]["line"], terms=terms)
        print(f"T={T:6d} B={B:2d} (H=16, K=V=64, C=128): {peaks[i] / GiB:6.2f} GiB at {counter.records[i]['line']} = {terms}")
    result = dict(args=vars(a), peak_bytes=counter.peak, live=[dict(counter.records[s], kind=kinds[s][0]) for s in live],
                  replayed=replayed)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
