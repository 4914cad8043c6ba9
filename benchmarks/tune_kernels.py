"""Sweep the launch parameters (`KernelConfig`) of our Triton kernels on one GPU, anchors beside them.

python benchmarks/tune_kernels.py --ops linear_attn_decay [--configs 0 1 ...] [--set '{"num_warps": 8}' ...]
    [--anchors sdpa-flash ...] [--impls polyattn-triton-chunk ...] [--dims 128] [--seqlens 2048 ...] [--out results.json]
Every row of `python -m polyattn.bench kernels` (bf16, H = 16, B = 65536 // T), fwd and fwd+bwd, for each
config: `--configs` picks presets of the ops' family (PRESETS; default all), `--set` adds configs given as
JSON fields of KernelConfig. Anchors (any impl of the benchmark, e.g. sdpa-flash, fla-chunk_simple_gla)
are timed once, outside the configs. Prints a table of ms per (op, T, mode) and config, with each
config's ratio to the first anchor and its peak memory (`kernels.measure_row`: what one more call
allocates above its inputs); writes the rows as JSON.
"""
import argparse
import json
import sys

from polyattn.bench import kernels
from polyattn.ops.triton.plan import KernelConfig, use_config

PRESETS = {  # the launch parameters each family's kernels read
    "linear": [dict(), dict(num_warps=8), dict(num_stages=1), dict(num_stages=3), dict(block_c=128, num_warps=8),
               dict(block_c=32), dict(programs_per_sm=2), dict(programs_per_sm=4), dict(chunk_size=128, num_warps=8),
               dict(chunk_size=32), dict(decay_update_dot="split"), dict(states_block_c=64), dict(level_wide_warps=4), dict(level_programs_per_sm=4)],
    "delta": [dict(), dict(delta_block_v=64), dict(delta_num_warps=8), dict(delta_chunk_warps=4), dict(delta_out_block_v=32),
              dict(delta_narrow_per_sm=0), dict(delta_fp32_dot="rounded"), dict(gdn_block_v=64), dict(gdn_num_warps=4),
              dict(gdn_grads_warps=4), dict(gdn_state_interval=32),
              dict(delta_split_per_sm=0), dict(delta_split_backward=True), dict(delta_grad_block_v=64),
              dict(delta_grad_block_k=128, delta_chunk_warps=8), dict(delta_out_dot="split")],
    "kata": [dict(), dict(kata_score_dot="rounded"), dict(kata_num_warps=4, kata_bwd_warps=4), dict(kata_num_stages=3),
             dict(kata_score_dot="rounded", kata_num_stages=3),
             dict(kata_score_dot="rounded", kata_num_warps=4, kata_bwd_warps=8, kata_num_stages=3),
             dict(kata_block_m=64, kata_block_n=64, kata_num_warps=4, kata_bwd_warps=4), dict(kata_block_m=128, kata_block_n=32),
             dict(kata_block_m=128, kata_block_n=128, kata_num_stages=1), dict(kata_chunk_size=1024),
             dict(deltakata_block_v=16), dict(deltakata_chunk_size=64), dict(deltakata_state_interval=1)],
}


def family(op: str) -> str:
    """The preset family of a benchmark op: the kernels its polyattn impl runs."""
    if op.startswith(("kata_m", "kata_s", "deltakata_m")):
        return "kata"
    if op in ("delta_rule", "deltakata_lorentz", "loglinear_gdn"):
        return "delta"
    return "linear"  # linear attention, HLA, log-linear Mamba-2 and first-order KATA read the linear knobs


