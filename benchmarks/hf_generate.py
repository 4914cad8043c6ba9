"""`generate()` throughput of small Hugging Face polyattn models, one per mixer family (a benchmark, not a test).

    python benchmarks/hf_generate.py [--device cpu] [--batch-sizes 1,16] [--new-tokens 64] [--out FILE.json]

Greedy decoding of ``--new-tokens`` tokens after a 64-token prompt (``min_new_tokens`` = ``max_new_tokens``,
so every run decodes the same number), width 64, 2 layers, 2 heads, vocabulary 256, random weights;
best of ``--repeat`` runs after a warm-up. Reports generated tokens per second (batch × new tokens / time).
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import polyattn.hf  # noqa: F401  (registers model_type "polyattn")

FAMILIES = ["softmax", "linear", "mamba2", "gdn", "hla2", "loglinear-gdn", "kata-m2", "deltakata-m1"]


def tokens_per_second(model, batch, new_tokens, repeat, device):
    ids = torch.randint(256, (batch, 64), device=device)
    options = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)  # warm-up
    best = float("inf")
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, **options)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return batch * new_tokens / best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--mixers", default=",".join(FAMILIES))
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    rows = []
    for mixer in args.mixers.split(","):
        torch.manual_seed(0)
        config = AutoConfig.for_model("polyattn", mixer=mixer, vocab_size=256, hidden_size=64, num_hidden_layers=2,
                                      mixer_config={"num_heads": 2})
        model = AutoModelForCausalLM.from_config(config).to(device).eval()
        row = {"mixer": mixer, **{f"B{b}": tokens_per_second(model, b, args.new_tokens, args.repeat, device) for b in batches}}
        rows.append(row)
        print(f"{mixer:<14} " + "  ".join(f"B={b}: {row[f'B{b}']:9,.0f} tok/s" for b in batches), flush=True)
    result = {"device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
              "platform": platform.platform(), "torch": torch.__version__, "new_tokens": args.new_tokens, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
