"""Trainer, sweep and CLI: outputs written, schedule, best-LR selection, clear errors."""

import json
from dataclasses import replace

import pytest
import torch

from polyattn.cli import main
from polyattn.models import CausalLM
from polyattn.train import TrainConfig, train
from polyattn.train.loop import lr_lambda
from polyattn.train.sweep import best_of, format_table, sweep

TINY = dict(
    task_options={"vocab_size": 64},
    train_segments=[(32, 64, 4)],
    test_segments=[(32, 16, 4), (64, 8, 8)],
    d_model=16,
    mixer_config={"num_heads": 2},
    steps=3,
    batch_size=8,
    device="cpu",
)


def test_train_writes_json_plots_and_a_loadable_checkpoint(tmp_path):
    config = TrainConfig(mixer="gdn", out_dir=str(tmp_path), **TINY)
    result, model = train(config, quiet=True)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["train"]["steps"] == 3 and len(saved["eval"]) == 2
    assert [(e["length"], e["pairs"]) for e in saved["eval"]] == [(32, 4), (64, 8)]
    assert saved["state_floats"] == {"32": model.state_size(32), "64": model.state_size(64)}
    assert saved["forms"] == ["chunk"] * config.n_layers  # what "auto" runs for gdn on the CPU
    assert (tmp_path / "accuracy_vs_length.png").stat().st_size > 0
    ids = torch.randint(64, (1, 12))
    assert torch.equal(CausalLM.from_pretrained(tmp_path / "checkpoint")(ids)[0], model(ids)[0])
    assert "T64/P8*" in format_table([result])


HYBRID = [{"name": "gdn", "num_heads": 2, "output_gate": False}, {"name": "softmax", "num_heads": 2}]


def test_train_builds_a_hybrid_and_records_its_layers(tmp_path):
    config = TrainConfig(layer_mixers=HYBRID, out_dir=str(tmp_path), **{**TINY, "mixer_config": {}})
    result, model = train(config, quiet=True)
    assert config.mixer == "gdn+softmax" and [b.mixer.name for b in model.blocks] == ["gdn", "softmax"]
    assert model.blocks[0].mixer.config.output_gate is False
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["mixer"] == "gdn+softmax" and saved["config"]["layer_mixers"] == HYBRID
    assert saved["layer_mixers"] == [{**layer, "impl": "auto"} for layer in HYBRID]
    kv = [model.blocks[1].mixer.state_size(T) for T in (32, 64)]  # softmax: its KV cache grows with T
    assert kv[1] > kv[0] and saved["state_floats"] == {"32": model.blocks[0].mixer.state_size(32) + kv[0],
                                                       "64": model.blocks[0].mixer.state_size(64) + kv[1]}
    ids = torch.randint(64, (1, 12))
    assert torch.equal(CausalLM.from_pretrained(tmp_path / "checkpoint")(ids)[0], model(ids)[0])
    assert saved["forms"] == ["chunk", "sdpa"]
    assert format_table([result]).splitlines()[2].split()[:2] == ["gdn+softmax", "chunk+sdpa"]


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(layer_mixers=["gdn", "softmax", "gdn"]), "layer_mixers: expected 2 entries (one per layer, n_layers=2), got 3"),
        (dict(layer_mixers=["gdn", "softmax"], n_layers=3), "layer_mixers: expected 3 entries"),
        (dict(layer_mixers=["gdn", "nope"]), "layer_mixers[1]: unknown mixer 'nope'"),
        (dict(layer_mixers=[{"num_heads": 2}, "softmax"]), "layer_mixers[0]: expected a mixer name or an object"),
        (dict(layer_mixers="gdn,softmax"), "layer_mixers: expected a list of mixers"),
        (dict(layer_mixers=["gdn", "softmax"], mixer_config={"num_heads": 2}), "mixer_config: with layer_mixers each layer takes its entry's options"),
        (dict(layer_mixers=["gdn", "softmax"], mixer="gdn"), "mixer: with layer_mixers, the hybrid's name: expected"),
        (dict(layer_mixers=["gdn", "softmax"], mixer="a/b"), "mixer: with layer_mixers, the hybrid's name: expected"),
    ],
    ids=["long", "short", "unknown", "no-name", "not-a-list", "mixer-config", "registry-name", "path-name"],
)
def test_layer_mixers_are_checked_with_the_config(changes, match):
    with pytest.raises(ValueError) as err:
        TrainConfig(**{**TINY, "mixer_config": {}, **changes})
    assert match in str(err.value)


