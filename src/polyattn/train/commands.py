"""Arguments and entry points of ``polyattn train``, ``polyattn sweep`` and ``polyattn demo``."""

import argparse
import functools
import json
import os
import shlex
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from polyattn.layers import MIXERS
from polyattn.tasks import TASKS
from polyattn.train.config import DEFAULT_MIXER, TrainConfig, layer_name
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


HYBRID_EXAMPLE = '["kata-m1", "softmax"]'


def parse_json(text, flag, example='{"num_heads": 4}'):
    """`text` as JSON of the kind of `example` (an object or a list); ValueError showing `example` otherwise."""
    kind = type(json.loads(example))
    what = "object" if kind is dict else "list"
    try:
        value = json.loads(text)
    except ValueError as err:
        raise ValueError(f"{flag}: expected a JSON {what} like '{example}', got {text!r} ({err})") from err
    if not isinstance(value, kind):
        raise ValueError(f"{flag}: expected a JSON {what} like '{example}', got {text!r}")
    return value


def add_train_arguments(parser, out_help="directory for results.json, PNGs and the checkpoint"):
    d = TrainConfig()
    seg = lambda segs: ",".join(f"{s.seq_len}:{s.num_examples}:{s.num_pairs}" for s in segs)  # noqa: E731
    parser.add_argument("--task", default=d.task, help=f"one of {sorted(TASKS)}")
    parser.add_argument("--mixer", default=None, help=f"one of {list(MIXERS)} (default {DEFAULT_MIXER})")
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
    parser.add_argument("--out", default=None, help=out_help)
    parser.add_argument("--parallel", default=d.parallel, choices=PARALLEL,
                        help="none: one process; ddp or fsdp (FSDP2, fully_shard per block): one rank of a torchrun launch, "
                             "its rows of each batch; cp (context parallelism): one rank, its 1/N of every sequence")
    parser.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                        help="torch.compile every block (backend: inductor unless named)")


def add_single_run_arguments(parser):
    """`polyattn train` only: a hybrid's layers and the training state of one run."""
    add_train_arguments(parser)
    parser.add_argument("--layer-mixers", default=None, metavar="JSON",
                        help="a hybrid: a JSON list of --n-layers mixers, each a name or {\"name\": ..., **options} with its own "
                             "options (no --mixer-config), e.g. '[\"kata-m1\", \"softmax\"]'; --mixer then names the hybrid "
                             "(default: the layers' names joined by +)")
    parser.add_argument("--save-every", type=int, default=None, metavar="N",
                        help="write the sharded training state to OUT/train_state/step-N every N steps and at the end")
    parser.add_argument("--resume", default=None, metavar="DIR",
                        help="continue from a training state (a step-N folder, or an output folder: its latest)")


def config_from_args(args):
    return TrainConfig(
        task=args.task,
        task_options=parse_json(args.task_options, "--task-options"),
        train_segments=parse_segments(args.train, "--train"),
        test_segments=parse_segments(args.test, "--test"),
        mixer=args.mixer,
        mixer_config=parse_json(args.mixer_config, "--mixer-config"),
        layer_mixers=None if getattr(args, "layer_mixers", None) is None else parse_json(args.layer_mixers, "--layer-mixers", HYBRID_EXAMPLE),
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


def check_mixers(names, hybrids=()):
    """ValueError naming the names that are neither registered mixers nor in `hybrids`."""
    unknown = [m for m in names if m not in MIXERS and m not in hybrids]
    if unknown:
        raise ValueError(f"unknown mixers {unknown}: expected some of {list(MIXERS) + list(hybrids)}")


@reports_errors
def run_train(args):
    from polyattn.train.loop import check_runnable, train
    from polyattn.train.sweep import format_table

    config = config_from_args(args)
    if config.layer_mixers is None:  # a hybrid's layers are checked by TrainConfig
        check_mixers([config.mixer])
    check_runnable(config)  # every argument, and the output folder created, before any work
    result, _ = train(config)
    if int(os.environ.get("RANK", 0)) == 0 or config.parallel == "none":  # under torchrun: rank 0 prints
        print(format_table([result]))
        for path in result.get("files", []):
            print(f"wrote {path}")
    return 0


def add_sweep_arguments(parser):
    add_train_arguments(parser, out_help="directory for sweep.json, the plots (claims with --config) and cells/: each cell's "
                                         "result, written as it ends; rerun with the same --out to continue a stopped sweep "
                                         "(a cell whose file holds a run of the same config is read, not trained)")
    parser.add_argument("--mixers", default="softmax,gdn,kata-m2", help="comma-separated mixer names (or names of --hybrids)")
    parser.add_argument("--hybrids", default="{}", metavar="JSON",
                        help="named per-layer models for --mixers, e.g. '{\"kata-m1+softmax\": [\"kata-m1\", \"softmax\"]}'; "
                             "each layer takes its mixer's options (--mixer-config, --mixer-configs), updated by its entry's "
                             "own ({\"name\": ..., **options})")
    parser.add_argument("--mixer-configs", default="{}",
                        help="JSON options per mixer over --mixer-config, e.g. '{\"gdn\": {\"output_gate\": false}}'")
    parser.add_argument("--widths", default="64,128", help="comma-separated d_model values")
    parser.add_argument("--lrs", default="1e-3,3.2e-3,1e-2,3.2e-2", help="comma-separated learning rates")
    parser.add_argument("--score", default="accuracy", metavar="METRIC",
                        help="what picks each cell's best lr: accuracy (the highest mean over the test slices) or loss (the lowest)")
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="an evidence config (JSON, benchmarks/evidence/): its sweep arguments, which flags given here "
                             "override, and its claims, checked into OUT/claims.json and claims.md (needs --out)")
    parser.add_argument("--toy", action="store_true", help="with --config: its toy sizes (a few steps; what CPU CI runs)")
    parser.add_argument("--workers", type=int, default=1, metavar="N",
                        help="train N cells at a time, each in its own process of one CPU thread; on CUDA they "
                             "share the GPU (small models leave it mostly idle)")


