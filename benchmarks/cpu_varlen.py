"""CPU timing of packed sequences (``cu_seqlens``) against the same tokens unpacked (a benchmark, not a test).

    python benchmarks/cpu_varlen.py [--T 2048] [--states] [--threads 1]

T tokens as one sequence, as N equal sequences (N = T, T/8, T/128) and as 300 random lengths, in the
default PyTorch form (chunk) at B=1, H=4, K=V=32, float32; ``--states`` also asks for the final states
(the padded-batch path; without it, packed calls take the exact-reset path). CPU time (process time),
the median of the last repeats.
"""

from __future__ import annotations

import argparse
import time

import torch

from polyattn import ops
from polyattn.testing import seeded_inputs


def _cpu_ms(fn, repeat):
    fn()
    times = []
    for _ in range(repeat):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return 1e3 * sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--T", type=int, default=2048)
    parser.add_argument("--states", action="store_true", help="output_final_state=True")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    T = args.T
    x = seeded_inputs(1, T, 4, 32, 32, dtype=torch.float32, beta=True)
    q, k, v, g, beta = x["q"], x["k"], x["v"], x["g"], x["beta"]
    unit_k = torch.nn.functional.normalize(k, dim=-1)
    keep = args.states
    calls = {
        "linear_attn": lambda cu: ops.linear_attn(q, k, v, g, cu_seqlens=cu, output_final_state=keep),
        "delta_rule": lambda cu: ops.delta_rule(q, unit_k, v, beta, g, cu_seqlens=cu, output_final_state=keep),
        "hla (order 2)": lambda cu: ops.hla(q, k, v, g, cu_seqlens=cu, output_final_state=keep),
        "kata (M2)": lambda cu: ops.kata(q, k, v, g, groups=2, cu_seqlens=cu, output_final_state=keep),
    }
    gen = torch.Generator().manual_seed(0)
    random = torch.tensor([0, *sorted(torch.randperm(T - 1, generator=gen)[:299].add(1).tolist()), T])
    layouts = {"unpacked": None, **{f"{n} seqs": torch.arange(0, T + 1, T // n) for n in (T, T // 8, T // 128)}}
    layouts["300 random"] = random
    print(f"T = {T}, H = 4, K = V = 32, float32, {args.threads} thread(s), final states: {keep}; CPU ms")
    print(f"{'op':<14}" + "".join(f"{name:>14}" for name in layouts))
    for name, call in calls.items():
        print(f"{name:<14}" + "".join(f"{_cpu_ms(lambda: call(cu), args.repeat):14.1f}" for cu in layouts.values()), flush=True)


if __name__ == "__main__":
    main()
