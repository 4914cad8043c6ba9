"""Trainer, sweep and CLI: outputs written, schedule, best-LR selection, clear errors."""

import json

import pytest
import torch

from polyattn.cli import main
from polyattn.models import CausalLM
from polyattn.train import TrainConfig, train
from polyattn.train.loop import lr_lambda
from polyattn.train.sweep import format_table, sweep

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
    assert (tmp_path / "accuracy_vs_length.png").stat().st_size > 0
    ids = torch.randint(64, (1, 12))
    assert torch.equal(CausalLM.from_pretrained(tmp_path / "checkpoint")(ids)[0], model(ids)[0])
    assert "T64/P8*" in format_table([result])


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


@pytest.mark.parametrize(
    "argv, match",
    [
        (["train", "--mixer", "nope"], "unknown mixers ['nope']"),
        (["train", "--task", "nope"], "unknown task 'nope'"),
        (["train", "--steps", "0"], "steps: expected an integer in [1, inf], got 0"),
        (["train", "--train", "64-100-4"], "expected segments like"),
        (["demo", "--mixers", "softmax,nope"], "unknown mixers ['nope']"),
    ],
    ids=["mixer", "task", "steps", "segments", "demo-mixer"],
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