# An evidence config: {"description", "sweep": {argument: value}, "toy": {argument: value}, "claims": [...]}.
# Arguments are the sweep's flags without dashes (train, test, mixers, hybrids, mixer_configs, widths, lrs, steps, ...);
# segments and lists may be JSON lists, options JSON objects. The output folder, --workers (how this machine runs the
# cells, not what they are) and --config/--toy stay on the command line.
CONFIG_KEYS = {"description", "sweep", "toy", "claims"}
COMMAND_LINE_ONLY = {"config", "toy", "out", "workers"}


def read_json(path, flag):
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ValueError(f"{flag}: cannot read {str(path)!r} ({err.strerror or err})") from err
    try:
        return json.loads(text)
    except ValueError as err:
        raise ValueError(f"{flag}: {str(path)!r} is not valid JSON ({err})") from err


def flag_text(where, value, default):
    """A config value in the form its flag parses: lists joined (segments ``[64, 20000, 4]`` as ``64:20000:4``),
    objects as JSON, for the flags that parse text; other values as they are (checked by `TrainConfig`)."""
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected true or false, got {value!r}")
        return value
    if not isinstance(default, str) or isinstance(value, str):
        return value
    if isinstance(value, dict):
        return json.dumps(value)
    if isinstance(value, list):
        return ",".join(":".join(map(str, v)) if isinstance(v, list) else str(v) for v in value)
    raise ValueError(f"{where}: expected a string, a list or an object, got {value!r}")


def apply_config(args):
    """``polyattn sweep --config FILE [--toy]``: the arguments are the defaults, then the config's ``sweep``
    block, then (``--toy``) its ``toy`` block, then the flags given on the command line. Returns the merged
    arguments and the config."""
    where = f"--config {args.config}"
    spec = read_json(args.config, "--config")
    if not isinstance(spec, dict) or not isinstance(spec.get("sweep"), dict) or not set(spec) <= CONFIG_KEYS:
        got = sorted(spec) if isinstance(spec, dict) else type(spec).__name__
        raise ValueError(f"{where}: expected an object with a 'sweep' object and some of {sorted(CONFIG_KEYS - {'sweep'})}, got {got}")
    if args.toy and not isinstance(spec.get("toy"), dict):
        raise ValueError(f"{where}: --toy needs a 'toy' object of sweep arguments in the config")
    parser = argparse.ArgumentParser(prog="polyattn sweep")
    add_sweep_arguments(parser)
    defaults = vars(parser.parse_args([]))
    allowed = sorted(set(defaults) - COMMAND_LINE_ONLY)
    values = {}
    for block in ("sweep", "toy") if args.toy else ("sweep",):
        for key, value in spec[block].items():
            if key not in allowed:
                raise ValueError(f"{where}: {block}.{key}: unknown sweep argument, expected some of {allowed}")
            values[key] = flag_text(f"{where}: {block}.{key}", value, defaults[key])
    if "claims" in spec and not args.out:
        raise ValueError(f"{where}: expected --out (the folder for sweep.json, the plots, claims.json and claims.md)")
    # argparse sets a default only where the namespace has no value yet: the config's values stay unless a flag is given
    return parser.parse_args(args.argv[1:], namespace=argparse.Namespace(**values)), spec