def test_schedule_warms_up_then_decays_to_zero():
    f = lr_lambda(100, 0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(50) < f(10) and f(100) == pytest.approx(0.0, abs=1e-12)


def test_sweep_reports_the_best_lr_per_cell(tmp_path):
    base = TrainConfig(mixer="softmax", **TINY)
    summary, best = sweep(base, ["softmax", "linear"], [16], [1e-3, 1e-2], out_dir=str(tmp_path), quiet=True)
    assert len(summary["runs"]) == 4 and len(best) == 2
    for cell, row in zip(best, summary["best"]):
        runs = [r for r in summary["runs"] if r["mixer"] == cell["mixer"]]
        assert row["score"] == max(sum(e["accuracy"] for e in r["eval"]) / 2 for r in runs)
    assert (tmp_path / "sweep.json").exists() and (tmp_path / "accuracy_vs_state.png").exists()


def test_sweep_scored_by_loss_picks_the_lowest_loss_lr(monkeypatch):
    """lr 1e-2 has the higher accuracy, lr 1e-3 the lower loss: accuracy picks one, loss the other."""
    measured = {1e-3: (0.4, 1.5), 1e-2: (0.6, 2.5)}  # lr: (accuracy, loss) on both slices

    def fake_cell(config, quiet):
        accuracy, loss = measured[config.lr]
        return {"mixer": config.mixer, "config": {"d_model": config.d_model, "lr": config.lr}, "eval": [{"accuracy": accuracy, "loss": loss}] * 2,
                "train": {"steps": 1, "seconds": 0.0}}

    monkeypatch.setattr("polyattn.train.sweep.run_cell", fake_cell)
    base = TrainConfig(mixer="linear", **TINY)
    by_loss, best = sweep(base, ["linear"], [16], [1e-3, 1e-2], quiet=True, metric="loss")
    assert by_loss["scored_by"] == "loss" and by_loss["best"] == [{"mixer": "linear", "d_model": 16, "lr": 1e-3, "score": 1.5}]
    assert best[0]["config"]["lr"] == 1e-3
    by_accuracy, _ = sweep(base, ["linear"], [16], [1e-3, 1e-2], quiet=True)
    assert by_accuracy["scored_by"] == "accuracy" and by_accuracy["best"][0]["lr"] == 1e-2
    runs = by_loss["runs"]
    assert best_of(runs, "loss") is runs[0] and best_of(runs) is runs[1]
    with pytest.raises(ValueError, match=r"score: expected one of \['accuracy', 'loss'\], got 'perplexity'"):
        sweep(base, ["linear"], [16], [1e-3], quiet=True, metric="perplexity")


def untimed(runs):
    """A sweep's runs without what the clock measures."""
    return [{**r, "train": {k: v for k, v in r["train"].items() if k not in ("seconds", "tokens_per_s")}} for r in runs]


def test_sweep_on_two_workers_equals_the_serial_sweep():
    base = TrainConfig(mixer="softmax", **TINY)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker runs
    try:
        serial, _ = sweep(base, ["softmax", "linear"], [16], [1e-3, 1e-2], quiet=True)
    finally:
        torch.set_num_threads(threads)
    parallel, best = sweep(base, ["softmax", "linear"], [16], [1e-3, 1e-2], quiet=True, workers=2)
    assert [(r["mixer"], r["config"]["lr"]) for r in parallel["runs"]] == [("softmax", 1e-3), ("softmax", 1e-2), ("linear", 1e-3), ("linear", 1e-2)]
    assert parallel["best"] == serial["best"] and untimed(parallel["runs"]) == untimed(serial["runs"])
    assert [b["label"] for b in best] == ["softmax d=16", "linear d=16"]


def sweep_argv(out, steps=3):
    return ["sweep", "--mixers", "softmax,linear", "--widths", "16", "--lrs", "1e-3,1e-2", "--task-options", '{"vocab_size": 64}',
            "--train", "32:64:4", "--test", "32:16:4,64:8:8", "--mixer-config", '{"num_heads": 2}', "--steps", str(steps),
            "--batch-size", "8", "--device", "cpu", "--out", str(out)]


def test_sweep_rerun_with_the_same_out_reads_its_cells(tmp_path, monkeypatch, capsys):
    import polyattn.train.sweep as sweep_module

    assert main(sweep_argv(tmp_path)) == 0
    first = json.loads((tmp_path / "sweep.json").read_text())
    assert len(list((tmp_path / "cells").glob("*.json"))) == 4
    trained = []
    real_train = sweep_module.train
    monkeypatch.setattr(sweep_module, "train", lambda config, **kw: trained.append(config.mixer) or real_train(config, **kw))
    capsys.readouterr()
    assert main(sweep_argv(tmp_path)) == 0
    assert trained == [] and "reused 4 of 4 cells" in capsys.readouterr().out
    assert json.loads((tmp_path / "sweep.json").read_text()) == first
    (tmp_path / "cells" / "linear-d16-lr0.01.json").unlink()  # a sweep stopped before its last cell
    assert main(sweep_argv(tmp_path)) == 0
    assert trained == ["linear"] and "reused 3 of 4 cells" in capsys.readouterr().out
    assert untimed(json.loads((tmp_path / "sweep.json").read_text())["runs"]) == untimed(first["runs"])


def test_a_failing_sweep_cell_keeps_the_others(tmp_path, monkeypatch):
    """A cell that raises (a GPU fault, say) is named once the others have ended, their results written; the
    same sweep again trains only it."""
    import polyattn.train.sweep as sweep_module

    real_cell = sweep_module.run_cell

    def faulty(config, quiet):
        if config.mixer == "linear" and config.lr == 1e-3:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real_cell(config, quiet)

    monkeypatch.setattr(sweep_module, "run_cell", faulty)
    base = TrainConfig(mixer="softmax", **TINY)
    args = (base, ["softmax", "linear"], [16], [1e-3, 1e-2])
    with pytest.raises(sweep_module.CellsFailed, match=r"1 of 4 sweep cells failed \(the others are in .*cells\): linear d=16 "
                                                      r"lr=0.001: RuntimeError: CUDA error: an illegal memory access"):
        sweep(*args, out_dir=str(tmp_path), quiet=True)
    assert sorted(p.name for p in (tmp_path / "cells").glob("*.json")) == [
        "linear-d16-lr0.01.json", "softmax-d16-lr0.001.json", "softmax-d16-lr0.01.json"]
    assert not (tmp_path / "sweep.json").exists()
    trained = []
    monkeypatch.setattr(sweep_module, "run_cell", lambda config, quiet: trained.append(config.lr) or real_cell(config, quiet))
    summary, _ = sweep(*args, out_dir=str(tmp_path), quiet=True)
    assert trained == [1e-3] and len(summary["runs"]) == 4 and (tmp_path / "sweep.json").exists()


def test_sweep_refuses_a_cell_file_of_another_config(tmp_path, monkeypatch):
    import polyattn.train.sweep as sweep_module

    base = TrainConfig(mixer="linear", **TINY)
    sweep(base, ["linear"], [16], [1e-2], out_dir=str(tmp_path), quiet=True)
    monkeypatch.setattr(sweep_module, "train", lambda *a, **kw: pytest.fail("trained a cell"))
    with pytest.raises(ValueError) as err:
        sweep(replace(base, steps=2), ["linear"], [16], [1e-2], out_dir=str(tmp_path), quiet=True)
    path = str(tmp_path / "cells" / "linear-d16-lr0.01.json")
    assert f"sweep cell {path!r} holds a run of another config (differs in ['steps'])" in str(err.value)


def hybrid_sweep_argv(out):
    return ["sweep", "--mixers", "gdn,gdn+softmax", "--hybrids", '{"gdn+softmax": ["gdn", {"name": "softmax", "num_heads": 4}]}',
            "--mixer-configs", '{"gdn": {"output_gate": false}}', "--widths", "16", "--lrs", "1e-2", "--task-options", '{"vocab_size": 64}',
            "--train", "32:64:4", "--test", "32:16:4,64:8:8", "--mixer-config", '{"num_heads": 2}', "--steps", "2",
            "--batch-size", "8", "--device", "cpu", "--out", str(out)]


def test_sweep_trains_a_hybrid_cell_with_its_mixers_options(tmp_path, capsys):
    assert main(hybrid_sweep_argv(tmp_path)) == 0
    assert "gdn+softmax d=16 " in capsys.readouterr().out  # the table
    summary = json.loads((tmp_path / "sweep.json").read_text())
    assert [b["mixer"] for b in summary["best"]] == ["gdn", "gdn+softmax"]
    gdn, hybrid = summary["runs"]
    assert hybrid["label"] == "gdn+softmax d=16" and gdn["config"]["layer_mixers"] is None
    assert hybrid["config"]["mixer_config"] == {} and hybrid["config"]["layer_mixers"] == [
        {"name": "gdn", "num_heads": 2, "output_gate": False}, {"name": "softmax", "num_heads": 4}]  # --mixer-config, gdn's, its own
    assert json.loads((tmp_path / "cells" / "gdn+softmax-d16-lr0.01.json").read_text()) == hybrid
    assert main(hybrid_sweep_argv(tmp_path)) == 0
    assert "reused 2 of 2 cells" in capsys.readouterr().out


def test_sweep_refuses_bad_hybrids_before_training(monkeypatch):
    import polyattn.train.sweep as sweep_module

    monkeypatch.setattr(sweep_module, "train", lambda *a, **kw: pytest.fail("trained a cell"))
    base = TrainConfig(mixer="linear", **TINY)
    for hybrids, match in [({"h": ["linear", "nope"]}, "hybrids: 'h': layer_mixers[1]: unknown mixer 'nope'"),
                           ({"h": ["linear"]}, "hybrids: 'h': layer_mixers: expected 2 entries"),
                           ({"linear": ["linear", "softmax"]}, "hybrids: name: expected letters, digits and . _ + - other than")]:
        with pytest.raises(ValueError) as err:
            sweep(base, ["linear", *hybrids], [16], [1e-2], quiet=True, hybrids=hybrids)
        assert match in str(err.value)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["train", "--mixer", "nope"], "unknown mixers ['nope']"),
        (["train", "--layer-mixers", '["gdn"]'], "layer_mixers: expected 2 entries (one per layer, n_layers=2), got 1"),
        (["train", "--layer-mixers", "gdn,softmax"], "--layer-mixers: expected a JSON list like"),
        (["train", "--layer-mixers", '["gdn", "softmax"]', "--mixer-config", '{"num_heads": 4}'], "mixer_config: with layer_mixers"),
        (["train", "--task", "nope"], "unknown task 'nope'"),
        (["train", "--steps", "0"], "steps: expected an integer in [1, inf], got 0"),
        (["train", "--train", "64-100-4"], "expected segments like"),
        (["demo", "--mixers", "softmax,nope"], "unknown mixers ['nope']"),
    ],
    ids=["mixer", "layer-mixers-length", "layer-mixers-json", "layer-mixers-mixer-config", "task", "steps", "segments", "demo-mixer"],
)
def test_cli_reports_invalid_configs(argv, match, capsys):
    assert main(argv) == 2
    assert match in capsys.readouterr().err


