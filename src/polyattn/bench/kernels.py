"""`python -m polyattn.bench kernels`: linear attention, the delta rule, HLA2, log-linear Mamba-2 and
KATA against SDPA and fla.

Standard shape: bf16, H = 16, K = V in {128, 64}, B = 65,536 // T sequences (B = 1 at 128K),
T from 2K to 128K; forward and forward + backward, each row with its time and its peak memory (what
one more call allocates above its inputs, `peak_gib`). FLOP and byte counts follow the formulas of
ops/linear/README.md ("Triton kernels"): per token and head, forward FLOPs `2C(K+V) + 4KV`
(chunk C = 64), minimum forward bytes `(2K + 2V) * 2` (read q, k, v, write o), fwd+bwd FLOPs 3x
forward and bytes `(5K + 6V) * 2` (forward, then read q, k, v, do and write dq, dk, dv).
The delta rule (ops/delta/README.md, "Cost") adds the `K K^T` of the solve and the `K h` read:
forward FLOPs `2 (2C(K+V) + 3KV)`, the same minimum bytes. KATA's quadratic kernel
(ops/kata/README.md, "Triton kernel") counts its products per causal pair, `T/2` pairs per token:
forward `T (K' + V)`, fwd+bwd `T (5K' + 4V)` FLOPs per token and head, `K' = K` for KATA-Mg and
`groups·K` for KATA-Σg (the split halves of fp32 tiles not counted); the same minimum bytes. Its chunked
form (`polyattn-triton-chunk`) counts the pairs inside a chunk, `min(T, CS) (K' + V)`, and the lifted
write and read, `4 P (V + 1)` (P lifted features, ops/kata/README.md, "Chunked Triton kernel"); fwd+bwd
`min(T, CS) (5K' + 4V) + 14 P (V + 1)`: the forward's write and read, the backward's rerun of the write,
its reverse walk, the two lift gradients and the read of the state gradients ("Chunked backward").
Log-linear Mamba-2 (ops/loglinear/README.md,
"Triton kernels"; `scale = 1`, lam = softplus of a normal draw, `num_levels(T)` columns, differentiated)
reads about half of its `NL = log2(T / C)` chunk-levels per token: forward FLOPs
`2C(K+V) + 2KV (1 + NL / 2)`, fwd+bwd 3x forward plus the two anticausal passes' per-level adds
`2KV NL`; bytes add lam (and dlam) at `2L` bytes per token. First-order KATA and DeltaKATA
(`kata_lorentz`, `deltakata_lorentz`: the Lorentz map, P = K, on the linear and delta-rule kernels in
fp32) count as linear attention and the delta rule (the normaliser column and the lift not counted).
DeltaKATA's chunked form (`deltakata_m1`, `deltakata_m2`, with g and beta; ops/kata/triton/delta.py) counts per
token and head its two reads and one write of the `[P, V]` state and the chunk's two `[C, C]` products (C =
`deltakata_chunk_size`): forward `6PV + 4CV`; fwd+bwd adds the reverse walk (`6PV + 4CV`) and three lift
gradients (`2PV` each): `18PV + 8CV` (the split halves of fp32 operands not counted).
Log-linear Gated DeltaNet (`loglinear_gdn`; fwd+bwd counted as three forwards, the backward's rerun
of the forward walk not counted) counts the delta rule's forward, the chunk's `A Tinv` (`2C^2`) and per chunk-level `W h` and the carry
(`4KV`), half of the levels also a read (`2KV`): `2 (2C(K+V) + 3KV) + 2C^2 + 5KV NL`; bytes as
log-linear Mamba-2's.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from polyattn.bench.timing import device_line, error_entry, try_bench, write_rows

T_GRID = (2048, 4096, 8192, 16384, 32768, 65536, 131072)
TOKENS = 65536
H = 16
CHUNK = 64


OPS = ("linear_attn", "linear_attn_decay", "delta_rule", "hla2", "hla2_decay", "loglinear_mamba2", "loglinear_gdn", "kata_m1",
       "kata_m2", "kata_s2", "kata_lorentz", "deltakata_lorentz", "deltakata_m1", "deltakata_m2", "softmax")


@dataclass(frozen=True)
class Case:
    op: str  # one of OPS
    impl: str
    make: object  # (q, k, v, g, beta) -> callable returning the output tensor


GATED = ("linear_attn_decay", "hla2_decay", "delta_rule", "loglinear_mamba2", "loglinear_gdn", "kata_lorentz",
         "deltakata_lorentz", "deltakata_m1", "deltakata_m2")  # fwd+bwd differentiates g
WITH_BETA = ("delta_rule", "loglinear_gdn", "deltakata_lorentz", "deltakata_m1", "deltakata_m2")  # ops whose fwd+bwd differentiates beta
KATA = {"kata_m1": (1, "concat"), "kata_m2": (2, "concat"), "kata_s2": (2, "sum")}  # op -> (groups, combine)
DELTAKATA = {"deltakata_m1": (1, "concat"), "deltakata_m2": (2, "concat")}  # op -> (groups, combine)


def _with_levels(call):
    """A maker for a log-linear op `call(q, k, v, g, lam, beta)`: lam `[B, T, H, num_levels(T)]` bf16 (a
    leaf of the backward, like q), exposed to `measure` as the callable's `extra_leaves`."""
    from polyattn.ops.common import num_levels

    def make(q, k, v, g, beta):
        B, T = q.shape[:2]
        gen = torch.Generator(device="cuda").manual_seed(1)
        lam = F.softplus(torch.randn(B, T, H, num_levels(T), device="cuda", generator=gen)).to(torch.bfloat16)
        lam.requires_grad_(q.requires_grad)

        def run():
            return call(q, k, v, g, lam, beta)

        run.extra_leaves = [lam]
        return run

    return make


