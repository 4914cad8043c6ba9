"""The training loop: data, AdamW with warmup + cosine, grad clipping, bf16 autocast on CUDA, evaluation
sliced by (length, pairs) with the loss at every position, JSON results, PNG plots and a checkpoint."""

import inspect
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from polyattn.models import CausalLM, LMConfig
from polyattn.tasks import IGNORE_INDEX, TASKS, concat_data, make_task

TEST_SEED_OFFSET = 1_000_003
EARLY_STOP_WINDOW = 20


def resolve_device(name):
    """``"auto"`` (cuda if available), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``; ValueError for anything this build cannot run."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device: expected auto, cpu, cuda or cuda:N, got {name!r}") from err
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device: expected auto, cpu, cuda or cuda:N, got {name!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: {name!r} needs CUDA, but this torch build or machine has none (use cpu or auto)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device: expected cuda:0 ... cuda:{torch.cuda.device_count() - 1}, got {name!r}")
    return device


def prepare_out_dir(path):
    """Create the output folder (parents included) before any work; ValueError if it cannot be created or written."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"out: cannot create the output folder {str(out)!r} ({err.strerror or err})") from err
    if not os.access(out, os.W_OK | os.X_OK):
        raise ValueError(f"out: the output folder {str(out)!r} is not writable")
    return out


def check_runnable(config):
    """What can fail before training, checked first: the device, the op form, every model and mixer option
    (the model is built on the meta device, no memory), the task options (one example per segment) and the
    output folder (created). Returns the device."""
    from polyattn.ops.common import FORMS

    device = resolve_device(config.device)
    if config.impl not in ("auto", *FORMS):
        raise ValueError(f"impl: expected 'auto' or one of {list(FORMS)}, got {config.impl!r}")
    try:
        with torch.device("meta"):
            build_model(config)
    except TypeError as err:
        raise ValueError(f"mixer_config: invalid options {config.mixer_config} for mixer {config.mixer!r} ({err})") from err
    for seg in (*config.train_segments, *config.test_segments):
        try:
            make_task(config.task, 1, seg.seq_len, seg.num_pairs, seed=0, **config.task_options)
        except TypeError as err:
            raise ValueError(f"task_options: {err}") from err
    if config.out_dir:
        prepare_out_dir(config.out_dir)
    return device


def task_vocab_size(config):
    """The task's vocabulary: `task_options["vocab_size"]` or the generator's default."""
    default = inspect.signature(TASKS[config.task]).parameters["vocab_size"].default
    return config.task_options.get("vocab_size", default)


def build_data(config):
    """Train data grouped by length (one `TaskData` per length) and one `TaskData` per test segment; a task
    with a ``split`` option (``text``) draws the test segments from its validation split."""
    has_split = "split" in inspect.signature(TASKS[config.task]).parameters

    def make(seg, seed, split="train"):
        options = {**config.task_options, **({"split": split} if has_split else {})}
        return make_task(config.task, seg.num_examples, seg.seq_len, seg.num_pairs, seed=seed, **options)

    by_length = {}
    for i, seg in enumerate(config.train_segments):
        by_length.setdefault(seg.seq_len, []).append(make(seg, config.seed + i))
    train = [concat_data(group) for group in by_length.values()]
    test = [make(seg, config.seed + TEST_SEED_OFFSET + i, "validation") for i, seg in enumerate(config.test_segments)]
    return train, test


def build_model(config):
    lm = LMConfig(
        vocab_size=task_vocab_size(config),
        d_model=config.d_model,
        n_layers=config.n_layers,
        mixer=config.mixer,
        mixer_config={"impl": config.impl, **config.mixer_config},
        mlp_ratio=config.mlp_ratio,
    )
    return CausalLM(lm)


def param_groups(model, weight_decay):
    """Weight decay on matrices only: not on norms, biases, gate/λ parameters (``_no_weight_decay``)."""
    decay, no_decay = [], []
    for p in model.parameters():
        (no_decay if p.ndim < 2 or getattr(p, "_no_weight_decay", False) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_lambda(steps, warmup):
    """Linear warmup over ``warmup·steps`` steps, then cosine decay to 0."""
    warm = max(1, int(warmup * steps))

    def factor(step):
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))

    return factor


def autocast(device, bf16):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" and bf16 else nullcontext()


def scored_logits(model, inputs, labels):
    """Logits and targets on scored positions only (the head runs on those rows only), and their mask."""
    hidden, _ = model.hidden_states(inputs)  # [B, T, d]
    mask = labels != IGNORE_INDEX  # [B, T]
    return model.logits(hidden[mask]).float(), labels[mask], mask  # [n, d] -> [n, vocab]; [n]; [B, T]


def scored_loss(model, inputs, labels):
    """Cross-entropy and correct count on scored positions only."""
    logits, target, _ = scored_logits(model, inputs, labels)
    return F.cross_entropy(logits, target), (logits.argmax(-1) == target).sum(), target.numel()


