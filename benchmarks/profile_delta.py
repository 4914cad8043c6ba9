"""Per-kernel CUDA time of one `delta_rule(impl="triton")` forward + backward (torch.profiler).

python benchmarks/profile_delta.py [--T 8192 ...] [--warps 4 8] [--block-v 32 64] [--fp32-dot split rounded] [--out FILE]
Standard shape: bf16, H = 16, K = V = 128, B = 65536 // T. Prints each kernel's mean time per call.
"""
import argparse
import json

from dataclasses import replace

import torch
import torch.nn.functional as F

from polyattn import ops
from polyattn.bench.timing import kernel_times, print_kernel_times
from polyattn.ops.triton.plan import get_config, use_config


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--T", type=int, nargs="+", default=[8192])
    parser.add_argument("--warps", type=int, nargs="+", default=[4])
    parser.add_argument("--block-v", type=int, nargs="+", default=[32])
    parser.add_argument("--fp32-dot", nargs="+", default=["split"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = {}
    for warps in args.warps:
        for block_v in args.block_v:
            for dot in args.fp32_dot:
                with use_config(replace(get_config(), delta_num_warps=warps, delta_block_v=block_v, delta_fp32_dot=dot)):
                    for T in args.T:
                        print(f"num_warps={warps} block_v={block_v} fp32_dot={dot}")
                        results[f"T{T}-w{warps}-bv{block_v}-{dot}"] = profile(T, warps)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


def profile(T, warps):
    """Kernel name -> mean CUDA ms per forward + backward at length T."""
    B, H, D = max(1, 65536 // T), 16, 128
    q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    k = F.normalize(k.float(), dim=-1).to(torch.bfloat16)
    g = F.logsigmoid(torch.randn(B, T, H, device="cuda") + 4.0)
    beta = torch.sigmoid(torch.randn(B, T, H, device="cuda")).to(torch.bfloat16)
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta)]
    do = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)

    def step():
        o, _ = ops.delta_rule(q, k, v, beta, g, impl="triton")
        torch.autograd.grad(o, leaves, do)

    rows = kernel_times(step)
    print_kernel_times(f"T={T} B={B} num_warps={warps}, fwd+bwd", rows)
    return rows


if __name__ == "__main__":
    main()
