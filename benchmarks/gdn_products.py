"""Tensor-core work of log-linear Gated DeltaNet's level kernels, counted from their skip rules, and the rate a
profile achieved.

python benchmarks/gdn_products.py --T 8192 [--profile profile.json]

At the standard shape (bf16, H = 16, K = V = 128, chunks of 64, 65,536 tokens: B = 65536 // T sequences),
counts each kernel's `[C, K] x [K, V]`-sized tensor-core passes per chunk and level as `ops/loglinear/triton/
gdn.py` forms them (an fp32 x fp32 product split in bf16 halves is three passes, an fp32 x bf16 one two, a
bf16 one one; a level skips `W h` at its block's first chunk, where h is zero, and its carry after the block's
last, unless the sequence ends there) and prints the TFLOP of each kernel; with `--profile` (a JSON of
`benchmarks/profile_kernels.py --by-launch`) also the kernel's time and TFLOP/s. The chain's carry out of each
round's last chunk is counted though the chain skips it (1/S of its recompute).
"""
import argparse
import json
from collections import Counter

C, K, V, H, TOKENS = 64, 128, 128, 16, 65536
WH, CARRY, READ_FWD, DX, WT_DX, READ_BWD, DW, DKT, P = 3, 2, 3, 2, 3, 2, 3, 3, 2  # passes per product


def passes(n_chunks: int) -> Counter:
    """Passes per kernel for one sequence of `n_chunks` chunks from position 0 (per head and full value width)."""
    NL = max((n_chunks - 1).bit_length(), 1)
    out = Counter()
    for a in range(n_chunks):
        for ell in range(NL):
            phase = a % (2 << ell)
            first, read = phase == 0 and a > 0, (a >> ell) & 1 == 1
            live = phase != (2 << ell) - 1 or a == n_chunks - 1  # the state leaving the chunk is used: dh' not zero
            x = 0 if first else WH  # x = [write] Ū - W h
            carried = phase != (2 << ell) - 1 and a < n_chunks - 1  # a later chunk of the walk reads the state
            out["gdn_levels_kernel (forward)"] += (x + CARRY if live else 0) + (READ_FWD if read else 0)
            out["gdn_levels_kernel (rerun)"] += x + CARRY if live else 0
            out["gdn_levels_chain_kernel"] += ((x + (CARRY if carried else 0) + DX + (0 if first else WT_DX) if live else 0)
                                               + (READ_BWD if read else 0))
            out["gdn_levels_grads_kernel"] += ((0 if first else DW) + DKT if live else 0) + (P if read else 0)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, default=8192)
    parser.add_argument("--profile", default=None, help="a profile_kernels.py --by-launch JSON of the same T")
    args = parser.parse_args(argv)
    unit = 2 * C * K * V * H * (TOKENS // args.T)  # one pass over a chunk, every head and sequence
    times = Counter()
    if args.profile:
        (launches,) = json.load(open(args.profile)).values()
        for name, ms in launches.items():
            times[name.split(" ", 1)[1]] += ms
    walk = times.pop("gdn_levels_kernel", None)
    for kernel, n in passes(args.T // C).items():
        tflop = n * unit / 1e12
        ms = times.get(kernel.split(" ")[0]) if "(" not in kernel else None
        rate = f", {ms:.2f} ms, {tflop / ms * 1e3:.0f} TFLOP/s" if ms else ""
        print(f"{kernel:30} {tflop:6.2f} TFLOP{rate}")
    if walk is not None:
        walks = sum(n for k, n in passes(args.T // C).items() if k.startswith("gdn_levels_kernel")) * unit / 1e12
        print(f"{'gdn_levels_kernel (both)':30} {walks:6.2f} TFLOP, {walk:.2f} ms, {walks / walk * 1e3:.0f} TFLOP/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
