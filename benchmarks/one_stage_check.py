"""One fwd+bwd of an op's Triton kernels at `KernelConfig.num_stages = STAGES`, to find lowering faults.

python benchmarks/one_stage_check.py OP B T STAGES [check]
OP: linear | linear_decay | delta | loglinear_mamba2 | loglinear_gdn; inputs as `python -m polyattn.bench kernels`
makes them (bf16, 16 heads, K = V = 128), the delta rule at value tiles of 16 without segments. With
`check`, every output and gradient against the same call at the default two stages (max |difference|). Run it
under `compute-sanitizer --tool memcheck` to see a faulting access. The delta rule's backward refuses one stage
(ops/delta/README.md): the runs in benchmarks/results/2026-12-07-h100/ (calls 50-51) lifted that refusal in the
device's copy of the tree; their README gives the arguments that earlier form of the script took.
"""
import sys
import torch
import torch.nn.functional as F
from polyattn.bench.kernels import inputs
from polyattn.ops.common import num_levels
from polyattn.ops.delta import delta_rule
from polyattn.ops.linear import linear_attn
from polyattn.ops.loglinear import loglinear_attn
from polyattn.ops.triton.plan import KernelConfig, use_config

op = sys.argv[1]
B, T, stages = map(int, sys.argv[2:5])
check = len(sys.argv) > 5


def run(stages):
    q, k, v, g, beta = inputs(B, T, 128, True)
    gen = torch.Generator(device="cuda").manual_seed(1)
    lam = F.softplus(torch.randn(B, T, q.shape[2], num_levels(T), device="cuda", generator=gen)).requires_grad_()
    leaves = [q, k, v, g, beta, lam]
    cfg = KernelConfig(num_stages=stages, delta_block_v=16, delta_narrow_per_sm=0, delta_split_per_sm=0)
    with use_config(cfg):
        if op == "delta":
            o, ht = delta_rule(q, k, v, beta, g, impl="triton", output_final_state=True)
        elif op.startswith("linear"):
            o, ht = linear_attn(q, k, v, g if op == "linear_decay" else None, impl="triton", output_final_state=True)
        else:
            o, ht = loglinear_attn(q, k, v, lam, g, beta=beta if op == "loglinear_gdn" else None, impl="triton",
                                   output_final_state=True)
            ht = torch.cat([x.flatten() for x in ht if torch.is_tensor(x) and x.is_floating_point()])
        (o.float().square().mean() + ht.square().mean()).backward()
    torch.cuda.synchronize()
    return [o.float(), ht] + [torch.zeros(1) if x.grad is None else x.grad.float() for x in leaves]


a = run(stages)
print("ran", op, B, T, "stages", stages, flush=True)
if check:
    b = run(2)
    for name, x, y in zip("o ht dq dk dv dg dbeta dlam".split(), a, b):
        print(op, name, "max|diff|", (x - y).abs().max().item(), "max|ref|", y.abs().max().item(), "finite", x.isfinite().all().item())
