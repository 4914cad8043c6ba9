"""Timing and reporting helpers shared by the kernel and decode benchmarks."""
from __future__ import annotations

import json
from pathlib import Path

import torch


def bench_ms(fn, *, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median milliseconds of `fn()` by CUDA events (`triton.testing.do_bench`)."""
    import triton

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def kernel_times(step, *, warmup: int = 3, reps: int = 5, by_launch: bool = False) -> dict[str, float]:
    """Mean CUDA milliseconds per call of `step()` of every kernel it launches (torch.profiler), after
    `warmup` untimed calls (compilation, autotuning); with `by_launch`, of every launch, keyed by its
    place in the call (`launch_means`), so that passes of one kernel are told apart."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    if by_launch:
        device = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        device.sort(key=lambda e: e.time_range.start)
        return launch_means([(e.name, e.time_range.elapsed_us()) for e in device], reps)
    return {e.key: e.device_time_total / reps / 1e3 for e in prof.key_averages() if e.device_time_total > 0}


def launch_means(launches: list[tuple[str, float]], reps: int) -> dict[str, float]:
    """`[(kernel name, µs)]` of `reps` identical calls in launch order -> `{"NN name": mean ms}`, NN the
    launch's index within one call. ValueError when the calls did not launch the same kernels."""
    n, extra = divmod(len(launches), reps)
    if extra:
        raise ValueError(f"{len(launches)} launches in {reps} calls: the calls launched different kernels")
    out = {}
    for i in range(n):
        names = {launches[r * n + i][0] for r in range(reps)}
        if len(names) != 1:
            raise ValueError(f"launch {i} differs between calls: {sorted(names)}")
        out[f"{i:02d} {launches[i][0]}"] = sum(launches[r * n + i][1] for r in range(reps)) / reps / 1e3
    return out


def print_kernel_times(title: str, rows: dict[str, float], top: int = 8) -> None:
    """The total and the `top` slowest kernels of `kernel_times`."""
    print(f"{title}: total {sum(rows.values()):.3f} ms per call")
    for name, ms in sorted(rows.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {ms:8.3f} ms  {name[:90]}")


def error_entry(exc: Exception) -> str:
    """A table entry for a call that raised: type and first line of the message."""
    first = str(exc).splitlines()[0][:120] if str(exc) else ""
    return f"error: {type(exc).__name__}: {first}"


def try_bench(fn, **kwargs) -> float | str:
    """`bench_ms`, or an error entry when the call raises (an anchor that refuses)."""
    try:
        return bench_ms(fn, **kwargs)
    except Exception as exc:  # noqa: BLE001 -- any failure of a third-party anchor is a table entry
        return error_entry(exc)


def write_rows(rows: list[dict], out: Path, name: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(rows, indent=1))
    return path


def device_line() -> str:
    import triton

    return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}"


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op off CUDA), so host timers measure it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def parse_sized_args(parser, argv, sizes: dict[str, dict[str, int]]):
    """Add ``--device`` and one integer option per entry of ``sizes["cuda"]`` (default: that value on
    CUDA, ``sizes["cpu"]``'s elsewhere), parse ``argv``; returns ``(args, device)``."""
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    for name, value in sizes["cuda"].items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                            help=f"default {value} on CUDA, {sizes['cpu'][name]} on CPU")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    for name, value in sizes["cuda" if device.type == "cuda" else "cpu"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args, device


def environment(device: torch.device) -> dict:
    """The device, platform and torch version for a results file."""
    import platform

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return dict(device=name, platform=platform.platform(), torch=torch.__version__)


def write_json(obj, path) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
