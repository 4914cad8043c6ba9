"""Arguments and entry points of ``polyattn train``, ``polyattn sweep`` and ``polyattn demo``."""

import functools
import json
import os
import sys
from dataclasses import replace

from polyattn.layers import MIXERS
from polyattn.tasks import TASKS
from polyattn.train.config import TrainConfig
from polyattn.train.distributed import PARALLEL


def reports_errors(fn):
    """Print invalid-configuration errors (ValueError, NotImplementedError) as one line; exit status 2."""

    @functools.wraps(fn)
    def run(args):
        try:
            return fn(args)
        except (ValueError, NotImplementedError) as err:
            print(f"polyattn: error: {err}", file=sys.stderr)
            return 2

    return run


def parse_segments(text, flag="--train"):
    """``"64:20000:4,128:20000:8"`` -> ``[(64, 20000, 4), (128, 20000, 8)]`` (seq_len:examples:pairs)."""
    try:
        segments = [tuple(int(x) for x in part.split(":")) for part in text.split(",") if part]
    except ValueError as err:
        raise ValueError(f"{flag}: expected segments like '64:20000:4,128:20000:8', got {text!r}") from err
    if not segments or any(len(s) != 3 for s in segments):
        raise ValueError(f"{flag}: expected seq_len:examples:pairs triples like '64:20000:4,128:20000:8', got {text!r}")
    return segments


def parse_list(text, kind, flag):
    """``"a,b,c"`` -> ``[kind(a), kind(b), kind(c)]``; at least one item."""
    try:
        items = [kind(x) for x in text.split(",") if x]
    except ValueError as err:
        raise ValueError(f"{flag}: expected a comma-separated list of {kind.__name__}, got {text!r}") from err
    if not items:
        raise ValueError(f"{flag}: expected at least one value, got {text!r}")
    return items


def parse_json_object(text, flag):
    try:
        value = json.loads(text)
    except ValueError as err:
        raise ValueError(f"{flag}: expected a JSON object like '{{\"num_heads\": 4}}', got {text!r} ({err})") from err
    if not isinstance(value, dict):
        raise ValueError(f"{flag}: expected a JSON object like '{{\"num_heads\": 4}}', got {text!r}")
    return value


def add_train_arguments(parser):
    d = TrainConfig()
    seg = lambda segs: ",".join(f"{s.seq_len}:{s.num_examples}:{s.num_pairs}" for s in segs)  # noqa: E731
    parser.add_argument("--task", default=d.task, help=f"one of {sorted(TASKS)}")
    parser.add_argument("--mixer", default=d.mixer, help=f"one of {list(MIXERS)}")
    parser.add_argument("--mixer-config", default="{}", help="JSON options for the mixer, e.g. '{\"num_heads\": 4}'")
    parser.add_argument("--task-options", default=json.dumps(d.task_options), help="JSON options for the task generator")
    parser.add_argument("--train", default=seg(d.train_segments), help="train segments seq_len:examples:pairs,...")
    parser.add_argument("--test", default=seg(d.test_segments), help="test segments seq_len:examples:pairs,...")
    parser.add_argument("--d-model", type=int, default=d.d_model)
    parser.add_argument("--n-layers", type=int, default=d.n_layers)
    parser.add_argument("--mlp-ratio", type=float, default=d.mlp_ratio, help="0 = no MLP (Zoology MQAR models)")
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--weight-decay", type=float, default=d.weight_decay)
    parser.add_argument("--warmup", type=float, default=d.warmup, help="fraction of steps")
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument("--batch-size", type=int, default=d.batch_size)
    parser.add_argument("--grad-clip", type=float, default=d.grad_clip)
    parser.add_argument("--early-stop", type=float, default=None, help="stop at this running train accuracy")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--device", default=d.device, help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    parser.add_argument("--impl", default=d.impl, help="op implementation for every mixer (auto: triton on CUDA)")
    parser.add_argument("--no-bf16", action="store_true", help="no bf16 autocast on CUDA")
    parser.add_argument("--no-checkpoint", action="store_true")
    parser.add_argument("--out", default=None, help="directory for results.json, PNGs and the checkpoint")
    parser.add_argument("--parallel", default=d.parallel, choices=PARALLEL,
                        help="none: one process; ddp or fsdp (FSDP2, fully_shard per block): one rank of a torchrun launch, "
                             "its rows of each batch; cp (context parallelism): one rank, its 1/N of every sequence")
    parser.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                        help="torch.compile every block (backend: inductor unless named)")