def test_cli_train_runs(tmp_path, capsys):
    argv = ["train", "--mixer", "kata-m2", "--task", "overwrite", "--task-options", '{"vocab_size": 64, "num_updates": 2}',
            "--train", "64:32:4", "--test", "64:8:4", "--d-model", "16", "--steps", "2", "--batch-size", "4",
            "--out", str(tmp_path)]
    assert main(argv) == 0
    assert "kata-m2" in capsys.readouterr().out
    assert json.loads((tmp_path / "results.json").read_text())["mixer"] == "kata-m2"


def test_cli_train_runs_a_hybrid(tmp_path, capsys):
    argv = ["train", "--layer-mixers", '["kata-m2", {"name": "softmax", "num_heads": 1}]', "--task-options", '{"vocab_size": 64}',
            "--train", "64:32:4", "--test", "64:8:4", "--d-model", "16", "--steps", "2", "--batch-size", "4", "--out", str(tmp_path)]
    assert main(argv) == 0
    assert "kata-m2+softmax" in capsys.readouterr().out
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["mixer"] == "kata-m2+softmax" and [layer["name"] for layer in saved["layer_mixers"]] == ["kata-m2", "softmax"]
    assert CausalLM.from_pretrained(tmp_path / "checkpoint").blocks[1].mixer.heads == 1
