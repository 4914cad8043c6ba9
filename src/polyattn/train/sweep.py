"""Sweeps over mixers (or named hybrids) × widths × learning rates, reporting the best LR per (mixer, width)
cell (the Zoology convention: each cell is scored by its best learning rate). Cells train in this process or in worker
processes; with an output folder each cell's result is kept in ``cells/`` as it ends, and a rerun reads it."""

import json
import os
from dataclasses import asdict, replace
from pathlib import Path

from polyattn.train.config import check_hybrid_name, check_layer_mixers, layer_name
from polyattn.train.loop import train
from polyattn.train.workers import in_processes


SCORES = ("accuracy", "loss")


class CellsFailed(RuntimeError):
    """Some cells of a sweep raised while training; the others ran to their end."""


def check_score(metric):
    if metric not in SCORES:
        raise ValueError(f"score: expected one of {list(SCORES)}, got {metric!r}")


def score(result, metric="accuracy"):
    """A run's score: the mean of `metric` (accuracy or loss) over its eval slices."""
    return sum(e[metric] for e in result["eval"]) / len(result["eval"])


def best_of(runs, metric="accuracy"):
    """The run of the best `score`: the highest mean accuracy, or the lowest mean loss (ties: the first)."""
    return (min if metric == "loss" else max)(runs, key=lambda r: score(r, metric))


def sweep_cells(base, mixers, widths, lrs, mixer_configs=None, hybrids=None):
    """The run configs of a sweep, mixer by mixer, then width, then lr; a mixer's options are
    ``base.mixer_config`` updated by ``mixer_configs[mixer]`` (options for that mixer alone).

    ``hybrids``: ``{name: layer_mixers}``; a name of it in `mixers` is a cell of that per-layer model, each layer
    with the options a cell of its mixer gets, updated by its entry's own (``{"name": NAME, **options}``)."""
    mixer_configs, hybrids = mixer_configs or {}, hybrids or {}
    check_hybrids(hybrids, base.n_layers)

    def options(mixer):
        return {**base.mixer_config, **mixer_configs.get(mixer, {})}

    def model(mixer):
        if mixer not in hybrids:
            return dict(mixer=mixer, mixer_config=options(mixer), layer_mixers=None)
        layers = [{"name": layer_name(e), **options(layer_name(e)), **({} if isinstance(e, str) else e)} for e in hybrids[mixer]]
        return dict(mixer=mixer, mixer_config={}, layer_mixers=layers)

    return [replace(base, **model(mixer), d_model=width, lr=lr, out_dir=None) for mixer in mixers for width in widths for lr in lrs]


def check_hybrids(hybrids, n_layers):
    """ValueError naming the hybrid unless every ``{name: layer_mixers}`` has a hybrid's name and a list of
    `n_layers` registered mixers (`check_layer_mixers`)."""
    for name, layers in hybrids.items():
        check_hybrid_name("hybrids: name", name)
        try:
            check_layer_mixers(layers, n_layers)
        except ValueError as err:
            raise ValueError(f"hybrids: {name!r}: {err}") from err


def as_json(value):
    """`value` as it reads back from JSON (tuples as lists): a trained cell and a stored one compare equal."""
    return json.loads(json.dumps(value))


def cell_label(config):
    return f"{config.mixer} d={config.d_model}"


def run_label(config):
    return f"{cell_label(config)} lr={config.lr:g}"


def cell_file(folder, config):
    """A cell's result file in `folder` (``OUT/cells``), named by mixer, width and lr (``repr``: distinct lrs, distinct names)."""
    return Path(folder) / f"{config.mixer}-d{config.d_model}-lr{float(config.lr)!r}.json"


def run_cell(config, quiet):
    """One cell's training run as the sweep keeps it: labelled, every 10th history entry, in its JSON form."""
    result, _ = train(config, quiet=quiet, label=run_label(config))
    result["label"] = cell_label(config)
    result["train"]["history"] = result["train"]["history"][::10]
    return as_json(result)


def run_cell_or_error(config, quiet):
    """`run_cell`'s `(result, None)`, or `(None, the error as text)` where training raised: a failing cell (a
    kernel fault on the GPU, say) takes no other cell's result with it."""
    try:
        return run_cell(config, quiet), None
    except Exception as err:  # reported with the cell's name once every other cell has finished
        return None, f"{type(err).__name__}: {err}"


def stored_cells(cells, folder):
    """``{index: result}`` of the cells with a result file in `folder`; ValueError naming a file that is not
    a cell's result or holds a run of another config (never reused)."""
    found = {}
    for i, config in enumerate(cells):
        path = cell_file(folder, config)
        if not path.exists():
            continue
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"sweep cell {str(path)!r}: cannot read it as JSON ({err}); delete it to train the cell again") from err
        stored = result.get("config") if isinstance(result, dict) else None
        if not isinstance(stored, dict):
            raise ValueError(f"sweep cell {str(path)!r}: expected a training result with a 'config'; delete it to train the cell again")
        expected = as_json(asdict(config))
        if stored != expected:
            missing = object()
            differ = sorted(key for key in {*stored, *expected} if stored.get(key, missing) != expected.get(key, missing))
            raise ValueError(f"sweep cell {str(path)!r} holds a run of another config (differs in {differ}); "
                             f"use another output folder or delete the file")
        found[i] = result
    return found


