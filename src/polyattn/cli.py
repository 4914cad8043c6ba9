"""The ``polyattn`` command line (also ``python -m polyattn``).

Subcommands are registered in :data:`COMMANDS`: name -> (help, add_arguments, run).
"""

from __future__ import annotations

import argparse
import importlib
import platform
import sys

import torch

import polyattn


def _add_info_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # info takes no options


def _mechanism_forms() -> dict[str, list[str]]:
    """Each public op's implementations, read from the registries of the ops packages."""
    registries = {
        "linear_attn": ("polyattn.ops.linear", "LINEAR_ATTN_FORMS"),
        "delta_rule": ("polyattn.ops.delta", "DELTA_RULE_FORMS"),
        "hla": ("polyattn.ops.hla", "HLA_FORMS"),
        "loglinear_attn": ("polyattn.ops.loglinear", "LOGLINEAR_ATTN_FORMS"),
        "kata": ("polyattn.ops.kata", "KATA_FORMS"),
        "kata (DeltaKATA, beta=)": ("polyattn.ops.kata", "DELTAKATA_FORMS"),
    }
    found = {}
    for op, (module, attr) in registries.items():
        try:
            forms = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            continue
        found[op] = sorted(forms)
    return found


def _cmd_info(args: argparse.Namespace) -> int:
    del args
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CPU only)"
    print(f"polyattn {polyattn.__version__}")
    print(f"python   {platform.python_version()}")
    print(f"torch    {torch.__version__}")
    print(f"triton   {triton_version}")
    print(f"device   {cuda}")
    print("ops and their impls (plus 'auto'):")
    for op, forms in _mechanism_forms().items():
        print(f"  {op:<24} {', '.join(forms)}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from polyattn.train.commands import run_train

    return run_train(args)


def _cmd_sweep(args: argparse.Namespace) -> int:
    from polyattn.train.commands import run_sweep

    return run_sweep(args)


def _cmd_demo(args: argparse.Namespace) -> int:
    from polyattn.train.commands import run_demo

    return run_demo(args)


def _add_train_arguments(parser: argparse.ArgumentParser) -> None:
    from polyattn.train.commands import add_single_run_arguments

    add_single_run_arguments(parser)


def _add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    from polyattn.train.commands import add_sweep_arguments

    add_sweep_arguments(parser)


def _add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    from polyattn.train.commands import add_demo_arguments

    add_demo_arguments(parser)


def _add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    from polyattn.bench.__main__ import add_arguments

    add_arguments(parser)


def _cmd_bench(args: argparse.Namespace) -> int:
    from polyattn.bench.__main__ import run

    return run(args)


COMMANDS = {
    "info": ("versions, device, and which mechanisms and impls exist", _add_info_arguments, _cmd_info),
    "train": ("train one mixer on a synthetic recall task or real text (JSON, PNGs, checkpoint)", _add_train_arguments, _cmd_train),
    "sweep": ("mixers × widths × learning rates; best LR per cell", _add_sweep_arguments, _cmd_sweep),
    "demo": ("every mixer on a small MQAR on the CPU in minutes: table, JSON, PNG", _add_demo_arguments, _cmd_demo),
    "bench": ("GPU benchmarks: kernels (fwd, fwd+bwd) and decode against SDPA and fla (JSON, markdown, PNG)",
              _add_bench_arguments, _cmd_bench),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="polyattn", description=polyattn.__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add_arguments, _) in COMMANDS.items():
        add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = argv  # as typed: `sweep --config` reads which flags override the config, and records the command
    return COMMANDS[args.command][2](args)