def add_single_run_arguments(parser):
    """`polyattn train` only: the training state of one run."""
    add_train_arguments(parser)
    parser.add_argument("--save-every", type=int, default=None, metavar="N",
                        help="write the sharded training state to OUT/train_state/step-N every N steps and at the end")
    parser.add_argument("--resume", default=None, metavar="DIR",
                        help="continue from a training state (a step-N folder, or an output folder: its latest)")


def config_from_args(args):
    return TrainConfig(
        task=args.task,
        task_options=parse_json_object(args.task_options, "--task-options"),
        train_segments=parse_segments(args.train, "--train"),
        test_segments=parse_segments(args.test, "--test"),
        mixer=args.mixer,
        mixer_config=parse_json_object(args.mixer_config, "--mixer-config"),
        d_model=args.d_model,
        n_layers=args.n_layers,
        mlp_ratio=args.mlp_ratio,
        lr=args.lr,
        weight_decay=args.weight_decay,
        warmup=args.warmup,
        steps=args.steps,
        batch_size=args.batch_size,
        grad_clip=args.grad_clip,
        early_stop=args.early_stop,
        seed=args.seed,
        device=args.device,
        impl=args.impl,
        bf16=not args.no_bf16,
        out_dir=args.out,
        checkpoint=not args.no_checkpoint,
        parallel=args.parallel,
        compile=args.compile,
        save_every=getattr(args, "save_every", None),
        resume=getattr(args, "resume", None),
    )


def check_mixers(names):
    unknown = [m for m in names if m not in MIXERS]
    if unknown:
        raise ValueError(f"unknown mixers {unknown}: expected some of {list(MIXERS)}")


@reports_errors
def run_train(args):
    from polyattn.train.loop import check_runnable, train
    from polyattn.train.sweep import format_table

    config = config_from_args(args)
    check_mixers([config.mixer])
    check_runnable(config)  # every argument, and the output folder created, before any work
    result, _ = train(config)
    if int(os.environ.get("RANK", 0)) == 0 or config.parallel == "none":  # under torchrun: rank 0 prints
        print(format_table([result]))
        for path in result.get("files", []):
            print(f"wrote {path}")
    return 0


def add_sweep_arguments(parser):
    add_train_arguments(parser)
    parser.add_argument("--mixers", default="softmax,gdn,kata-m2", help="comma-separated mixer names")
    parser.add_argument("--widths", default="64,128", help="comma-separated d_model values")
    parser.add_argument("--lrs", default="1e-3,3.2e-3,1e-2,3.2e-2", help="comma-separated learning rates")


@reports_errors
def run_sweep(args):
    from polyattn.train.loop import check_runnable, prepare_out_dir
    from polyattn.train.sweep import format_table, sweep

    mixers = parse_list(args.mixers, str, "--mixers")
    check_mixers(mixers)
    widths, lrs = parse_list(args.widths, int, "--widths"), parse_list(args.lrs, float, "--lrs")
    base = replace(config_from_args(args), checkpoint=False, out_dir=None)
    for mixer in mixers:  # every cell, before any work
        for width in widths:
            for lr in lrs:
                check_runnable(replace(base, mixer=mixer, d_model=width, lr=lr))
    if args.out:
        prepare_out_dir(args.out)
    summary, best = sweep(base, mixers, widths, lrs, args.out)
    print(format_table(best, extra_columns=[("best lr", lambda r: f"{r['config']['lr']:g}")]))
    return 0


def add_demo_arguments(parser):
    from polyattn.train.demo import DEFAULT_OUT

    parser.add_argument("--out", default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--mixers", default=None, help="comma-separated subset (default: every available mixer)")
    parser.add_argument("--steps", type=int, default=None, help="override the protocol's step count")
    parser.add_argument("--workers", type=int, default=2, help="parallel training processes (1 thread each)")


@reports_errors
def run_demo(args):
    from polyattn.train.demo import run_demo as demo
    from polyattn.train.loop import prepare_out_dir

    mixers = None if args.mixers is None else parse_list(args.mixers, str, "--mixers")
    if mixers:
        check_mixers(mixers)
    for flag, value in (("--steps", args.steps), ("--workers", args.workers)):
        if value is not None and value < 1:
            raise ValueError(f"{flag}: expected a positive integer, got {value}")
    prepare_out_dir(args.out)
    demo(args.out, mixers, args.steps, args.workers)
    return 0
