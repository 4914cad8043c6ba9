"""``polyattn demo``: small 2-layer models for every mixer on a small MQAR, on a CPU, in minutes.

Trains each mixer (one process per core, one thread each) with the same protocol, evaluates accuracy
per (length, pairs) slice up to 16× the training length, prints a table (mixer, params, decoding-state
floats, accuracy per slice, train tokens/s), writes ``demo.json`` and PNGs (accuracy vs state size,
accuracy vs length, training curves), and checks on one trained model that token-by-token decoding
from the recurrent state reproduces the parallel forward.
"""

import json
import os
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, replace
from multiprocessing import get_context
from pathlib import Path

import torch

from polyattn.layers import MIXERS, available_mixers
from polyattn.train.config import TrainConfig
from polyattn.train.loop import build_data, train

DEFAULT_OUT = "benchmarks/results/demo-cpu"
DECODE_CHECK_MIXER = "kata-m1"

# The demo protocol: Zoology MQAR shrunk to a CPU budget. Train at length 64 (4-16 pairs), test at
# 64 and at 4× and 16× the training length with proportionally more pairs.
DEMO_CONFIG = TrainConfig(
    task="mqar",
    task_options={"vocab_size": 256},
    train_segments=[(64, 6000, 4), (64, 6000, 8), (64, 6000, 16)],
    test_segments=[(64, 256, 8), (64, 256, 16), (256, 128, 32), (1024, 32, 64)],
    mixer="softmax",
    d_model=64,
    n_layers=2,
    mlp_ratio=0.0,
    lr=1e-2,
    steps=450,
    batch_size=32,
    eval_batch_size=32,
    early_stop=0.995,
    device="cpu",
    checkpoint=False,
)
# Per-mixer options (recorded in demo.json): the KATA cores train with their exact quadratic ("flash")
# form at these lengths; Gated DeltaNet's output gate is off because with it these tiny models stay at
# chance within the step budget (measured: 0.01 in-distribution accuracy with the gate, 0.91 without).
DEMO_MIXER_CONFIG = {
    "gdn": {"output_gate": False},
    "loglinear-gdn": {"output_gate": False},
    "kata-m1": {"impl": "parallel"},
    "kata-m2": {"impl": "parallel"},
    "kata-s2": {"impl": "parallel"},
}


def decode_check(model, data, prefix):
    """Max |logits(prefill x[:prefix] + one-token steps) − logits(parallel forward)| / max |logits|,
    in the model's dtype and again after casting the model to float64."""
    out = {}
    for dtype in (torch.float32, torch.float64):
        m = model.to(dtype)
        ids = data.inputs[:2]  # [2, T]
        with torch.no_grad():
            full, _ = m(ids)
            logits, state = m(ids[:, :prefix], use_cache=True)
            steps = [logits]
            for t in range(prefix, ids.shape[1]):
                logits, state = m(ids[:, t : t + 1], state, use_cache=True)
                steps.append(logits)
        stepped = torch.cat(steps, dim=1)  # [2, T, vocab]
        out[str(dtype).replace("torch.", "")] = float((stepped - full).abs().max() / full.abs().max())
    model.to(torch.float32)
    out.update(tokens=int(data.inputs.shape[1]), prefill=prefix)
    return out


def run_one(config, check_decode):
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    result, model = train(config, quiet=True)
    result["wall_s"] = time.perf_counter() - t0
    result["train"]["history"] = result["train"]["history"][::5]
    if check_decode:
        _, test = build_data(replace(config, train_segments=config.train_segments[:1]))
        data = test[-2]
        result["decode_check"] = decode_check(model, data, prefix=data.length // 2 + 3)
    return result


def run_demo(out_dir=DEFAULT_OUT, mixers=None, steps=None, workers=2, stream=sys.stdout):
    """Train every mixer, print the table, write JSON + PNGs; returns the summary dict."""
    from polyattn.train.plots import plot_accuracy_vs_length, plot_accuracy_vs_state, plot_training_curve
    from polyattn.train.sweep import format_table

    start = time.perf_counter()
    mixers = mixers or available_mixers()
    unknown = [m for m in mixers if m not in MIXERS]
    if unknown:
        raise ValueError(f"unknown mixers {unknown}: expected some of {list(MIXERS)}")
    base = DEMO_CONFIG if steps is None else replace(DEMO_CONFIG, steps=steps)
    check = DECODE_CHECK_MIXER if DECODE_CHECK_MIXER in mixers else mixers[0]
    jobs = {m: replace(base, mixer=m, mixer_config=DEMO_MIXER_CONFIG.get(m, {})) for m in mixers}
    print(f"polyattn demo: {len(mixers)} mixers, MQAR {base.task_options}, {base.steps} steps max, "
          f"{workers} worker process(es) × 1 thread", file=stream, flush=True)
    results = {}
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
        # the registry lists the costlier mechanisms last: submit them first so both workers finish together
        futures = {pool.submit(run_one, jobs[m], m == check): m for m in reversed(mixers)}
        for future in as_completed(futures):
            r = future.result()
            results[r["mixer"]] = r
            accs = " ".join(f"{e['accuracy']:.2f}" for e in r["eval"])
            print(f"[{len(results):2d}/{len(mixers)}] {r['mixer']:<17} acc {accs}  ({r['train']['steps']} steps, "
                  f"{r['wall_s']:.0f}s)", file=stream, flush=True)
    ordered = [results[m] for m in mixers]
    table = format_table(ordered)
    decode = results[check]["decode_check"]
    wall = time.perf_counter() - start
    summary = {
        "protocol": asdict(base),
        "mixers": mixers,
        "results": ordered,
        "decode_check": {"mixer": check, **decode},
        "table": table,
        "wall_s": wall,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "load_avg_at_end": os.getloadavg()},
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "table.txt").write_text(table + "\n")
    slices = [(s.seq_len, s.num_pairs) for s in base.test_segments]
    plot_accuracy_vs_state(ordered, out / "accuracy_vs_state.png", [slices[1], slices[-1]])
    plot_accuracy_vs_length(ordered, out / "accuracy_vs_length.png")
    plot_training_curve(ordered, out / "training_curves.png")
    print("\n" + table, file=stream)
    print(f"\ndecoding check ({check}, {decode['tokens']} tokens, prefill {decode['prefill']} then one token at a "
          f"time): max relative logit difference {decode['float32']:.1e} (float32), {decode['float64']:.1e} (float64)",
          file=stream)
    print(f"wrote {out}/demo.json, table.txt and PNGs; wall time {wall:.0f}s", file=stream, flush=True)
    return summary
