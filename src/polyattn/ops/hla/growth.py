"""Output growth of first-order LA, HLA2, AHLA and HLA3 with sequence position (ops/hla/README.md, "Output growth").

    python -m polyattn.ops.hla.growth [--dim 64] [--batch 8] [--positions 64 512 4096] [--seed 0]

prints the median ``|o_t|`` over batch and channels at each position ``t`` (1-based), and the growth
exponent p of ``|o| ~ t^p`` between the last two positions; no decay, no
normalization, ``scale=1`` (the features carry the scale), ``v ~ N(0, 1)``, for two feature maps:

- Gaussian: ``q, k ~ N(0, 1/d)``;
- elu+1: ``q = (elu(x) + 1) / sqrt(d)`` with ``x ~ N(0, 1)``, same for k.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from polyattn.ops.hla import hla
from polyattn.ops.linear import linear_attn

FEATURES = {
    "Gaussian q, k ~ N(0, 1/d)": lambda x: x / x.shape[-1] ** 0.5,
    "elu+1, scaled d^-1/2": lambda x: (F.elu(x) + 1) / x.shape[-1] ** 0.5,
}
MECHANISMS = {
    "1st-order LA": lambda q, k, v: linear_attn(q, k, v, scale=1.0, impl="chunk")[0],
    "HLA2": lambda q, k, v: hla(q, k, v, scale=1.0, impl="chunk")[0],
    "AHLA": lambda q, k, v: hla(q, k, v, asymmetric=True, scale=1.0, impl="chunk")[0],
    "HLA3": lambda q, k, v: hla(q, k, v, order=3, scale=1.0, impl="chunk")[0],
}


def growth_table(positions=(64, 512, 4096), dim=64, batch=8, seed=0) -> dict[str, dict[str, list[float]]]:
    """``table[feature][mechanism]`` = median ``|o_t|`` at each position, float64."""
    gen = torch.Generator().manual_seed(seed)
    T = max(positions)
    raw_q, raw_k, v = (torch.randn(batch, T, 1, dim, generator=gen, dtype=torch.float64) for _ in range(3))
    table = {}
    for feature, phi in FEATURES.items():
        q, k = phi(raw_q), phi(raw_k)
        table[feature] = {}
        for name, op in MECHANISMS.items():
            o = op(q, k, v)  # [batch, T, 1, dim]
            table[feature][name] = [o[:, t - 1].abs().median().item() for t in positions]
    return table


def format_table(table, positions) -> str:
    header = " / ".join(str(t) for t in positions)
    lines = [f"| features (median |o_t| at t = {header}) | " + " | ".join(next(iter(table.values()))) + " |"]
    lines.append("| --- " * (1 + len(MECHANISMS)) + "|")
    for feature, row in table.items():
        cells = [" / ".join(f"{x:.3g}" for x in values) for values in row.values()]
        lines.append(f"| {feature} | " + " | ".join(cells) + " |")
    span = f"{positions[-2]}..{positions[-1]}"
    for feature, row in table.items():
        slopes = [math.log(v[-1] / v[-2]) / math.log(positions[-1] / positions[-2]) for v in row.values()]
        lines.append(f"| {feature}: exponent p of t^p over t = {span} | " + " | ".join(f"{p:.2f}" for p in slopes) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--positions", type=int, nargs="+", default=[64, 512, 4096])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    table = growth_table(tuple(args.positions), args.dim, args.batch, args.seed)
    print(format_table(table, args.positions))


if __name__ == "__main__":
    main()
