"""Can linear attention's dg leave the backward passes? The error of dg taken from `do·o − v·dv` against `q·dq − k·dk`.

python benchmarks/dg_identity.py [--out FILE]
With decay, `dg = reverse_cumsum(q·dq − k·dk)` (plus `<dht, ht>` at each sequence's end), and the kernels form the
per-token dots inside the dq and dk passes from their fp32 outputs (ops/linear/README.md, "Where the decay's time
goes": 0.13–0.27 ms a pass at 8K). Each side equals another bilinear sum, `q_t·dq_t = do_t·o_t` and
`k_s·dk_s = v_s·dv_s`, whose factors already exist outside the passes, but o and dv leave the kernels rounded to the
input dtype. This computes, on the CPU in float64 from the same rounded inputs, the dg error of each way (o and dv
rounded as the kernels store them, dq and dk exact as their fp32 values stand in the kernels) beside the bound the
tests hold the Triton form to: twice the error of the PyTorch chunk form in the same dtype (`polyattn.testing`).
"""
import argparse

import torch

from polyattn.ops.linear import linear_attn_chunk, linear_attn_naive
from polyattn.testing import LOW_PRECISION_CEILING, LOW_PRECISION_FLOOR, forward_backward, rel_err, seeded_inputs

SHAPES = [(2, 65, 2, 8, 12), (2, 1000, 2, 8, 12), (1, 1000, 2, 64, 64), (1, 1000, 2, 128, 96), (1, 2048, 1, 128, 128)]  # B, T, H, K, V


def errors(B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype, seed: int) -> dict:
    x = seeded_inputs(B, T, H, K, V, decay=True, seed=seed)
    x.pop("beta")
    low = {n: t.to(dtype) for n, t in x.items()}
    exact = {n: t.double() for n, t in low.items()}  # the same rounded inputs
    gen = torch.Generator().manual_seed(seed + 100)
    do = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)  # [B, T, H, V]
    dht = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64)  # [B, H, K, V]
    scale = K**-0.5
    ref = forward_backward(linear_attn_naive, exact, None, (do, dht), scale=scale)  # {"o", "final_state", "dq", ...}
    chunk = forward_backward(linear_attn_chunk, low, None, (do, dht), scale=scale)
    rounded = {"do": do.to(dtype).double(), "o": ref["o"].to(dtype).double(), "dv": ref["dv"].to(dtype).double()}  # as the kernels see them
    q_side = {"q·dq": (exact["q"] * ref["dq"]).sum(-1), "do·o": (rounded["do"] * rounded["o"]).sum(-1)}  # [B, T, H]
    k_side = {"k·dk": (exact["k"] * ref["dk"]).sum(-1), "v·dv": (exact["v"] * rounded["dv"]).sum(-1)}  # [B, T, H]
    end = (dht * ref["final_state"].double()).sum((-1, -2))  # [B, H]
    bound_chunk = rel_err(chunk["dg"], ref["dg"])
    out = {"chunk form": bound_chunk, "bound": min(max(2 * bound_chunk, LOW_PRECISION_FLOOR[dtype]), LOW_PRECISION_CEILING[dtype])}
    for qn, qd in q_side.items():
        for kn, kd in k_side.items():
            db = qd - kd  # [B, T, H]
            db[:, -1] += end
            dg = db.flip(1).cumsum(1).flip(1).to(dtype)  # reverse cumsum; dg returned in g's dtype
            out[f"{qn} − {kn}"] = rel_err(dg, ref["dg"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lines = []
    for dtype in (torch.bfloat16, torch.float16):
        for B, T, H, K, V in SHAPES:
            for seed in (1, 2):
                row = errors(B, T, H, K, V, dtype, seed)
                if not lines:
                    lines.append("dg rel err | " + " | ".join(row))
                lines.append(f"{str(dtype)[6:]} B{B} T{T} H{H} K{K} V{V} seed {seed} | " + " | ".join(f"{e:.2e}" for e in row.values()))
                print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
