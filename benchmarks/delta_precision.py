"""Accuracy of the Triton delta rule for each way of running its fp32 x fp32 products.

python benchmarks/delta_precision.py [--out FILE]
With every product split, with the outputs' products rounded (`delta_out_dot`, the default) and with every
fp32 x fp32 product rounded (`delta_fp32_dot` too), bf16 inputs at the GPU test shape (B = 2, T = 1000,
H = 16, K = 128, V = 96, with decay): the relative error of o, the final state and every gradient against
the float64 spec, beside the test bound (2x the PyTorch chunk form's error, or one bf16 ulp).
With fla importable, also the forward alone (o and the final state, no gradients: fla's gated backward
needs Triton >= 3.7.1) of every mode and of fla's `chunk_gated_delta_rule`, against the same bound: the
precision at which the anchor of the delta rule's speed targets runs.
"""
import argparse
import json
from dataclasses import replace

import torch

from polyattn.bench.kernels import fla_op
from polyattn.ops.delta import delta_rule_chunk, delta_rule_naive
from polyattn.ops.delta.triton import delta_rule_triton
from polyattn.ops.triton.plan import get_config, use_config
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
    modes = {  # KernelConfig fields: the state chain's fp32 x fp32 products, and the outputs' two products
        "split": dict(delta_fp32_dot="split", delta_out_dot="split"),
        "out-rounded": dict(delta_fp32_dot="split", delta_out_dot="rounded"),  # the default
        "rounded": dict(delta_fp32_dot="rounded", delta_out_dot="rounded"),
    }
    forms = [(name, fields, delta_rule_triton, True) for name, fields in modes.items()]
    fla = fla_op("chunk_gated_delta_rule")
    if fla is not None:
        def fla_form(q, k, v, beta, g, *, scale, initial_state, output_final_state):
            return fla(q, k, v, g, beta, scale=scale, initial_state=initial_state.float(), output_final_state=output_final_state)

        forms += [(f"{name}-fwd", fields, form, False) for name, fields, form, _ in forms]
        forms.append(("fla-fwd", {}, fla_form, False))
    for name, fields, form, backward in forms:
        try:
            with use_config(replace(get_config(), **fields)):
                errors = low_precision_errors(delta_rule_naive, delta_rule_chunk, form, inputs, h0, torch.bfloat16, backward=backward)
        except AssertionError as failure:  # a form whose outputs are not finite: said, and the others still measured
            results[name] = str(failure)
            print(f"{name:15} {failure}", flush=True)
            continue
        results[name] = {n: dict(err=e, bound=b) for n, (e, b) in errors.items()}
        cells = " ".join(f"{n}={e:.1e}{'' if e <= b else '!'}" for n, (e, b) in errors.items())
        print(f"{name:15} {cells}   (! = over the bound)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
