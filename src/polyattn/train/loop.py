"""The training loop: data, AdamW with warmup + cosine, grad clipping, bf16 autocast on CUDA, evaluation
sliced by (length, pairs) with the loss at every position, JSON results, PNG plots and a checkpoint; on one
process or on several (DDP or FSDP2, `polyattn.train.distributed`), with resumable sharded training states."""

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
from torch import nn
from tqdm.auto import tqdm

from polyattn.layers import mixer_form
from polyattn.models import CausalLM, LMConfig
from polyattn.tasks import IGNORE_INDEX, TASKS, concat_data, make_task
from polyattn.train.distributed import (
    Ranks,
    check_parallel,
    find_train_state,
    full_model_state,
    load_train_state,
    parallelize,
    process_group,
    save_train_state,
)

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
    (the model is built on the meta device, no memory), the task options (one example per segment), the
    multi-process launch, the training state to resume from and the output folder (created). Returns the device."""
    from polyattn.ops.common import FORMS

    device = resolve_device(config.device)
    if config.impl not in ("auto", *FORMS):
        raise ValueError(f"impl: expected 'auto' or one of {list(FORMS)}, got {config.impl!r}")
    try:
        with torch.device("meta"):
            build_model(config)
    except TypeError as err:
        where = (f"mixer_config: invalid options {config.mixer_config} for mixer {config.mixer!r}" if config.layer_mixers is None
                 else f"layer_mixers: invalid options in {config.layer_mixers}")
        raise ValueError(f"{where} ({err})") from err
    for seg in (*config.train_segments, *config.test_segments):
        try:
            make_task(config.task, 1, seg.seq_len, seg.num_pairs, seed=0, **config.task_options)
        except TypeError as err:
            raise ValueError(f"task_options: {err}") from err
    check_parallel(config, device)
    if config.resume:
        find_train_state(config.resume)
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
    """The run's `CausalLM`: ``mixer`` with ``mixer_config`` in every layer, or the ``layer_mixers``; every
    layer's mixer takes ``config.impl`` unless its options name one."""
    shape = dict(vocab_size=task_vocab_size(config), d_model=config.d_model, n_layers=config.n_layers, mlp_ratio=config.mlp_ratio)
    if config.layer_mixers is None:
        return CausalLM(LMConfig(mixer=config.mixer, mixer_config={"impl": config.impl, **config.mixer_config}, **shape))
    layers = [{"impl": config.impl, **({"name": entry} if isinstance(entry, str) else entry)} for entry in config.layer_mixers]
    return CausalLM(LMConfig(mixer=layers[0]["name"], layer_mixers=layers, **shape))


def layer_forms(model, config, device):
    """Per layer, the form of its op its mixer runs at the longest training length (``impl="auto"`` resolved
    for this device and the training dtype: e.g. "triton" or "chunk"; "sdpa" for softmax)."""
    dtype = torch.bfloat16 if device.type == "cuda" and config.bf16 else torch.float32
    return [mixer_form(name, options.get("impl", "auto"), config.max_train_len, device.type, dtype,
                       getattr(block.mixer, "group_width", 16))
            for (name, options), block in zip(model.config.layer_specs(), model.blocks)]


def no_weight_decay(model):
    """Names of the parameters without weight decay: norms, biases, gate/λ parameters (``_no_weight_decay``)."""
    return {name for name, p in model.named_parameters() if p.ndim < 2 or getattr(p, "_no_weight_decay", False)}


def param_groups(model, weight_decay, exempt):
    """Weight decay on matrices only, none on the parameters named in ``exempt`` (`no_weight_decay`, taken
    before FSDP replaces the parameters: its sharded ones lose the ``_no_weight_decay`` mark)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if name in exempt else decay).append(p)
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


class ScoredLoss(nn.Module):
    """The model and its objective in one forward (what DDP and FSDP wrap, so every parameter use is inside
    the wrapped call): ``(inputs [B, T], labels [B, T]) -> (losses [n], hits [n], mask [B, T])``, the
    cross-entropy and correctness of each scored position (the head runs on those rows only) and where they are."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, inputs, labels):
        hidden, _ = self.lm.hidden_states(inputs)  # [B, T, d]
        mask = labels != IGNORE_INDEX  # [B, T]
        logits = self.lm.logits(hidden[mask])  # [n, d] -> [n, vocab]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 autocast: the loss in fp32
        target = labels[mask]  # [n]
        return F.cross_entropy(logits, target, reduction="none"), logits.argmax(-1) == target, mask