def fla_op(name: str):
    """fla's `fla.ops.<name>`, or None where fla is not installed."""
    try:
        return getattr(importlib.import_module("fla.ops"), name)
    except (ImportError, AttributeError):
        return None


def _sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def make(q, k, v, g, beta):
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [B, T, H, D] -> [B, H, T, D]

        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

        return run

    return make


def cases() -> list[Case]:
    from torch.nn.attention import SDPBackend

    from polyattn import ops

    out = [
        Case("linear_attn", "polyattn-triton", lambda q, k, v, g, b: lambda: ops.linear_attn(q, k, v, impl="triton")[0]),
        Case("linear_attn_decay", "polyattn-triton", lambda q, k, v, g, b: lambda: ops.linear_attn(q, k, v, g, impl="triton")[0]),
        Case("delta_rule", "polyattn-triton", lambda q, k, v, g, b: lambda: ops.delta_rule(q, k, v, b, g, impl="triton")[0]),
        Case("hla2", "polyattn-triton", lambda q, k, v, g, b: lambda: ops.hla(q, k, v, impl="triton")[0]),
        Case("hla2_decay", "polyattn-triton", lambda q, k, v, g, b: lambda: ops.hla(q, k, v, g, impl="triton")[0]),
        Case("loglinear_mamba2", "polyattn-triton",
             _with_levels(lambda q, k, v, g, lam, b: ops.loglinear_attn(q, k, v, lam, g, scale=1.0, impl="triton")[0])),
        Case("loglinear_gdn", "polyattn-triton",
             _with_levels(lambda q, k, v, g, lam, b: ops.loglinear_attn(q, k, v, lam, g, beta=b, scale=1.0, impl="triton")[0])),
    ]
    out += [
        Case(op, "polyattn-triton-parallel",
             lambda q, k, v, g, b, G=G, c=c: lambda: ops.kata(q, k, v, groups=G, combine=c, impl="triton_parallel")[0])
        for op, (G, c) in KATA.items()
    ]
    out += [  # the chunked lifted-state form
        Case(op, "polyattn-triton-chunk",
             lambda q, k, v, g, b, G=G, c=c: lambda: ops.kata(q, k, v, groups=G, combine=c, impl="triton_chunk")[0])
        for op, (G, c) in KATA.items()
    ]
    out += [  # DeltaKATA's chunked kernel-trick form, with decay
        Case(op, "polyattn-triton-chunk", lambda q, k, v, g, b, G=G, c=c: lambda: ops.kata(
            q, k, v, g, beta=b, groups=G, combine=c, normalize=False, impl="triton_chunk")[0])
        for op, (G, c) in DELTAKATA.items()
    ]
    out += [  # first-order KATA and DeltaKATA (P = K) on the linear and delta-rule kernels, in fp32
        Case("kata_lorentz", "polyattn-triton",
             lambda q, k, v, g, b: lambda: ops.kata(q, k, v, g, feature="lorentz", impl="triton")[0]),
        Case("deltakata_lorentz", "polyattn-triton",
             lambda q, k, v, g, b: lambda: ops.kata(q, k, v, g, feature="lorentz", beta=b, normalize=False, impl="triton")[0]),
    ]
    out += [
        Case("softmax", "sdpa-flash", _sdpa(SDPBackend.FLASH_ATTENTION)),
        Case("softmax", "sdpa-cudnn", _sdpa(SDPBackend.CUDNN_ATTENTION)),
    ]
    chunk_linear_attn, chunk_simple_gla = fla_op("chunk_linear_attn"), fla_op("chunk_simple_gla")
    chunk_gated_delta_rule = fla_op("chunk_gated_delta_rule")
    chunk_log_linear_attn = fla_op("chunk_log_linear_attn")
    if chunk_linear_attn is not None:
        out.append(Case("linear_attn", "fla-chunk_linear_attn",
                        lambda q, k, v, g, b: lambda: chunk_linear_attn(q, k, v, normalize=False)[0]))
    if chunk_simple_gla is not None:
        out.append(Case("linear_attn_decay", "fla-chunk_simple_gla", lambda q, k, v, g, b: lambda: chunk_simple_gla(q, k, v, g)[0]))
    if chunk_gated_delta_rule is not None:
        out.append(Case("delta_rule", "fla-chunk_gated_delta_rule",
                        lambda q, k, v, g, b: lambda: chunk_gated_delta_rule(q, k, v, g, b)[0]))
    if chunk_log_linear_attn is not None:  # q, k with one group per head (G = H), scale 1 as ours
        out.append(Case("loglinear_mamba2", "fla-chunk_log_linear_attn",
                        _with_levels(lambda q, k, v, g, lam, b: chunk_log_linear_attn(q, k, v, g, lam, scale=1.0)[0])))
    return out