def parse_mixer_configs(text, mixers, hybrids):
    """``--mixer-configs``: options per registered mixer of the sweep, a hybrid's layers included (not per hybrid)."""
    configs = parse_json(text, "--mixer-configs")
    names = list(dict.fromkeys(layer_name(e) for m in mixers for e in (hybrids[m] if m in hybrids else [m])))
    for name, options in configs.items():
        if name not in names:
            raise ValueError(f"--mixer-configs: {name!r} is not one of the sweep's mixers {names}")
        if not isinstance(options, dict):
            raise ValueError(f"--mixer-configs: expected a JSON object of options for {name!r}, got {options!r}")
    return configs


@dataclass
class SweepPlan:
    """What `polyattn sweep` runs, every part checked: the cells' shared config and axes, the evidence config
    (``spec``, None without ``--config``), the command line that reproduces the run and the worker processes."""

    base: TrainConfig
    mixers: list
    widths: list
    lrs: list
    mixer_configs: dict
    hybrids: dict
    out: str | None
    spec: dict | None
    command: str
    workers: int
    score: str


def plan_sweep(args):
    """The `SweepPlan` of parsed ``polyattn sweep`` arguments, everything checked before any work: every
    cell runnable, and the claims of ``--config`` reading mixers, widths and test slices of this sweep."""
    from polyattn.train.claims import check_claims
    from polyattn.train.loop import check_runnable
    from polyattn.train.sweep import check_hybrids, check_score, sweep_cells

    command = "polyattn " + shlex.join(args.argv)
    spec = None
    if args.config:
        args, spec = apply_config(args)
    elif args.toy:
        raise ValueError("--toy: expected --config FILE (the toy sizes of an evidence config)")
    if args.workers < 1:
        raise ValueError(f"--workers: expected a positive integer, got {args.workers}")
    check_score(args.score)
    mixers = parse_list(args.mixers, str, "--mixers")
    hybrids = parse_json(args.hybrids, "--hybrids", f'{{"kata-m1+softmax": {HYBRID_EXAMPLE}}}')
    base = replace(config_from_args(args), checkpoint=False, out_dir=None)
    check_hybrids(hybrids, base.n_layers)
    check_mixers(mixers, hybrids)
    widths, lrs = parse_list(args.widths, int, "--widths"), parse_list(args.lrs, float, "--lrs")
    mixer_configs = parse_mixer_configs(args.mixer_configs, mixers, hybrids)
    for config in sweep_cells(base, mixers, widths, lrs, mixer_configs, hybrids):  # every cell, before any work
        check_runnable(config)
    if spec and "claims" in spec:
        check_claims(spec["claims"], mixers, widths, [(s.seq_len, s.num_pairs) for s in base.test_segments])
    return SweepPlan(base, mixers, widths, lrs, mixer_configs, hybrids, args.out, spec, command, args.workers, args.score)


@reports_errors
def run_sweep(args):
    from polyattn.train.claims import claim_rows, claims_markdown, format_value
    from polyattn.train.loop import prepare_out_dir
    from polyattn.train.sweep import CellsFailed, format_table, sweep

    plan = plan_sweep(args)
    if plan.out:
        prepare_out_dir(plan.out)
    try:
        summary, best = sweep(plan.base, plan.mixers, plan.widths, plan.lrs, plan.out, mixer_configs=plan.mixer_configs,
                              workers=plan.workers, hybrids=plan.hybrids, metric=plan.score)
    except CellsFailed as err:
        print(f"polyattn: error: {err}", file=sys.stderr)
        return 1
    columns = [("best lr", lambda r: f"{r['config']['lr']:g}")]
    if plan.score == "loss":
        columns += [(f"loss@{e['length']}", lambda r, i=i: f"{r['eval'][i]['loss']:.3f}") for i, e in enumerate(best[0]["eval"])]
    table = format_table(best, extra_columns=columns)
    print(table)
    if plan.spec and "claims" in plan.spec:
        rows = claim_rows(plan.spec["claims"], best, plan.command)
        out = Path(plan.out)
        (out / "claims.json").write_text(json.dumps(rows, indent=2) + "\n")
        (out / "claims.md").write_text(claims_markdown(rows, plan.spec.get("description", plan.command), table))
        verdict = {True: "holds", False: "does not hold", None: "reported"}
        for row in rows:
            print(f"{verdict[row['holds']]}: {row['claim']} (ours {format_value(row['ours'])}; "
                  f"source {format_value(row['source_value'])})")
        print(f"wrote {out / 'claims.json'} and {out / 'claims.md'}")
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
