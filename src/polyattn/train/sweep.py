"""Sweeps over mixers × widths × learning rates, reporting the best LR per (mixer, width) cell (the
Zoology convention: each cell is scored by its best learning rate)."""

import json
from dataclasses import replace
from pathlib import Path

from polyattn.train.loop import train


def score(result):
    """A run's score: mean accuracy over its eval slices."""
    return sum(e["accuracy"] for e in result["eval"]) / len(result["eval"])


def sweep_cells(base, mixers, widths, lrs, mixer_configs=None):
    """The run configs of a sweep, mixer by mixer, then width, then lr; a mixer's options are
    ``base.mixer_config`` updated by ``mixer_configs[mixer]`` (options for that mixer alone)."""
    mixer_configs = mixer_configs or {}
    return [replace(base, mixer=mixer, mixer_config={**base.mixer_config, **mixer_configs.get(mixer, {})}, d_model=width, lr=lr,
                    out_dir=None)
            for mixer in mixers for width in widths for lr in lrs]


def sweep(base, mixers, widths, lrs, out_dir=None, quiet=False, mixer_configs=None):
    """Train every (mixer, width, lr) (`sweep_cells`); returns ``{"runs": [...], "best": [...]}`` and writes
    ``sweep.json`` + ``accuracy_vs_state.png`` + ``accuracy_vs_length.png`` under `out_dir`."""
    runs = []
    for config in sweep_cells(base, mixers, widths, lrs, mixer_configs):
        label = f"{config.mixer} d={config.d_model}"
        result, _ = train(config, quiet=quiet, label=f"{label} lr={config.lr:g}")
        result["label"] = label
        result["train"]["history"] = result["train"]["history"][::10]
        runs.append(result)
    best = []
    for mixer in mixers:
        for width in widths:
            cell = [r for r in runs if r["mixer"] == mixer and r["config"]["d_model"] == width]
            best.append(max(cell, key=score))
    summary = {"runs": runs, "best": [{"mixer": b["mixer"], "d_model": b["config"]["d_model"], "lr": b["config"]["lr"], "score": score(b)} for b in best]}
    if out_dir:
        from polyattn.train.plots import plot_accuracy_vs_length, plot_accuracy_vs_state

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "sweep.json").write_text(json.dumps(summary, indent=2) + "\n")
        slices = [(e["length"], e["pairs"]) for e in best[0]["eval"]]
        plot_accuracy_vs_state(best, out / "accuracy_vs_state.png", [slices[0], slices[-1]])
        plot_accuracy_vs_length(best, out / "accuracy_vs_length.png")
    return summary, best


def format_table(results, extra_columns=()):
    """A plain-text table: mixer, params, state floats (at the longest slice), accuracy per slice, tok/s."""
    slices = [(e["length"], e["pairs"]) for e in results[0]["eval"]]
    max_train = results[0]["max_train_len"]
    longest = str(max(length for length, _ in slices))
    head = ["mixer", *[c for c, _ in extra_columns], "params", f"state@{longest}"]
    head += [f"T{length}/P{pairs}" + ("*" if length > max_train else "") for length, pairs in slices]
    head += ["train tok/s"]
    rows = []
    for r in results:
        acc = {(e["length"], e["pairs"]): e["accuracy"] for e in r["eval"]}
        row = [r.get("label", r["mixer"]), *[fn(r) for _, fn in extra_columns], f"{r['params']:,}", f"{r['state_floats'][longest]:,}"]
        row += [f"{acc[s]:.3f}" for s in slices]
        row += [f"{r['train']['tokens_per_s']:,.0f}"]
        rows.append(row)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    lines = ["  ".join(str(x).rjust(w) if i else str(x).ljust(w) for i, (x, w) in enumerate(zip(row, widths))) for row in [head, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    note = f"(* = extrapolation beyond the longest training length {max_train}; state = decoding floats per sequence, all layers)"
    return "\n".join(lines + [note])