def eval_rows(n, batch_size, ranks):
    """This rank's batches of ``n`` rows as ``(start, stop)``: contiguous shares of ``ceil(n / world)`` rows,
    the same number of batches on every rank (FSDP's collectives run in lockstep); an empty batch
    (``start == stop``) at the end of a short share."""
    share = -(-n // ranks.world_size)
    first = min(ranks.rank * share, n)
    last = min(first + share, n)
    return [(min(first + i, last), min(first + i + batch_size, last)) for i in range(0, share, batch_size)]


@torch.no_grad()
def evaluate(model, test, batch_size, device, bf16=True, quiet=True, ranks=Ranks()):
    """Per slice, on scored positions: accuracy, mean loss and the mean loss at each position t (None where
    nothing is scored): ``[{"length", "pairs", "accuracy", "loss", "loss_by_position", "examples"}]``.
    ``model``: a `CausalLM`, or the (DDP- or FSDP-wrapped) `ScoredLoss` of a run; under several ranks each
    evaluates its share of every slice and the sums are reduced across ranks."""
    objective = ScoredLoss(model) if isinstance(model, CausalLM) else model
    objective.eval()
    rows = []
    batches = [eval_rows(len(data), batch_size, ranks) for data in test]
    progress = tqdm(total=sum(map(len, batches)), desc="eval", unit="batch", disable=quiet or not ranks.main, file=sys.stderr,
                    mininterval=1.0, dynamic_ncols=True)
    for data, spans in zip(test, batches):
        sums = torch.zeros(2 * data.length + 1, dtype=torch.float64, device=device)  # loss sums, counts per t; hits
        for start, stop in spans:
            idle = start == stop  # this rank's share ran out: a forward all the same (lockstep), nothing counted
            chosen = slice(0, 1) if idle else slice(start, stop)
            with autocast(device, bf16):
                losses, hits, mask = objective(data.inputs[chosen].to(device), data.labels[chosen].to(device))
            if not idle:
                position = mask.nonzero()[:, 1]  # [n] the t of each scored token
                sums[: data.length].index_add_(0, position, losses.double())
                sums[data.length : 2 * data.length] += torch.bincount(position, minlength=data.length).double()
                sums[-1] += hits.sum()
            progress.update()
        loss_sum, count, correct = ranks.sum(sums).cpu().split([data.length, data.length, 1])
        total = int(count.sum())
        by_position = [s / c if c else None for s, c in zip(loss_sum.tolist(), count.tolist())]
        rows.append({
            "length": data.length, "pairs": data.pairs, "accuracy": int(correct) / max(total, 1),
            "loss": float(loss_sum.sum()) / max(total, 1), "loss_by_position": by_position, "examples": len(data),
        })
    progress.close()
    objective.train()
    return rows


def train(config, quiet=False, label=None):
    """Train one model; returns the results dict (and writes JSON/PNG/checkpoint under `out_dir`) and the model.

    ``config.parallel`` ``"ddp"`` or ``"fsdp"``: one rank of a ``torchrun`` launch (or of a process group the
    caller created); progress and files on rank 0 only, the results identical on every rank, the returned
    `CausalLM` sharded under FSDP. ``config.resume``: continue from a training state written by a run of the
    same configuration (any world size)."""
    device = check_runnable(config)
    with process_group(config, device) as (device, ranks):
        return train_on(config, device, ranks, quiet, label)


def train_on(config, device, ranks, quiet, label):
    """`train` inside the process group: ``device`` this rank's device."""
    torch.manual_seed(config.seed)
    train_data, test_data = build_data(config)
    model = build_model(config).to(device)
    exempt = no_weight_decay(model)
    objective = parallelize(ScoredLoss(model), config, device, ranks)
    opt = torch.optim.AdamW(param_groups(model, config.weight_decay, exempt), lr=config.lr, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(config.steps, config.warmup))
    gen = torch.Generator().manual_seed(config.seed)
    progress = {"step": 0, "tokens": 0, "seconds": 0.0, "history": [], "generator": gen.get_state()}
    if config.resume:
        progress = load_train_state(find_train_state(config.resume), objective, opt, sched, progress)
        gen.set_state(progress["generator"])
    history, states = progress["history"], []
    weights = torch.tensor([float(len(d)) for d in train_data])
    bar = tqdm(total=config.steps, initial=progress["step"], desc=label or f"{config.mixer} lr={config.lr:g}", unit="step",
               disable=quiet or not ranks.main, file=sys.stderr, mininterval=1.0, dynamic_ncols=True)
    for step in range(progress["step"] + 1, config.steps + 1):
        t0 = time.perf_counter()
        data = train_data[int(torch.multinomial(weights, 1, generator=gen))]
        idx = torch.randint(len(data), (config.batch_size,), generator=gen)  # the global batch, the same on every rank
        scored = int((data.labels[idx] != IGNORE_INDEX).sum())  # scored tokens in the global batch
        inputs, labels = (ranks.share(x, idx, config.parallel).to(device) for x in (data.inputs, data.labels))  # this rank's part
        with autocast(device, config.bf16):
            losses, hits, _ = objective(inputs, labels)
        loss = losses.sum() * (ranks.world_size / max(scored, 1))  # ranks average gradients: the global mean's
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        opt.step()
        sched.step()
        totals = ranks.sum(torch.stack([losses.detach().sum(), hits.sum()]).double()).tolist()  # global loss sum, hits
        if device.type == "cuda":
            torch.cuda.synchronize()
        progress["seconds"] += time.perf_counter() - t0
        progress["tokens"] += config.batch_size * data.length
        progress["step"] = step
        acc = totals[1] / max(scored, 1)
        history.append({"step": step, "loss": totals[0] / max(scored, 1), "accuracy": acc})
        bar.set_postfix(loss=f"{history[-1]['loss']:.4g}", acc=f"{acc:.3f}", tok_s=f"{progress['tokens'] / progress['seconds']:,.0f}",
                        refresh=False)
        bar.update()
        window = history[-EARLY_STOP_WINDOW:]
        stop = config.early_stop is not None and len(window) == EARLY_STOP_WINDOW and \
            sum(h["accuracy"] for h in window) / EARLY_STOP_WINDOW >= config.early_stop
        if config.save_every and (step % config.save_every == 0 or step == config.steps or stop):
            states.append(save_train_state(config.out_dir, objective, opt, sched, progress, gen))
        if stop:
            break
    bar.close()
    if config.parallel == "cp":
        from polyattn.distributed import enable_context_parallel

        enable_context_parallel(model, False)  # evaluation (and the returned model) on whole sequences
    results = {
        "config": asdict(config),
        "mixer": config.mixer,
        "layer_mixers": [{"name": name, **options} for name, options in model.config.layer_specs()],
        "forms": layer_forms(model, config, device),
        "params": model.num_parameters(),
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "world_size": ranks.world_size,
        "torch": torch.__version__,
        "train": {
            "steps": progress["step"],
            "tokens": progress["tokens"],
            "seconds": progress["seconds"],
            "tokens_per_s": progress["tokens"] / max(progress["seconds"], 1e-9),
            "final_loss": history[-1]["loss"],
            "history": history,
        },
        "eval": evaluate(objective, test_data, config.eval_batch_size, device, config.bf16, quiet, ranks),
        "state_floats": {str(s.seq_len): model.state_size(s.seq_len) for s in config.test_segments},
        "max_train_len": config.max_train_len,
    }
    if config.out_dir:
        lm = model
        if config.parallel == "fsdp" and config.checkpoint:  # the whole model, gathered on rank 0 (a collective)
            state = full_model_state(model)
            lm = build_model(config) if ranks.main else None
            if ranks.main:
                lm.load_state_dict(state)
        if ranks.main:
            results["files"] = write_results(lm, results, config) + [str(path) for path in states]
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
