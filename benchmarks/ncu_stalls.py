"""Where a kernel's warps wait, from an Nsight Compute source export.

    ncu --section SourceCounters --section WarpStateStats -o REPORT python3 program.py
    ncu --import REPORT.ncu-rep --page source --print-source sass --csv > sass.csv
    python benchmarks/ncu_stalls.py sass.csv [names ...]

Per profiled launch (named in order by `names`): the stall reasons' shares of the warp-state samples, the
opcodes' shares of the executed warp instructions and of the samples (a sample is charged to the instruction
that waits, e.g. the first reader of a loaded register), the spill reloads' share of the instructions, and the
instructions that wait longest on a load (`long_sb`: global or local memory) beside the load before them.
"""
import collections
import csv
import io
import sys

LOADS = ("LDG", "LDL", "LDS")


def launches(path: str) -> list[list[dict]]:
    """The export's rows, one list per profiled launch (each launch opens with a "Kernel Name" line)."""
    blocks, cur = [], None
    for line in open(path, errors="replace").read().splitlines():
        if line.startswith('"Kernel Name"'):
            cur = []
            blocks.append(cur)
        elif cur is not None:
            cur.append(line)
    return [list(csv.DictReader(io.StringIO("\n".join(b)))) for b in blocks]


def number(x: str) -> float:
    return float(x.replace(",", "")) if x not in ("", "-") else 0.0


def opcode(source: str) -> str:
    words = source.split()
    if not words:
        return "?"
    return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]


def shares(counter: collections.Counter, total: float, n: int) -> str:
    return ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in counter.most_common(n))


def report(rows: list[dict], name: str, top: int = 6) -> None:
    reasons = [c for c in rows[0] if c.startswith("stall_") and not c.endswith("(Not Issued)")]
    by_reason, by_op_inst, by_op_samples = collections.Counter(), collections.Counter(), collections.Counter()
    for r in rows:
        for c in reasons:
            by_reason[c[len("stall_"):]] += number(r[c])
        by_op_inst[opcode(r["Source"])] += number(r["Instructions Executed"])
        by_op_samples[opcode(r["Source"])] += number(r["Warp Stall Sampling (All Samples)"])
    samples, insts = sum(by_reason.values()), sum(by_op_inst.values())
    print(f"== {name}: {insts / 1e6:.0f}M warp instructions executed, {samples:.0f} samples")
    print(f"  stall reasons: {shares(by_reason, samples, 10)}")
    print(f"  instructions:  {shares(by_op_inst, insts, 14)}")
    print(f"  samples:       {shares(by_op_samples, samples, 14)}")
    print(f"  spill reloads (LDL): {100 * by_op_inst['LDL'] / insts:.1f}% of the instructions")
    waits = sorted(range(len(rows)), key=lambda i: -number(rows[i]["stall_long_sb"]))[:top]
    for i in waits:
        load = next((rows[j]["Source"].strip() for j in range(i - 1, max(i - 80, -1), -1)
                     if opcode(rows[j]["Source"]) in LOADS), "-")
        print(f"  {100 * number(rows[i]['stall_long_sb']) / samples:4.1f}% long_sb at {rows[i]['Source'].strip()[:60]:60}"
              f"  after {load[:60]}")


def main() -> None:
    path, names = sys.argv[1], sys.argv[2:]
    for i, rows in enumerate(launches(path)):
        report(rows, names[i] if i < len(names) else f"launch {i}")


if __name__ == "__main__":
    main()
