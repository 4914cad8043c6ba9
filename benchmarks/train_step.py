"""Training-step time of a small LM per mixer family, eager beside `torch.compile(fullgraph=True)`, with checks.

    python benchmarks/train_step.py [--device cuda] [--mixers linear,gdn,kata-m2] [--out FILE.json]

One step = forward under bf16 autocast, cross-entropy, backward, AdamW (fused on CUDA, the same
optimizer in both arms). The compiled arm compiles the forward and loss with ``fullgraph=True`` (so
AOTAutograd compiles the backward too); both arms start from the same weights and see the same
batches, so their losses are comparable step by step. Checks per mixer, printed and in the JSON:

- ``torch._dynamo.explain`` finds one graph and no graph break (``fullgraph=True`` would also raise on one);
- where the mixer's op runs a Triton form (``impl="auto"`` on CUDA, or ``--impl triton``), the graph calls
  the ``polyattn::`` custom ops (the Triton kernels wrapped with ``torch.library``), not traced kernels;
- the compiled loss equals the eager loss at every step within 2**-7 relative (two bf16 ulps).

Reports the compile time (the first compiled step), median step times, tokens/s and peak memory. The
JSON is rewritten after every mixer, so a run stopped by a timeout keeps what it finished; the exit
status is 1 when a mixer failed a check or raised.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F

from polyattn.bench.timing import environment, error_entry, parse_sized_args, synchronize, write_json
from polyattn.layers import mixer_form
from polyattn.models import CausalLM, LMConfig

FAMILIES = ["linear", "gdn", "kata-m2", "mamba2", "hla2", "deltakata-m1", "softmax", "loglinear-gdn"]
LOSS_RTOL = 2.0**-7
SIZES = {  # d_model, layers, heads, batch, seqlen, warm-up steps, timed steps
    "cuda": dict(d_model=512, layers=2, heads=4, batch=16, seqlen=1024, warmup=3, steps=10),
    "cpu": dict(d_model=64, layers=2, heads=2, batch=2, seqlen=64, warmup=1, steps=3),
}


def lm_loss(model, ids, device_type):
    """Next-token cross-entropy of ``ids [B, T + 1]`` with the forward under bf16 autocast."""
    with torch.autocast(device_type, dtype=torch.bfloat16):
        logits, _ = model(ids[:, :-1])  # [B, T, vocab]
    return F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())


def run_arm(model, loss_of, batches, warmup, device):
    """Train on every batch; `(losses, seconds of each step, peak MiB of the timed steps)`."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=device.type == "cuda")
    losses, seconds = [], []
    for i, ids in enumerate(batches):
        if i == warmup and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        synchronize(device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(ids)
        loss.backward()
        optimizer.step()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return losses, seconds, peak


def measure(mixer, args, device):
    """One mixer's row: graph checks, both arms, the loss comparison."""
    torch.manual_seed(0)
    config = LMConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, mixer=mixer,
                      mixer_config=dict(num_heads=args.heads, impl=args.impl))
    eager_model = CausalLM(config).to(device)
    compiled_model = copy.deepcopy(eager_model)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(args.vocab, (args.batch, args.seqlen + 1), generator=gen).to(device)
               for _ in range(args.warmup + args.steps)]
    form = mixer_form(mixer, args.impl, args.seqlen, device, torch.bfloat16)
    row = dict(mixer=mixer, form=form, parameters=sum(p.numel() for p in eager_model.parameters()))

    def compiled_forward(ids):
        return lm_loss(compiled_model, ids, device.type)

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(compiled_forward)(batches[0])
    row.update(graph_count=explanation.graph_count, graph_break_count=explanation.graph_break_count,
               break_reasons=[str(reason.reason) for reason in explanation.break_reasons],
               custom_ops=sorted({str(op) for ops in explanation.ops_per_graph for op in ops if str(op).startswith("polyattn.")}))
    if row["graph_count"] != 1 or row["graph_break_count"]:
        row["failures"] = [f"{row['graph_count']} graphs, {row['graph_break_count']} breaks: {row['break_reasons']}"]
        return row
    torch._dynamo.reset()
    compiled = torch.compile(compiled_forward, fullgraph=True, backend=args.backend)

    eager_losses, eager_s, eager_peak = run_arm(eager_model, lambda ids: lm_loss(eager_model, ids, device.type),
                                                batches, args.warmup, device)
    compiled_losses, compiled_s, compiled_peak = run_arm(compiled_model, compiled, batches, args.warmup, device)
    diffs = [abs(c - e) / abs(e) for c, e in zip(compiled_losses, eager_losses)]
    eager_ms = 1e3 * statistics.median(eager_s[args.warmup:])
    compiled_ms = 1e3 * statistics.median(compiled_s[args.warmup:])
    tokens = args.batch * args.seqlen
    row.update(
        compile_s=compiled_s[0], eager_ms=eager_ms, compiled_ms=compiled_ms, speedup=eager_ms / compiled_ms,
        eager_tokens_per_s=tokens / eager_ms * 1e3, compiled_tokens_per_s=tokens / compiled_ms * 1e3,
        eager_peak_mib=eager_peak, compiled_peak_mib=compiled_peak,
        eager_losses=eager_losses, compiled_losses=compiled_losses, max_loss_rel_diff=max(diffs), loss_rtol=LOSS_RTOL,
    )
    failures = []
    if form == "triton" and not row["custom_ops"]:
        failures.append("the Triton form runs but the graph calls no polyattn:: custom op")
    if not max(diffs) <= LOSS_RTOL:  # also catches a NaN
        failures.append(f"compiled loss differs from eager by {max(diffs):.2e} relative (> {LOSS_RTOL:.1e})")
    row["failures"] = failures
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixers", default=",".join(FAMILIES))
    parser.add_argument("--impl", default="auto", help="the op form of every mixer (auto: Triton on CUDA where it exists)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager: no code generation)")
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args, device = parse_sized_args(parser, argv, SIZES)
    if args.steps < 1 or args.warmup < 0:
        raise ValueError(f"expected --warmup >= 0 and --steps >= 1, got {args.warmup}, {args.steps}")
    result = dict(
        **environment(device), backend=args.backend, impl=args.impl,
        config={name: getattr(args, name) for name in ("vocab", *SIZES["cuda"])}, rows=[],
    )
    print(f"{result['device']}, torch {torch.__version__}, backend {args.backend}: " +
          ", ".join(f"{k} {v}" for k, v in result["config"].items()), flush=True)
    for mixer in args.mixers.split(","):
        try:
            row = measure(mixer, args, device)
        except Exception as exc:  # noqa: BLE001 -- one mixer's failure is its row; the others still run
            row = dict(mixer=mixer, failures=[error_entry(exc)])
        result["rows"].append(row)
        if "compiled_ms" in row:
            print(f"{mixer:<14} {row['form']:<7} graphs {row['graph_count']} breaks {row['graph_break_count']} "
                  f"ops {','.join(row['custom_ops']) or '-'} | compile {row['compile_s']:6.1f} s | eager "
                  f"{row['eager_ms']:8.2f} ms  compiled {row['compiled_ms']:8.2f} ms ({row['speedup']:.2f}x) | "
                  f"loss rel diff {row['max_loss_rel_diff']:.1e}", flush=True)
        print(f"{mixer:<14} {'FAIL: ' + '; '.join(row['failures']) if row['failures'] else 'ok'}", flush=True)
        if args.out:
            write_json(result, args.out)
        del row
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        print(f"wrote {args.out}")
    return 1 if any(row["failures"] for row in result["rows"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