@torch.no_grad()
def evaluate(model, test, batch_size, device, bf16=True, quiet=True):
    """Per slice, on scored positions: accuracy, mean loss and the mean loss at each position t (None where
    nothing is scored): ``[{"length", "pairs", "accuracy", "loss", "loss_by_position", "examples"}]``."""
    model.eval()
    rows = []
    batches = sum(-(-len(data) // batch_size) for data in test)
    progress = tqdm(total=batches, desc="eval", unit="batch", disable=quiet, file=sys.stderr, mininterval=1.0, dynamic_ncols=True)
    for data in test:
        loss_sum = torch.zeros(data.length, dtype=torch.float64)
        count = torch.zeros(data.length, dtype=torch.float64)
        correct = 0
        for i in range(0, len(data), batch_size):
            inputs = data.inputs[i : i + batch_size].to(device)
            labels = data.labels[i : i + batch_size].to(device)
            with autocast(device, bf16):
                logits, target, mask = scored_logits(model, inputs, labels)
            losses = F.cross_entropy(logits, target, reduction="none").double().cpu()  # [n]
            position = mask.nonzero()[:, 1].cpu()  # [n] the t of each scored token
            loss_sum.index_add_(0, position, losses)
            count += torch.bincount(position, minlength=data.length).double()
            correct += int((logits.argmax(-1) == target).sum())
            progress.update()
        total = int(count.sum())
        by_position = [s / c if c else None for s, c in zip(loss_sum.tolist(), count.tolist())]
        rows.append({
            "length": data.length, "pairs": data.pairs, "accuracy": correct / max(total, 1),
            "loss": float(loss_sum.sum()) / max(total, 1), "loss_by_position": by_position, "examples": len(data),
        })
    progress.close()
    model.train()
    return rows


def train(config, quiet=False, label=None):
    """Train one model; returns the results dict (and writes JSON/PNG/checkpoint under `out_dir`)."""
    device = check_runnable(config)
    torch.manual_seed(config.seed)
    train_data, test_data = build_data(config)
    model = build_model(config).to(device)
    opt = torch.optim.AdamW(param_groups(model, config.weight_decay), lr=config.lr, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(config.steps, config.warmup))
    gen = torch.Generator().manual_seed(config.seed)
    weights = torch.tensor([float(len(d)) for d in train_data])
    progress = tqdm(total=config.steps, desc=label or f"{config.mixer} lr={config.lr:g}", unit="step", disable=quiet,
                    file=sys.stderr, mininterval=1.0, dynamic_ncols=True)
    history, tokens, train_seconds, step = [], 0, 0.0, 0
    for step in range(1, config.steps + 1):
        t0 = time.perf_counter()
        data = train_data[int(torch.multinomial(weights, 1, generator=gen))]
        idx = torch.randint(len(data), (config.batch_size,), generator=gen)
        inputs, labels = data.inputs[idx].to(device), data.labels[idx].to(device)
        with autocast(device, config.bf16):
            loss, correct, n = scored_loss(model, inputs, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        opt.step()
        sched.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        train_seconds += time.perf_counter() - t0
        tokens += inputs.numel()
        acc = int(correct) / max(n, 1)
        history.append({"step": step, "loss": loss.item(), "accuracy": acc})
        progress.set_postfix(loss=f"{history[-1]['loss']:.4g}", acc=f"{acc:.3f}", tok_s=f"{tokens / train_seconds:,.0f}", refresh=False)
        progress.update()
        window = history[-EARLY_STOP_WINDOW:]
        if config.early_stop is not None and len(window) == EARLY_STOP_WINDOW:
            if sum(h["accuracy"] for h in window) / EARLY_STOP_WINDOW >= config.early_stop:
                break
    progress.close()
    results = {
        "config": asdict(config),
        "mixer": config.mixer,
        "params": model.num_parameters(),
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "train": {
            "steps": step,
            "tokens": tokens,
            "seconds": train_seconds,
            "tokens_per_s": tokens / max(train_seconds, 1e-9),
            "final_loss": history[-1]["loss"],
            "history": history,
        },
        "eval": evaluate(model, test_data, config.eval_batch_size, device, config.bf16, quiet),
        "state_floats": {str(s.seq_len): model.state_size(s.seq_len) for s in config.test_segments},
        "max_train_len": config.max_train_len,
    }
    if config.out_dir:
        results["files"] = write_results(model, results, config)
    return results, model


def write_results(model, results, config):
    """results.json always; PNGs when matplotlib is installed (else a notice); the checkpoint if asked.
    Returns the paths written."""
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    written = [out / "results.json"]
    try:
        from polyattn.train.plots import plot_accuracy_vs_length, plot_loss_by_position, plot_training_curve
    except ImportError as err:
        print(f"polyattn: no PNG plots ({err}); install polyattn[demo]", file=sys.stderr)
    else:
        for plot, name in ((plot_accuracy_vs_length, "accuracy_vs_length.png"), (plot_training_curve, "training_curve.png"),
                           (plot_loss_by_position, "loss_by_position.png")):
            plot([results], out / name)
            written.append(out / name)
    if config.checkpoint:
        model.save_pretrained(out / "checkpoint")
        written.append(out / "checkpoint")
    return [str(p) for p in written]
