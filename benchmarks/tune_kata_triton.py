"""Sweep the launch parameters of KATA's Triton quadratic kernel on one GPU (prints a table).

python benchmarks/tune_kata_triton.py [--out results.json] [--seqlens 2048 ...] [--configs 0 1 ...] [--op kata_m1]
Times forward and forward+backward (bf16, H=16, K=V=64, B*T=65536, no decay) per KernelConfig, with
SDPA flash attention at the same shape as the anchor (the last column: ours / flash, < 1 is faster).
"""
import argparse
import json
import sys

import torch
import torch.nn.functional as F

from polyattn import ops
from polyattn.bench.kernels import KATA, TOKENS, inputs
from polyattn.bench.timing import try_bench
from polyattn.ops.triton.plan import KernelConfig, use_config

CONFIGS = [
    KernelConfig(),
    KernelConfig(kata_score_dot="rounded"),
    KernelConfig(kata_num_warps=4, kata_bwd_warps=4),
    KernelConfig(kata_num_stages=3),
    KernelConfig(kata_score_dot="rounded", kata_num_stages=3),
    KernelConfig(kata_score_dot="rounded", kata_num_warps=4, kata_bwd_warps=8, kata_num_stages=3),
    KernelConfig(kata_block_m=64, kata_block_n=64, kata_num_warps=4, kata_bwd_warps=4),
    KernelConfig(kata_block_m=128, kata_block_n=32),
    KernelConfig(kata_block_m=128, kata_block_n=128, kata_num_stages=1),
]


def _time(fn, leaves, mode):
    if mode == "fwd":
        with torch.no_grad():
            return try_bench(fn)
    do = torch.randn_like(fn())
    return try_bench(lambda: torch.autograd.grad(fn(), leaves, do))


def time_case(op, T, mode):
    B = max(1, TOKENS // T)
    q, k, v, _, _ = inputs(B, T, 64, requires_grad=mode == "fwdbwd")
    groups, combine = KATA[op]
    return _time(lambda: ops.kata(q, k, v, groups=groups, combine=combine, impl="triton_parallel")[0], [q, k, v], mode)


def time_flash(T, mode):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B = max(1, TOKENS // T)
    q, k, v, _, _ = inputs(B, T, 64, requires_grad=mode == "fwdbwd")

    def fn():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=True)

    return _time(fn, [q, k, v], mode)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--op", default="kata_m1", choices=sorted(KATA))
    parser.add_argument("--seqlens", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--configs", type=int, nargs="+", default=list(range(len(CONFIGS))), help="indices into CONFIGS")
    args = parser.parse_args()
    flash = {(T, m): time_flash(T, m) for T in args.seqlens for m in ("fwd", "fwdbwd")}
    print("sdpa-flash", flash, flush=True)
    rows = []
    for i, config in enumerate(CONFIGS):
        if i not in args.configs:
            continue
        with use_config(config):
            for T in args.seqlens:
                for mode in ("fwd", "fwdbwd"):
                    ms = time_case(args.op, T, mode)
                    ratio = ms / flash[T, mode] if isinstance(ms, float) and isinstance(flash[T, mode], float) else None
                    rows.append(dict(config=i, **config.__dict__, op=args.op, T=T, mode=mode, ms=ms, vs_flash=ratio))
                    print(i, config, T, mode, ms, ratio, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(flash={f"{T}-{m}": ms for (T, m), ms in flash.items()}, rows=rows), f, indent=1)
    print("\nconfig  " + "  ".join(f"{T // 1024}K-{m}(/flash)" for T in args.seqlens for m in ("fwd", "fwdbwd")))
    for i in args.configs:
        cells = [(r["ms"], r["vs_flash"]) for r in rows if r["config"] == i]
        print(f"{i:6d}  " + "  ".join(f"{ms:8.3f}({x:.2f})" if x is not None else "   error" for ms, x in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
