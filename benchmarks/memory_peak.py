"""The peak memory of a forward + backward on the Triton kernels, counted on the CPU and carried to the GPU
benchmark's shapes: DeltaKATA-M1 on its chunk path (`--op deltakata_m1`) and log-linear Gated DeltaNet
(`--op loglinear_gdn`), called as `python -m polyattn.bench kernels` calls them.

A `TorchDispatchMode` registers every storage an op returns, with a weak finalizer that fires when the storage is
freed, and keeps the running sum of live bytes: at each allocation, which storages are alive. That is what the
GPU caching allocator's `max_memory_allocated` counts (live blocks), so the peak is device-independent; the kernels
run under `TRITON_INTERPRET=1`. Custom ops (`torch.library.custom_op`) run their Python implementation under the
mode, and an op that reaches it whole with a composite decomposition (matmul, einsum inside a custom op) runs that
decomposition, so that the copies inside them are counted. The interpreter keeps each launch's arguments in reference
cycles, so the garbage collector runs after every launch (a GPU launch holds nothing after it returns).

Every counted storage is one of a few kinds, a dtype and a size that is a formula in the shapes (an fp32 `[C, C]`
tile per chunk and head, fp32 or bf16 rows per token and head, one state per checkpoint, round slot or sequence,
...); the kinds must differ at the counted shape, which the script checks. The live set after each allocation, as
counts of those kinds, does not depend on the shapes (the same code runs in the same order), so the peak at the
benchmark's shapes is the largest of those counts times the kinds' sizes there. Checked against the H200: the
replay of a DeltaKATA run of the code of call 25 gave that call's measured peaks (17.92 / 12.41 / 10.09 / 17.96 GiB
at 2K / 8K / 32K / 128K) to 0.01 GiB; for log-linear GDN a count at a second shape is predicted by the first's
replay to the bytes of one small index tensor.

usage: TRITON_INTERPRET=1 python benchmarks/memory_peak.py [--op deltakata_m1] [--B ... --T ... --H ... --K ... --V ...
--C ...] [--out FILE.json]   (a minute or two; each op's defaults keep its benchmark's structure at 2K: DeltaKATA's
32 chunks a sequence, log-linear GDN's several levels and checkpoint rounds)
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
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch._library.custom_ops import OPDEFS
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from polyattn import ops
from polyattn.ops.common import num_levels
from polyattn.ops.triton.plan import get_config, use_config

GiB = 2**30
BENCH = [(2048, 32), (8192, 8), (32768, 2), (131072, 1)]  # (T, B): 65,536 tokens a call (131,072 at 128K), H = 16
DTYPE_BYTES = dict(float32=4, bfloat16=2, int64=8, int32=4, bool=1)


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


def deltakata_dims(B, T, H, K, V, C):
    """DeltaKATA-M1: P = K^2 lifted features, R the state interval (`delta.state_interval`'s rule), NK checkpoints,
    NS round slots."""
    c = -(-T // C)
    R = max(1, math.ceil(math.sqrt(c / 2)))
    return dict(n=B * T * H, NT=B * T, NC=B * c, N=B, H=H, K=K, V=V, C=C, P=K * K, NK=B * -(-c // R),
                NS=B * min(R, c) if R > 1 else B * c)


DELTAKATA_KINDS = dict(  # kind: (dtype, elements)
    CC=("float32", lambda d: d["NC"] * d["H"] * d["C"] ** 2),  # [C, C] per chunk and head
    RV=("float32", lambda d: d["n"] * d["V"]), RK=("float32", lambda d: d["n"] * d["K"]),  # rows per token and head
    BV=("bfloat16", lambda d: d["n"] * d["V"]), BK=("bfloat16", lambda d: d["n"] * d["K"]),
    ST_NK=("float32", lambda d: d["NK"] * d["H"] * d["P"] * d["V"]),  # lifted states: checkpoints,
    ST_NS=("float32", lambda d: d["NS"] * d["H"] * d["P"] * d["V"]),  # round slots,
    ST_N=("float32", lambda d: d["N"] * d["H"] * d["P"] * d["V"]),  # one per sequence
    Z_NS=("float32", lambda d: d["NS"] * d["H"] * d["P"]),
    VEC=("float32", lambda d: d["n"]), VECB=("bfloat16", lambda d: d["n"]), CH=("float32", lambda d: d["NC"] * d["H"]),
    TOK8=("int64", lambda d: d["NT"]), TOK4=("int32", lambda d: d["NT"]), TOK1=("bool", lambda d: d["NT"]),
)


def gdn_dims(B, T, H, K, V, C):
    """Log-linear GDN: L = num_levels(T) level weights, NLC chunk-levels, rows = the grid's chunk rows a sequence
    (one more than its chunks), S = ⌊√rows⌋ the checkpoint interval (`gdn_state_interval`'s default), NB
    checkpoints, nvg value tiles of 32 in the level backward."""
    L = num_levels(T)
    rows = -(-T // C) + 1
    S = max(1, math.isqrt(rows))
    return dict(n=B * T * H, NT=B * T, NC=B * rows, N=B, H=H, K=K, V=V, C=C, L=L, NLC=max(L - C.bit_length(), 1), S=S,
                NB=B * -(-rows // S), nvg=-(-V // min(32, V)))


GDN_KINDS = dict(
    RD=("float32", lambda d: d["n"] * d["K"]), BD=("bfloat16", lambda d: d["n"] * d["K"]),  # rows (K = V)
    RC=("float32", lambda d: d["n"] * d["C"]),  # Tinv rows
    CC=("float32", lambda d: d["NC"] * d["H"] * d["C"] ** 2),
    ST=("float32", lambda d: d["N"] * d["H"] * d["NLC"] * d["K"] * d["V"]),  # level states: one set per sequence,
    CK=("float32", lambda d: d["NB"] * d["H"] * d["NLC"] * d["K"] * d["V"]),  # the checkpoints,
    HS=("float32", lambda d: d["N"] * d["H"] * d["S"] * d["NLC"] * d["K"] * d["V"]),  # a round's states
    XS=("float32", lambda d: d["N"] * d["H"] * d["S"] * d["NLC"] * d["C"] * d["V"]),  # a round's x, dx
    LAMVG=("float32", lambda d: d["nvg"] * d["n"] * d["L"]), LAM=("float32", lambda d: d["n"] * d["L"]),
    LAMB=("bfloat16", lambda d: d["n"] * d["L"]),
    VEC=("float32", lambda d: d["n"]), VECB=("bfloat16", lambda d: d["n"]),
    CHVG=("float32", lambda d: d["nvg"] * d["NC"] * d["H"]), CH=("float32", lambda d: d["NC"] * d["H"]),
    CHI=("int32", lambda d: d["NC"] * d["H"]),
)


class Op(NamedTuple):
    dims: Callable
    kinds: dict
    small: dict  # the counted shape's defaults
    bench: dict  # H, K, V, C of the benchmark
    config: Callable  # KernelConfig at chunk size C


OPS = dict(
    deltakata_m1=Op(deltakata_dims, DELTAKATA_KINDS, dict(B=2, T=1024, H=2, K=16, V=32, C=64), dict(H=16, K=64, V=64, C=128),
                    lambda c, C: dataclasses.replace(c, deltakata_chunk_size=C, kata_read_block=min(C, c.kata_read_block))),
    loglinear_gdn=Op(gdn_dims, GDN_KINDS, dict(B=2, T=640, H=1, K=128, V=128, C=64), dict(H=16, K=128, V=128, C=64),
                     lambda c, C: dataclasses.replace(c, chunk_size=C)),
)


def sizes(op: Op, **shape) -> dict:
    d = op.dims(**shape)
    return {name: DTYPE_BYTES[dtype] * numel(d) for name, (dtype, numel) in op.kinds.items()}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--op", choices=list(OPS), default="deltakata_m1")
    for name in ("B", "T", "H", "K", "V", "C"):
        ap.add_argument(f"--{name}", type=int, default=None, help="default: the op's counted shape")
    ap.add_argument("--out", default=None, help="JSON: the peak, the live set there and the replayed peaks")
    a = ap.parse_args(argv)
    op = OPS[a.op]
    shape = {n: getattr(a, n) if getattr(a, n) is not None else op.small[n] for n in op.small}
    import triton.runtime.interpreter as interpreter

    launch = interpreter.GridExecutor.__call__

    def launch_and_collect(self, *args, **kwargs):
        try:
            return launch(self, *args, **kwargs)
        finally:
            gc.collect()

    interpreter.GridExecutor.__call__ = launch_and_collect
    try:
        return count(a.op, shape, a.out)
    finally:
        interpreter.GridExecutor.__call__ = launch


def count(name: str, shape: dict, out: str | None) -> dict:
    """`main` after the arguments: count, replay, print, and return what `--out` writes."""
    op = OPS[name]
    B, T, H, K, V, C = (shape[n] for n in ("B", "T", "H", "K", "V", "C"))
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(B, T, H, K, generator=gen).bfloat16() for _ in range(2))
    k = F.normalize(k.float(), dim=-1).bfloat16()
    v = torch.randn(B, T, H, V, generator=gen).bfloat16()
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen) + 4.0)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen)).bfloat16()
    do = torch.randn(B, T, H, V, generator=gen).bfloat16()
    leaves = [q, k, v, g, beta]
    if name == "loglinear_gdn":  # as the benchmark: scale 1, lam the softplus of a normal draw, num_levels(T) columns
        lam = F.softplus(torch.randn(B, T, H, num_levels(T), generator=gen)).bfloat16()
        leaves.append(lam)

        def fwd():
            return ops.loglinear_attn(q, k, v, lam, g, beta=beta, scale=1.0, impl="triton")[0]
    else:
        def fwd():
            return ops.kata(q, k, v, g, beta=beta, groups=1, combine="concat", normalize=False, impl="triton_chunk")[0]
    for x in leaves:
        x.requires_grad_()
    with use_config(op.config(get_config(), C)):
        fwd()  # plan tables and round layouts cached, as after the benchmark's warm-up
        counter = LiveBytes(*leaves, do)
        with counter:
            torch.autograd.grad(fwd(), leaves, do)
    size = sizes(op, **shape)
    by_size = {(op.kinds[u][0], n): u for u, n in size.items()}
    assert len(by_size) == len(size), f"two kinds alike at this shape: {size}"
    kinds = {s: ((by_size[key], 1) if (key := (r["dtype"], r["nbytes"])) in by_size else ("BYTE", r["nbytes"]))
             for s, r in counter.records.items()}
    counts = [sum((Counter({kinds[s][0]: kinds[s][1]}) for s in live), Counter()) for live in counter.events]
    size["BYTE"] = 1
    top = max(range(len(counts)), key=lambda i: sum(size[u] * m for u, m in counts[i].items()))
    assert sum(size[u] * m for u, m in counts[top].items()) == counter.peak  # the kinds account for every byte
    live = sorted(counter.events[top], key=lambda s: -counter.records[s]["nbytes"])  # event i: after record i
    print(f"{name}: peak {counter.peak / 2**20:.3f} MiB ({' '.join(f'{n}={x}' for n, x in shape.items())}), at "
          f"{counter.records[top]['line']} ({counter.records[top]['op']}), {len(live)} storages live:")
    for s in live[:24]:
        rec = counter.records[s]
        print(f"  {rec['nbytes'] / 2**20:9.3f} MiB {str(tuple(rec['shape'])):24} {rec['dtype']:9} {kinds[s][0]:6} {rec['line']}")
    replayed = {}
    for T_, B_ in BENCH:
        at = sizes(op, B=B_, T=T_, **op.bench)
        at["BYTE"] = 1
        peaks = [sum(at[u] * m for u, m in c.items()) for c in counts]
        i = max(range(len(peaks)), key=peaks.__getitem__)
        terms = " + ".join(f"{m}·{u}" if u != "BYTE" else f"{m} B" for u, m in counts[i].most_common())
        replayed[T_] = dict(B=B_, gib=peaks[i] / GiB, at=counter.records[i]["line"], terms=terms)
        print(f"T={T_:6d} B={B_:2d} ({', '.join(f'{n}={x}' for n, x in op.bench.items())}): {peaks[i] / GiB:6.2f} GiB at "
              f"{counter.records[i]['line']} = {terms}")
    result = dict(op=name, shape=shape, peak_bytes=counter.peak, live=[dict(counter.records[s], kind=kinds[s][0]) for s in live],
                  replayed=replayed)
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
