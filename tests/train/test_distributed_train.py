"""Training on several processes (gloo, CPU, float64): DDP, FSDP2 and context parallelism on 2 and 4 ranks
equal one process on the whole batch, evaluation reduced across ranks equals one process, a sharded training state saved
on 2 ranks loads on 1 and on 4 with identical weights and resumes to the uninterrupted run; the CLI under
torchrun. Every spawned job runs several checks and is bounded in time."""

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from polyattn.testing import run_ranks
from polyattn.train import TrainConfig, train
from polyattn.train.distributed import full_model_state
from polyattn.train.loop import build_data, build_model

TIMEOUT_S = 120
# A tiny model in float64. Two train segments of one length with different pair counts: the ranks' rows hold
# different numbers of scored tokens, so a per-rank mean would be wrong. The clip threshold is below the
# gradient norm (the global norm must be used); test slices of 10 and 6 rows leave ranks idle in evaluation.
# Log-linear Gated DeltaNet has a matrix exempt from weight decay (λ's scales) that sharding must keep exempt.
TINY = TrainConfig(
    task_options={"vocab_size": 64},
    train_segments=[(32, 64, 4), (32, 64, 2)],
    test_segments=[(32, 10, 4), (48, 6, 6)],
    mixer="loglinear-gdn",
    mixer_config={"num_heads": 2},
    d_model=16,
    mlp_ratio=2.0,
    steps=3,
    batch_size=8,
    eval_batch_size=2,
    lr=1e-2,
    grad_clip=0.05,
    device="cpu",
    checkpoint=False,
)

# torch.compile on every block, kept cheap: one block, every forward of one shape (rows per rank = eval batch).
COMPILED = replace(TINY, mixer="kata-m2", n_layers=1, test_segments=[(32, 8, 4)], eval_batch_size=4, compile="aot_eager")


def run(config):
    """Train `config`; ``(eval rows, loss history, whole weights)``, the weights gathered under FSDP (every
    rank calls it; the others get no weights)."""
    result, model = train(config, quiet=True)
    weights = full_model_state(model) if config.parallel == "fsdp" else {k: v.clone() for k, v in model.state_dict().items()}
    return result["eval"], [h["loss"] for h in result["train"]["history"]], weights


def job_two_ranks(tmp):
    """DDP and FSDP runs; FSDP on compiled blocks; an FSDP run that saves its state at steps 2 and 3; a resume
    from step 2."""
    out = {"ddp": run(replace(TINY, parallel="ddp")), "fsdp": run(replace(TINY, parallel="fsdp")), "cp": run(replace(TINY, parallel="cp"))}
    out["compiled"] = run(replace(COMPILED, parallel="fsdp"))
    saving = replace(TINY, parallel="fsdp", out_dir=os.path.join(tmp, "saved"), save_every=2)
    out["saving"] = run(saving)
    out["resumed"] = run(replace(TINY, parallel="fsdp", resume=os.path.join(tmp, "saved", "train_state", "step-2")))
    return out


def job_four_ranks(tmp):
    """A DDP run on 4 ranks; the 2-rank state loaded on 4 FSDP ranks at step 3 (no step left) and at step 2
    (one more step on 4 ranks)."""
    state = os.path.join(tmp, "saved", "train_state")
    return {
        "ddp": run(replace(TINY, parallel="ddp")),
        "cp": run(replace(TINY, parallel="cp")),
        "loaded": run(replace(TINY, parallel="fsdp", resume=os.path.join(state, "step-3"))),
        "resumed": run(replace(TINY, parallel="fsdp", resume=os.path.join(state, "step-2"))),
    }


JOBS = {"two": job_two_ranks, "four": job_four_ranks}


def rank_main(rank, world_size, tmp, job):
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg-{job}", rank=rank, world_size=world_size)
    try:
        out = JOBS[job](tmp)
        if rank == 0:
            torch.save(out, os.path.join(tmp, f"{job}.pt"))
    finally:
        dist.destroy_process_group()


def spawn(job, world_size, tmp):
    """Run `job` on `world_size` gloo ranks; its rank-0 output. Fails (and stops the ranks) after TIMEOUT_S."""
    run_ranks(rank_main, world_size, (world_size, str(tmp), job), timeout=TIMEOUT_S)
    return torch.load(tmp / f"{job}.pt", weights_only=False)