def configs_for(ops: list[str], chosen: list[int] | None, extra: list[str]) -> list[dict]:
    """The configs to sweep (KernelConfig fields): the chosen presets of the ops' one family, then `extra`."""
    families = {family(op) for op in ops}
    if len(families) != 1:
        raise SystemExit(f"--ops: expected ops of one kernel family (their presets differ), got {sorted(families)}")
    presets = PRESETS[families.pop()]
    if chosen is not None and any(not 0 <= i < len(presets) for i in chosen):
        raise SystemExit(f"--configs: expected indices below {len(presets)}, got {chosen}")
    out = [presets[i] for i in (chosen if chosen is not None else range(len(presets)))]
    for text in extra:
        fields = json.loads(text)
        KernelConfig(**fields)  # unknown fields raise here, before any work
        out.append(fields)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", nargs="+", required=True, choices=kernels.OPS)
    parser.add_argument("--configs", type=int, nargs="+", default=None, help="indices into the family's PRESETS")
    parser.add_argument("--set", nargs="+", default=[], metavar="JSON", help="more configs as JSON KernelConfig fields")
    parser.add_argument("--anchors", nargs="+", default=[], help="impls of the benchmark timed once beside ours")
    parser.add_argument("--impls", nargs="+", default=None, help="only these of our impls (e.g. polyattn-triton-chunk)")
    parser.add_argument("--dims", type=int, nargs="+", default=[128])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    configs = configs_for(args.ops, args.configs, args.set)
    import torch

    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    cases = kernels.cases()
    ours = [c for c in cases if c.op in args.ops and c.impl.startswith("polyattn") and (args.impls is None or c.impl in args.impls)]
    anchors = [c for c in cases if c.op in args.ops + ["softmax"] and c.impl in args.anchors]
    grid = [(D, T, mode) for D in args.dims for T in args.seqlens for mode in ("fwd", "fwdbwd")]
    rows = []
    for D, T, mode in grid:
        for case in anchors:
            ms, peak = kernels.measure_row(case, max(1, kernels.TOKENS // T), T, D, mode)
            rows.append(dict(op=case.op, impl=case.impl, D=D, T=T, mode=mode, config=None, ms=ms, peak_gib=gib(peak)))
    for i, fields in enumerate(configs):
        with use_config(KernelConfig(**fields)):
            for D, T, mode in grid:
                for case in ours:
                    ms, peak = kernels.measure_row(case, max(1, kernels.TOKENS // T), T, D, mode)
                    rows.append(dict(op=case.op, impl=case.impl, D=D, T=T, mode=mode, config=i, fields=fields, ms=ms,
                                     peak_gib=gib(peak)))
                    print(f"config {i} {fields} {case.op} D{D} T{T} {mode}: {ms} ({rows[-1]['peak_gib']} GiB)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    print(table(rows, configs, ours, grid))
    return 0


def gib(peak: int | None) -> float | None:
    return None if peak is None else peak / 2**30


def with_peak(text: str, row: dict) -> str:
    """A table cell and, where measured, the row's peak memory."""
    return text + (f", {row['peak_gib']:.2f} GiB" if row.get("peak_gib") is not None else "")


def table(rows, configs, ours, grid) -> str:
    """ms per (op, D, T, mode) row and config column, `(x.xx)` the ratio to the first anchor of the row, then
    the peak memory where measured."""
    lines = ["| op | D | T | mode | anchor | " + " | ".join(f"config {i}" for i in range(len(configs))) + " |",
             "|---|---|---|---|---|" + "---|" * len(configs)]
    for case in ours:
        for D, T, mode in grid:
            anchor = next((r for r in rows if r["config"] is None and r["D"] == D and r["T"] == T and r["mode"] == mode), None)
            base = anchor["ms"] if anchor and isinstance(anchor["ms"], float) else None
            cells = []
            for i in range(len(configs)):
                row = next(r for r in rows if r["config"] == i and r["op"] == case.op and r["D"] == D and r["T"] == T
                           and r["mode"] == mode)
                ms = row["ms"]
                cells.append(with_peak(f"{ms:.3f}" + (f" ({ms / base:.2f})" if base else ""), row) if isinstance(ms, float) else "error")
            shown = with_peak(f"{anchor['impl']} {base:.3f}", anchor) if base else "-"
            lines.append(f"| {case.op} | {D} | {T} | {mode} | {shown} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n" + "\n".join(f"config {i}: {fields}" for i, fields in enumerate(configs))


if __name__ == "__main__":
    sys.exit(main())