def flops_bytes(op: str, mode: str, tokens: int, K: int, V: int, T: int | None = None, impl: str = "") -> tuple[float, float]:
    """FLOPs and minimum bytes of one call (the module docstring); HLA2 counts two linear calls;
    KATA's quadratic kernel its products per causal pair, its chunked form those inside a chunk
    (`plan.kata_state_chunk`) and the lifted write and read. T: the sequence length (log-linear
    attention's level count, KATA's pairs; default `tokens`)."""
    if op in DELTAKATA:
        from polyattn.ops.kata import make_feature_map
        from polyattn.ops.triton.plan import get_config

        P, C = make_feature_map("psd", K, *DELTAKATA[op]).dim(), get_config().deltakata_chunk_size
        flops = 6 * P * V + 4 * C * V if mode == "fwd" else 18 * P * V + 8 * C * V
        return flops * tokens * H, ((2 * K + 2 * V) * 2 if mode == "fwd" else (5 * K + 6 * V) * 2) * tokens * H
    if op in KATA:
        T = T or tokens
        Kp = K * KATA[op][0] if KATA[op][1] == "sum" else K
        if impl == "polyattn-triton-chunk":
            from polyattn.ops.kata import make_feature_map
            from polyattn.ops.triton.plan import get_config, kata_state_chunk

            P = make_feature_map("psd", K, *KATA[op]).dim()
            pairs = min(T, kata_state_chunk(get_config(), P))
            if mode == "fwd":
                return (pairs * (Kp + V) + 4 * P * (V + 1)) * tokens * H, (2 * K + 2 * V) * 2 * tokens * H
            return (pairs * (5 * Kp + 4 * V) + 14 * P * (V + 1)) * tokens * H, (5 * K + 6 * V) * 2 * tokens * H
        flops = T * (Kp + V) if mode == "fwd" else T * (5 * Kp + 4 * V)
        bytes_ = (2 * K + 2 * V) * 2 if mode == "fwd" else (5 * K + 6 * V) * 2
        return flops * tokens * H, bytes_ * tokens * H
    fwd_flops = 2 * CHUNK * (K + V) + 4 * K * V
    if op in WITH_BETA:
        fwd_flops = 2 * (2 * CHUNK * (K + V) + 3 * K * V)
    fwd_bytes = (2 * K + 2 * V) * 2
    flops, bytes_ = (fwd_flops, fwd_bytes) if mode == "fwd" else (3 * fwd_flops, (5 * K + 6 * V) * 2)
    if op.startswith("loglinear"):
        T = T or tokens
        NL = max(1, (T // CHUNK - 1).bit_length())
        L = (T - 1).bit_length() + 1
        fwd_flops = 2 * CHUNK * (K + V) + 2 * K * V * (1 + NL / 2)
        flops = fwd_flops if mode == "fwd" else 3 * fwd_flops + 2 * K * V * NL
        bytes_ = fwd_bytes + 2 * L if mode == "fwd" else (5 * K + 6 * V) * 2 + 4 * L
    if op == "loglinear_gdn":  # the delta rule's forward, and per level W h and the carry, half of them a read
        fwd_flops = 2 * (2 * CHUNK * (K + V) + 3 * K * V) + 2 * CHUNK * CHUNK + 2 * K * V * 2.5 * NL
        flops = fwd_flops if mode == "fwd" else 3 * fwd_flops
    if op.startswith("hla2"):
        flops *= 2
    return flops * tokens * H, bytes_ * tokens * H


def inputs(B, T, D, requires_grad, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    k = F.normalize(k.float(), dim=-1).to(torch.bfloat16)  # unit keys: the delta rule's contractive regime
    g = F.logsigmoid(torch.randn(B, T, H, device="cuda", generator=gen) + 4.0)  # [B, T, H], log-decay < 0
    beta = torch.sigmoid(torch.randn(B, T, H, device="cuda", generator=gen)).to(torch.bfloat16)  # [B, T, H]
    if requires_grad:
        for x in (q, k, v, g, beta):
            x.requires_grad_(True)
    return q, k, v, g, beta


def leaves(case: Case, fn, q, k, v, g, beta) -> list:
    """The tensors a fwd+bwd of `case` differentiates: q, k, v, g for the gated ops, beta for the delta
    rules, and the maker's `extra_leaves` (log-linear lam)."""
    out = [q, k, v] + ([g] if case.op in GATED else []) + ([beta] if case.op in WITH_BETA else [])
    return out + getattr(fn, "extra_leaves", [])


def measure(case: Case, B: int, T: int, D: int, mode: str, timed: bool = True) -> float | str:
    """ms of one call (fwd, or fwd+bwd), or the error entry of a case that cannot run."""
    return measure_row(case, B, T, D, mode, timed)[0]


def row_call(case: Case, q, k, v, g, beta, mode: str):
    """One call of a row on these inputs: the forward without autograd (`fwd`), or the forward and the backward
    into every leaf the row differentiates, from a fixed random output gradient (`fwdbwd`)."""
    fn = case.make(q, k, v, g, beta)
    if mode == "fwd":
        def call():
            with torch.no_grad():
                return fn()
        return call
    grad_leaves = leaves(case, fn, q, k, v, g, beta)
    do = torch.randn_like(fn())
    return lambda: torch.autograd.grad(fn(), grad_leaves, do)


def measure_row(case: Case, B: int, T: int, D: int, mode: str, timed: bool = True) -> tuple[float | str, int | None]:
    """`(ms or an error entry, peak bytes)`: the peak is what one more call allocates above what was
    allocated before it (inputs, `do`), None off CUDA or when the case cannot run."""
    q, k, v, g, beta = inputs(B, T, D, requires_grad=mode == "fwdbwd")
    bench = try_bench if timed else (lambda fn: fn())
    try:
        call = row_call(case, q, k, v, g, beta, mode)
        ms = bench(call)
        return ms, peak_bytes(call) if isinstance(ms, float) else None
    except Exception as exc:  # noqa: BLE001 -- an anchor that cannot run is a table entry
        return error_entry(exc), None
    finally:
        del q, k, v, g, beta
        torch.cuda.empty_cache()


def peak_bytes(call) -> int | None:
    """Bytes `call()` allocates at its peak above what is allocated before it (CUDA; else None)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    call()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def compile_only(dims=(128, 64), t_grid=T_GRID, ops=None) -> None:
    """Run each polyattn case (of `ops`, default all) once per mode at the shortest and longest T
    (with and without the segment split) so that Triton compiles every kernel variant; no timing."""
    for D in dims:
        for T in sorted({min(t_grid), max(t_grid)}):
            for case in cases():
                if case.impl.startswith("polyattn") and (ops is None or case.op in ops):
                    for mode in ("fwd", "fwdbwd"):
                        measure(case, max(1, TOKENS // T), T, D, mode, timed=False)
    torch.cuda.synchronize()


def run(out: Path, dims=(128, 64), t_grid=T_GRID, modes=("fwd", "fwdbwd"), impls=None, ops=None,
        skip=()) -> list[dict]:
    """Time every case (or those whose impl is in `impls` and op in `ops`) at every (D, T, mode) not
    in `skip` (a set of `(impl, D)`), write kernels.json / kernels.md / kernels.png into `out`."""
    rows = []
    all_cases = [c for c in cases() if (impls is None or c.impl in impls) and (ops is None or c.op in ops)]
    print(device_line(), flush=True)
    for D in dims:
        for T in t_grid:
            B = max(1, TOKENS // T)
            for mode in modes:
                for case in all_cases:
                    if (case.impl, D) in skip:
                        continue
                    ms, peak = measure_row(case, B, T, D, mode)
                    row = dict(op=case.op, impl=case.impl, T=T, B=B, H=H, K=D, V=D, mode=mode, ms=ms,
                               peak_gib=None if peak is None else peak / 2**30)
                    if isinstance(ms, float):
                        flops, bytes_ = flops_bytes(case.op, mode, B * T, D, D, T=T, impl=case.impl)
                        row.update(tokens_per_s=B * T / ms * 1e3)
                        if case.op != "softmax":
                            row.update(tflops=flops / ms * 1e-9, gbps=bytes_ / ms * 1e-6)
                    rows.append(row)
                    shown = ms if isinstance(ms, str) else f"{ms:9.3f} ms"
                    print(f"D{D} T{T:>6} B{B:>2} {mode:6} {case.op:18} {case.impl:22} {shown}", flush=True)
            write_rows(rows, out, "kernels")
    report(rows, out, device_line())
    return rows


def report(rows: list[dict], out: Path, device: str) -> None:
    """kernels.json, kernels.md (ratios + all times) and kernels.png from measured rows."""
    write_rows(rows, out, "kernels")
    (out / "kernels.md").write_text(ratio_table(rows, device))
    plot(rows, out / "kernels.png")


def _ms(rows, field="ms", **key):
    """`field` of the measured row matching `key` (None when absent, failed or not recorded)."""
    for r in rows:
        if all(r[k] == v for k, v in key.items()) and isinstance(r["ms"], float):
            return r.get(field)
    return None


RATIOS = (  # (our op, our impl, anchor op, anchor impl)
    ("linear_attn", "polyattn-triton", "linear_attn", "fla-chunk_linear_attn"),
    ("linear_attn", "polyattn-triton", "softmax", "sdpa-flash"),
    ("linear_attn", "polyattn-triton", "softmax", "sdpa-cudnn"),
    ("linear_attn_decay", "polyattn-triton", "linear_attn_decay", "fla-chunk_simple_gla"),
    ("linear_attn_decay", "polyattn-triton", "linear_attn", "polyattn-triton"),
    ("delta_rule", "polyattn-triton", "delta_rule", "fla-chunk_gated_delta_rule"),
    ("hla2", "polyattn-triton", "linear_attn", "polyattn-triton"),
    ("hla2_decay", "polyattn-triton", "linear_attn_decay", "polyattn-triton"),
    ("kata_m1", "polyattn-triton-parallel", "softmax", "sdpa-flash"),
    ("kata_m1", "polyattn-triton-parallel", "softmax", "sdpa-cudnn"),
    ("kata_m2", "polyattn-triton-parallel", "softmax", "sdpa-flash"),
    ("kata_s2", "polyattn-triton-parallel", "softmax", "sdpa-flash"),
    ("kata_m1", "polyattn-triton-chunk", "softmax", "sdpa-flash"),
    ("kata_m2", "polyattn-triton-chunk", "softmax", "sdpa-flash"),
    ("kata_m2", "polyattn-triton-chunk", "softmax", "sdpa-cudnn"),
    ("kata_s2", "polyattn-triton-chunk", "softmax", "sdpa-flash"),
    ("kata_m2", "polyattn-triton-chunk", "kata_m2", "polyattn-triton-parallel"),
    ("loglinear_mamba2", "polyattn-triton", "loglinear_mamba2", "fla-chunk_log_linear_attn"),
    ("loglinear_mamba2", "polyattn-triton", "linear_attn_decay", "polyattn-triton"),
    ("loglinear_mamba2", "polyattn-triton", "softmax", "sdpa-cudnn"),
    ("loglinear_gdn", "polyattn-triton", "delta_rule", "polyattn-triton"),
    ("loglinear_gdn", "polyattn-triton", "softmax", "sdpa-cudnn"),
    ("loglinear_gdn", "polyattn-triton", "linear_attn_decay", "polyattn-triton"),
    ("kata_lorentz", "polyattn-triton", "linear_attn_decay", "polyattn-triton"),
    ("deltakata_lorentz", "polyattn-triton", "delta_rule", "polyattn-triton"),
    ("deltakata_m1", "polyattn-triton-chunk", "kata_m1", "polyattn-triton-chunk"),
    ("deltakata_m2", "polyattn-triton-chunk", "kata_m2", "polyattn-triton-chunk"),
    ("deltakata_m1", "polyattn-triton-chunk", "softmax", "sdpa-flash"),
)


def ratio_table(rows: list[dict], device: str) -> str:
    """Markdown: ratio ours / anchor per T (< 1: ours is faster) of the time and of the peak memory
    (rows that recorded it), then every measured ms."""
    lines = [f"# kernels ({device})", ""]
    for D in sorted({r["K"] for r in rows}, reverse=True):
        ts = sorted({r["T"] for r in rows if r["K"] == D})
        head = " | ".join(f"{t // 1024}K" for t in ts)
        lines += [f"## K = V = {D}, H = {H}, bf16, B*T = {TOKENS}", "", f"| ours | anchor | mode | {head} |",
                  "|---|---|---|" + "---|" * len(ts)]
        for field, what in (("ms", ""), ("peak_gib", "peak memory, ")):
            for ours, our_impl, anchor_op, anchor in RATIOS:
                for mode in ("fwd", "fwdbwd"):
                    cells = []
                    for t in ts:
                        a = _ms(rows, field, op=ours, impl=our_impl, T=t, K=D, mode=mode)
                        b = _ms(rows, field, op=anchor_op, impl=anchor, T=t, K=D, mode=mode)
                        cells.append(f"{a / b:.2f}x" if a and b else "-")
                    if set(cells) == {"-"}:
                        continue  # neither side measured at this D
                    lines.append(f"| {ours} / {our_impl} | {anchor_op} / {anchor} | {what}{mode} | " + " | ".join(cells) + " |")
        lines += ["", f"| op | impl | mode | {head} |", "|---|---|---|" + "---|" * len(ts)]
        for op, impl in sorted({(r["op"], r["impl"]) for r in rows if r["K"] == D}):
            for mode in ("fwd", "fwdbwd"):
                cells = []
                for t in ts:
                    r = next((r for r in rows if (r["op"], r["impl"], r["T"], r["K"], r["mode"]) == (op, impl, t, D, mode)), None)
                    cells.append("-" if r is None else (f"{r['ms']:.3f}" if isinstance(r["ms"], float) else "error"))
                lines.append(f"| {op} | {impl} | {mode} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dims = sorted({r["K"] for r in rows}, reverse=True)
    fig, axes = plt.subplots(len(dims), 2, figsize=(12, 4.5 * len(dims)), squeeze=False)
    for i, D in enumerate(dims):
        for j, mode in enumerate(("fwd", "fwdbwd")):
            ax = axes[i][j]
            for op, impl in sorted({(r["op"], r["impl"]) for r in rows}):
                pts = [(r["T"], r["ms"]) for r in rows
                       if (r["op"], r["impl"], r["K"], r["mode"]) == (op, impl, D, mode) and isinstance(r["ms"], float)]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=f"{op} / {impl}")
            ax.set(xscale="log", yscale="log", xlabel="T (B*T = 65536)", ylabel="ms", title=f"K=V={D}, H={H}, bf16, {mode}")
            ax.grid(True, which="both", alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=7)
            else:  # a run of one mode leaves the other panel empty
                ax.text(0.5, 0.5, f"no {mode} rows in this run", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