@pytest.fixture
def float64():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def assert_same_run(got, want, name, tol=1e-10):
    """Eval rows, loss history and weights of two runs equal to ``tol`` (relative to each tensor's size)."""
    (got_eval, got_losses, got_weights), (want_eval, want_losses, want_weights) = got, want
    assert got_losses == pytest.approx(want_losses, rel=tol), f"{name}: train losses"
    for g, w in zip(got_eval, want_eval):
        assert g["accuracy"] == w["accuracy"] and g["loss"] == pytest.approx(w["loss"], rel=tol), f"{name}: eval {g['length']}"
        assert g["loss_by_position"] == pytest.approx(w["loss_by_position"], rel=tol, nan_ok=False), f"{name}: eval by position"
    assert got_weights.keys() == want_weights.keys(), name
    for key, w in want_weights.items():
        err = (got_weights[key] - w).abs().max() / w.abs().max().clamp_min(1e-30)
        assert err <= tol, f"{name}: {key} differs by {float(err):.2e} (relative)"


def test_ranks_train_as_one_process_and_sharded_states_load_on_other_world_sizes(tmp_path, float64):
    one = run(TINY)  # the reference: one process, the whole batch
    torch.manual_seed(TINY.seed)
    build_data(TINY)
    start = build_model(TINY).state_dict()  # the initial weights, drawn as `train` draws them
    assert all(not torch.equal(start[k], w) for k, w in one[2].items()), "every parameter moves in 3 steps"
    unclipped = run(replace(TINY, grad_clip=float("inf")))[2]
    assert not torch.equal(unclipped["embed.weight"], one[2]["embed.weight"]), "the gradients are clipped"

    two = spawn("two", 2, tmp_path)
    for name in ("ddp", "fsdp", "cp", "saving", "resumed"):
        assert_same_run(two[name], one, f"2 ranks {name}")
    assert_same_run(two["compiled"], run(replace(COMPILED, compile=None)), "2 ranks fsdp, compiled blocks")

    # 2 -> 1: the state at step 3 loads with identical weights; from step 2 the run continues as uninterrupted
    state = tmp_path / "saved" / "train_state"
    loaded = run(replace(TINY, resume=str(state / "step-3")))
    for key, w in two["saving"][2].items():
        assert torch.equal(loaded[2][key], w), f"2 -> 1: {key}"
    assert_same_run(loaded, one, "2 -> 1 loaded")
    assert_same_run(run(replace(TINY, resume=str(tmp_path / "saved"))), one, "2 -> 1 latest")  # an output folder: its latest
    assert_same_run(run(replace(TINY, resume=str(state / "step-2"))), one, "2 -> 1 resumed")

    four = spawn("four", 4, tmp_path)
    for key, w in two["saving"][2].items():
        assert torch.equal(four["loaded"][2][key], w), f"2 -> 4: {key}"
    for name in ("ddp", "cp", "loaded", "resumed"):
        assert_same_run(four[name], one, f"4 ranks {name}")


def test_torchrun_launches_the_cli_on_two_ranks(tmp_path):
    argv = ["--task", "mqar", "--task-options", '{"vocab_size": 64}', "--mixer", "linear", "--mixer-config", '{"num_heads": 2}',
            "--train", "32:64:4", "--test", "32:6:4", "--d-model", "16", "--steps", "2", "--batch-size", "4", "--device", "cpu"]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "polyattn", "train"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(launch + argv + ["--parallel", "fsdp", "--save-every", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("wrote ") == 7, done.stdout  # rank 0 only: results, 3 plots, checkpoint, 2 states
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["world_size"] == 2 and results["config"]["parallel"] == "fsdp"
    assert sorted(p.name for p in (tmp_path / "train_state").iterdir()) == ["step-1", "step-2"]
    from polyattn.models import CausalLM

    CausalLM.from_pretrained(tmp_path / "checkpoint")  # the gathered whole model


TORCHRUN_ENV = {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "MASTER_ADDR": "localhost", "MASTER_PORT": "1"}


@pytest.mark.parametrize(
    "options, env, match",
    [
        (dict(parallel="ddp"), {}, "runs under torchrun"),
        (dict(parallel="fsdp"), TORCHRUN_ENV, "batch_size: expected a multiple of the world size 3"),
        (dict(parallel="tp"), {}, "parallel: expected one of"),
        (dict(save_every=2), {}, "expected an out_dir"),
        (dict(compile="nope"), {}, "compile: expected a torch.compile backend"),
        (dict(resume="/nonexistent"), {}, "resume: expected a training state"),
        (dict(parallel="cp"), TORCHRUN_ENV, r"under parallel='cp' each length is split evenly over the 3 ranks, got lengths \[32\]"),
        (dict(parallel="cp", mixer="softmax", mixer_config={}), TORCHRUN_ENV, "needs a mixer with a chunk summary"),
    ],
    ids=["no-torchrun", "batch-split", "unknown", "save-without-out", "backend", "resume-missing", "cp-length-split", "cp-softmax"],
)
def test_bad_parallel_options_raise_value_error_before_any_work(options, env, match, monkeypatch):
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=match):
        train(replace(TINY, **options), quiet=True)
