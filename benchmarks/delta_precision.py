"""Accuracy of the Triton delta rule for each way of running its fp32 x fp32 products.

python benchmarks/delta_precision.py [--out FILE]
For every `KernelConfig.delta_fp32_dot` mode, bf16 inputs at the GPU test shape (B = 2, T = 1000,
H = 16, K = 128, V = 96, with decay): the relative error of o, the final state and every gradient
against the float64 spec, beside the test bound (2x the PyTorch chunk form's error, or one bf16 ulp).
"""
import argparse
import json
from dataclasses import replace

import torch

from polyattn.ops.delta import delta_rule_chunk, delta_rule_naive
from polyattn.ops.delta.triton import delta_rule_triton
from polyattn.ops.triton.plan import get_config, use_config
from polyattn.ops.triton.precision import FP32_DOTS
from polyattn.testing import low_precision_errors, seeded_inputs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    x = seeded_inputs(2, 1000, 16, 128, 96, decay=True, beta=True, seed=0, device="cuda")
    x["k"] = torch.nn.functional.normalize(x["k"], dim=-1)
    inputs = {n: x[n] for n in ("q", "k", "v", "beta", "g")}
    h0 = 0.5 * torch.randn(2, 16, 128, 96, dtype=torch.float64, device="cuda")
    results = {}
    for mode in FP32_DOTS:
        try:
            with use_config(replace(get_config(), delta_fp32_dot=mode)):
                errors = low_precision_errors(delta_rule_naive, delta_rule_chunk, delta_rule_triton, inputs, h0, torch.bfloat16)
        except AssertionError as failure:  # a mode whose outputs are not finite: said, and the others still measured
            results[mode] = str(failure)
            print(f"{mode:8} {failure}", flush=True)
            continue
        results[mode] = {n: dict(err=e, bound=b) for n, (e, b) in errors.items()}
        cells = " ".join(f"{n}={e:.1e}{'' if e <= b else '!'}" for n, (e, b) in errors.items())
        print(f"{mode:8} {cells}   (! = over the bound)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
