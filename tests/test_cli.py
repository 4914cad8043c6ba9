import subprocess
import sys

import pytest
import torch

from polyattn.cli import main


def test_info_lists_ops(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "polyattn 0.1.0" in out
    assert "linear_attn" in out and "chunk" in out and "delta_rule" in out


def test_python_dash_m_entry_point():
    done = subprocess.run([sys.executable, "-m", "polyattn", "info"], capture_output=True, text=True, check=True)
    assert "torch" in done.stdout


BAD_TRAIN_ARGS = {
    "grad-clip-negative": (["--grad-clip", "-1"], "grad_clip: expected a number in (0, inf]"),
    "early-stop-above-1": (["--early-stop", "2.0"], "early_stop: expected a number in (0, 1]"),
    "mixer-config-not-json": (["--mixer-config", "{bad"], "--mixer-config: expected a JSON object"),
    "mixer-config-list": (["--mixer-config", "[1]"], "--mixer-config: expected a JSON object"),
    "mixer-config-type": (["--mixer-config", '{"num_heads": "4"}'], "num_heads (mixer 'kata-m2'): expected an integer >= 1"),
    "mixer-config-unknown": (["--mixer-config", '{"bogus": 1}'], "unknown options ['bogus']"),
    "train-pair": (["--train", "16:40"], "--train: expected seq_len:examples:pairs triples"),
    "test-zero": (["--test", "64:0:4"], "segment: expected num_examples an integer >= 1"),
    "device-bogus": (["--device", "bogus"], "device: expected auto, cpu, cuda or cuda:N"),
    "impl-bogus": (["--impl", "fast"], "impl: expected 'auto' or one of"),
    "task-options": (["--task-options", '{"vocab": 3}'], "task_options:"),
    "steps-zero": (["--steps", "0"], "steps: expected an integer in [1, inf]"),
    "lr-nan": (["--lr", "nan"], "lr: expected a number in (0, inf)"),
    "warmup-1": (["--warmup", "1"], "warmup: expected a number in [0, 1)"),
    "mixer": (["--mixer", "bogus"], "unknown mixer"),
}


@pytest.mark.parametrize("case", list(BAD_TRAIN_ARGS))
def test_train_rejects_bad_arguments_before_any_work(case, capsys, tmp_path):
    args, message = BAD_TRAIN_ARGS[case]
    out = tmp_path / "run"
    assert main(["train", "--steps", "1", "--out", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("polyattn: error: ") and message in err, err
    assert "Traceback" not in err and not (out / "results.json").exists()


def test_device_cuda_refused_without_cuda(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU build, wherever the test runs
    assert main(["train", "--device", "cuda"]) == 2
    assert "device: 'cuda' needs CUDA" in capsys.readouterr().err


def test_out_that_cannot_be_created_is_refused_first(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    for command in (["train"], ["sweep", "--mixers", "linear"], ["demo", "--mixers", "linear"]):
        assert main([*command, "--steps", "1", "--out", str(blocker / "run")]) == 2
        assert "out: cannot create the output folder" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["sweep", "--widths", "64,x"], "--widths: expected a comma-separated list of int"),
        (["sweep", "--lrs", ""], "--lrs: expected at least one value"),
        (["sweep", "--mixers", "linear", "--widths", "63", "--mixer-config", '{"num_heads": 2}'], "divisible by num_heads"),
        (["sweep", "--workers", "0"], "--workers: expected a positive integer, got 0"),
        (["demo", "--workers", "0"], "--workers: expected a positive integer"),
        (["demo", "--mixers", "bogus"], "unknown mixers ['bogus']"),
    ],
    ids=["sweep-widths", "sweep-lrs", "sweep-cell", "sweep-workers", "demo-workers", "demo-mixers"],
)
def test_sweep_and_demo_reject_bad_arguments(args, message, capsys, tmp_path):
    assert main([*args, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("polyattn: error: ") and message in err, err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--skip", "sdpa-flash"], "--skip: expected IMPL:D pairs"),
        (["--dims", "0"], "--dims: expected positive integers"),
        (["--ops", "kata_m1", "mamba"], "--ops: unknown ['mamba']"),
        ([], "bench: needs a CUDA GPU"),
    ],
    ids=["skip", "dims", "ops", "gpu"],
)
def test_bench_rejects_bad_arguments_first(args, message, capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU build, wherever the test runs
    assert main(["bench", "kernels", "--out", str(tmp_path / "b"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("polyattn: error: ") and message in err, err
    assert not (tmp_path / "b").exists()