def write_cell(path, result):
    """Write a cell's result whole or not at all (a sweep stopped mid-write leaves no truncated file)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(partial, path)


def sweep(base, mixers, widths, lrs, out_dir=None, quiet=False, mixer_configs=None, workers=1, hybrids=None, metric="accuracy"):
    """Train every (mixer or hybrid, width, lr) (`sweep_cells`); returns ``{"scored_by", "runs": [...], "best": [...]}``
    (each cell's best lr by `best_of` under `metric`) and writes ``sweep.json`` + ``accuracy_vs_state.png`` +
    ``accuracy_vs_length.png`` under `out_dir`.

    ``workers`` > 1: that many cells at a time, each in a fresh process of one CPU thread (`in_processes`; on CUDA
    they share the GPU); ``runs`` stay in `sweep_cells` order. With `out_dir`, every cell's result is written to
    ``out_dir/cells/`` as it ends, and a cell whose file holds a run of the same config is read, not trained. A
    cell whose training raises does not stop the others: once they have ended, `CellsFailed` names every failed
    cell (the same call with the same `out_dir` then trains only those)."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers: expected a positive integer, got {workers!r}")
    check_score(metric)
    cells = sweep_cells(base, mixers, widths, lrs, mixer_configs, hybrids)
    runs = [None] * len(cells)
    folder = Path(out_dir) / "cells" if out_dir else None
    if folder:
        for i, result in stored_cells(cells, folder).items():
            runs[i] = result
        reused = [run_label(config) for config, r in zip(cells, runs) if r is not None]
        if reused and not quiet:
            print(f"reused {len(reused)} of {len(cells)} cells from {folder}: {', '.join(reused)}", flush=True)
        folder.mkdir(parents=True, exist_ok=True)
    todo = [i for i, r in enumerate(runs) if r is None]
    workers = min(workers, len(todo))
    if workers > 1:  # the workers' progress bars would interleave: one line per finished cell instead
        finished = in_processes(run_cell_or_error, [(cells[i], True) for i in todo], workers, fresh=True)
    else:
        finished = ((j, run_cell_or_error(cells[i], quiet)) for j, i in enumerate(todo))
    failed = []
    for done, (j, (result, error)) in enumerate(finished, 1):
        config = cells[todo[j]]
        if error is not None:
            failed.append(f"{run_label(config)}: {error}")
            if not quiet:
                print(f"[{done}/{len(todo)}] {run_label(config)} failed: {error}", flush=True)
            continue
        runs[todo[j]] = result
        if folder:
            write_cell(cell_file(folder, config), result)
        if not quiet:
            values = " ".join(f"{e[metric]:.2f}" for e in result["eval"])
            print(f"[{done}/{len(todo)}] {run_label(config)} {'acc' if metric == 'accuracy' else metric} {values} "
                  f"({result['train']['steps']} steps, {result['train']['seconds']:.0f}s)", flush=True)
    if failed:
        kept = f"the others are in {folder}" if folder else "no output folder keeps the others"
        raise CellsFailed(f"{len(failed)} of {len(todo)} sweep cells failed ({kept}): " + "; ".join(failed))
    best = []
    for mixer in mixers:
        for width in widths:
            cell = [r for r in runs if r["mixer"] == mixer and r["config"]["d_model"] == width]
            best.append(best_of(cell, metric))
    summary = {"scored_by": metric, "runs": runs,
               "best": [{"mixer": b["mixer"], "d_model": b["config"]["d_model"], "lr": b["config"]["lr"], "score": score(b, metric)} for b in best]}
    if out_dir:
        from polyattn.train.plots import plot_accuracy_vs_length, plot_accuracy_vs_state

        out = Path(out_dir)
        (out / "sweep.json").write_text(json.dumps(summary, indent=2) + "\n")
        slices = [(e["length"], e["pairs"]) for e in best[0]["eval"]]
        plot_accuracy_vs_state(best, out / "accuracy_vs_state.png", [slices[0], slices[-1]])
        plot_accuracy_vs_length(best, out / "accuracy_vs_length.png")
    return summary, best


def format_table(results, extra_columns=()):
    """A plain-text table: mixer, the form of its op per layer, params, state floats (at the longest slice),
    accuracy per slice, tok/s."""
    slices = [(e["length"], e["pairs"]) for e in results[0]["eval"]]
    max_train = results[0]["max_train_len"]
    longest = str(max(length for length, _ in slices))
    head = ["mixer", "form", *[c for c, _ in extra_columns], "params", f"state@{longest}"]
    head += [f"T{length}/P{pairs}" + ("*" if length > max_train else "") for length, pairs in slices]
    head += ["train tok/s"]
    rows = []
    for r in results:
        acc = {(e["length"], e["pairs"]): e["accuracy"] for e in r["eval"]}
        form = "+".join(dict.fromkeys(r["forms"])) if "forms" in r else "-"  # a hybrid: each form once
        row = [r.get("label", r["mixer"]), form, *[fn(r) for _, fn in extra_columns], f"{r['params']:,}", f"{r['state_floats'][longest]:,}"]
        row += [f"{acc[s]:.3f}" for s in slices]
        row += [f"{r['train']['tokens_per_s']:,.0f}"]
        rows.append(row)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    lines = ["  ".join(str(x).rjust(w) if i else str(x).ljust(w) for i, (x, w) in enumerate(zip(row, widths))) for row in [head, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    note = f"(* = extrapolation beyond the longest training length {max_train}; state = decoding floats per sequence, all layers)"
    return "\n".join(lines + [note])
