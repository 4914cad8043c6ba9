"""`generate()` throughput of small Hugging Face polyattn models, one per mixer family (a benchmark with checks).

    python benchmarks/hf_generate.py [--device cuda] [--batch-sizes 1,16] [--decode-impls auto,recurrent] [--out FILE.json]

Greedy decoding of ``--new-tokens`` tokens after a ``--prompt``-token prompt (``min_new_tokens`` =
``max_new_tokens``, so every run decodes the same number), random weights, bf16 autocast on CUDA; best
of ``--repeat`` runs after a warm-up. Reports generated tokens per second (batch × new tokens / time) for
each one-token form: ``decode_impl="auto"`` (the fused Triton steps on CUDA where the op has one, the
PyTorch token loop elsewhere) beside ``decode_impl="recurrent"`` (the PyTorch token loop); prompts
run the ``impl="auto"`` form in both.

Check per (mixer, decode_impl), printed and in the JSON: one extra, untimed `generate()` counts the
calls of the fused steps (every ``*_step_inplace`` / ``*_step`` function the Triton forms dispatch one-token
calls to, `fused_steps`); where `polyattn.layers.mixer_form` says one-token calls run the Triton form, every layer must
make at least one fused step per decoded token, and none otherwise (so ``recurrent`` is really the
PyTorch loop). The JSON is rewritten after every mixer; the exit status is 1 when a check failed or a
mixer raised.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import pkgutil
import time
from unittest import mock

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import polyattn.hf  # noqa: F401  (registers model_type "polyattn")
import polyattn.ops
from polyattn.bench.timing import environment, error_entry, parse_sized_args, synchronize, write_json
from polyattn.layers import mixer_form

FAMILIES = ["softmax", "linear", "mamba2", "gdn", "hla2", "loglinear-gdn", "kata-m2", "deltakata-m1"]
SIZES = {  # hidden size, layers, heads
    "cuda": dict(hidden=512, layers=2, heads=4),
    "cpu": dict(hidden=64, layers=2, heads=2),
}


def fused_steps():
    """`(module, name)` of every fused decoding step, where the Triton forms look it up at call time: the
    ``*_step_inplace`` functions of ``ops/<family>/triton/function.py`` (in place on a copy of the state)
    and the ``*_step`` functions of ``ops/<family>/triton/step.py`` (KATA's: a new state)."""
    found = []
    for family in pkgutil.iter_modules(polyattn.ops.__path__):
        for stage, suffix in (("function", "_step_inplace"), ("step", "_step")):
            try:
                module = importlib.import_module(f"polyattn.ops.{family.name}.triton.{stage}")
            except ModuleNotFoundError:
                continue
            found += [(module, name) for name, fn in vars(module).items()  # the family's own, not the shared front's
                      if name.endswith(suffix) and getattr(fn, "__module__", "").startswith(f"polyattn.ops.{family.name}.triton")]
    return found


@contextlib.contextmanager
def counting_fused_steps():
    """Within: every fused-step call is counted by name (`counts` dict, yielded) and then made."""
    counts = {}
    with contextlib.ExitStack() as stack:
        for module, name in fused_steps():
            step = getattr(module, name)

            def counted(*args, _step=step, _name=name, **kwargs):
                counts[_name] = counts.get(_name, 0) + 1
                return _step(*args, **kwargs)

            stack.enter_context(mock.patch.object(module, name, counted))
        yield counts


def tokens_per_second(model, batch, args, device, autocast):
    """`(tokens/s, fused-step calls by name in one more untimed run)` of greedy `generate`."""
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(args.vocab, (batch, args.prompt), generator=gen).to(device)
    options = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    with autocast():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)  # warm-up, kernel compilation
        best = float("inf")
        for _ in range(args.repeat):
            synchronize(device)
            start = time.perf_counter()
            model.generate(ids, **options)
            synchronize(device)
            best = min(best, time.perf_counter() - start)
        with counting_fused_steps() as counts:
            model.generate(ids, **options)
    return batch * args.new_tokens / best, counts


def measure(mixer, decode_impl, batches, args, device, autocast):
    torch.manual_seed(0)
    config = AutoConfig.for_model("polyattn", mixer=mixer, vocab_size=args.vocab, hidden_size=args.hidden,
                                  num_hidden_layers=args.layers,
                                  mixer_config={"num_heads": args.heads, "decode_impl": decode_impl})
    model = AutoModelForCausalLM.from_config(config).to(device).eval()
    dtype = torch.bfloat16 if args.autocast else torch.float32
    row = dict(mixer=mixer, decode_impl=decode_impl, prompt_form=mixer_form(mixer, "auto", args.prompt, device, dtype),
               decode_form=mixer_form(mixer, decode_impl, 1, device, dtype), failures=[])
    steps_expected = (args.new_tokens - 1) * args.layers  # the prompt's forward gives the first new token
    for b in batches:
        row[f"B{b}"], counts = tokens_per_second(model, b, args, device, autocast)
        row[f"fused_steps_B{b}"] = counts
        total = sum(counts.values())
        if row["decode_form"] == "triton" and total < steps_expected:
            row["failures"].append(f"B={b}: {total} fused steps, expected >= {steps_expected} (one per layer and token)")
        if row["decode_form"] != "triton" and total:
            row["failures"].append(f"B={b}: {total} fused steps with decode form {row['decode_form']!r}, expected none")
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixers", default=",".join(FAMILIES))
    parser.add_argument("--decode-impls", default="auto,recurrent")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--autocast", action=argparse.BooleanOptionalAction, default=None,
                        help="bf16 autocast (default: on CUDA only)")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args, device = parse_sized_args(parser, argv, SIZES)
    if args.autocast is None:
        args.autocast = device.type == "cuda"
    if args.new_tokens < 2 or args.repeat < 1:
        raise ValueError(f"expected --new-tokens >= 2 and --repeat >= 1, got {args.new_tokens}, {args.repeat}")
    batches = [int(b) for b in args.batch_sizes.split(",")]

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16) if args.autocast else contextlib.nullcontext()

    result = dict(
        **environment(device), autocast_bf16=args.autocast,
        config={name: getattr(args, name) for name in ("vocab", *SIZES["cuda"], "prompt", "new_tokens", "repeat")}, rows=[],
    )
    print(f"{result['device']}, torch {torch.__version__}: " + ", ".join(f"{k} {v}" for k, v in result["config"].items()), flush=True)
    for mixer in args.mixers.split(","):
        for decode_impl in args.decode_impls.split(","):
            try:
                row = measure(mixer, decode_impl, batches, args, device, autocast)
            except Exception as exc:  # noqa: BLE001 -- one mixer's failure is its row; the others still run
                row = dict(mixer=mixer, decode_impl=decode_impl, failures=[error_entry(exc)])
            result["rows"].append(row)
            if f"B{batches[-1]}" in row:
                steps = sum(row[f"fused_steps_B{batches[0]}"].values())
                print(f"{mixer:<14} {decode_impl:<9} decode {row['decode_form']:<9} " +
                      "  ".join(f"B={b}: {row[f'B{b}']:9,.0f} tok/s" for b in batches) + f"  fused steps (B={batches[0]}) {steps}",
                      flush=True)
            print(f"{mixer:<14} {decode_impl:<9} {'FAIL: ' + '; '.join(row['failures']) if row['failures'] else 'ok'}", flush=True)
            if args.out:
                write_json(result, args.out)
    if args.out:
        print(f"wrote {args.out}")
    return 1 if any(row["failures"] for row in result["rows"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
