"""Kernel launches as the GPU compiler sees them: recorded under the interpreter, built for Hopper without a GPU.

The interpreter (`TRITON_INTERPRET=1`) runs a kernel's Python on NumPy and never meets the GPU compiler's
checks (a tensor-core product needs every dimension at least 16, a block's shared memory has a limit), so a
kernel can pass every CPU test and fail on the GPU. `recording()` notes each distinct launch made inside it
(kernel, argument types, constexprs, warps and stages); `hopper_source` turns one into the compiler's input
for sm_90, with the tensor-core branch (`F32 = False`) wherever the inputs are bf16/fp16, which the
interpreter never takes; `lower_all` runs Triton's front end and GPU passes on each (`ttir`, `ttgir`: the
quick check the CPU tests make, in a process without the interpreter), and `benchmarks/triton_compile_check.py`
compiles them whole and checks their shared memory.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import sys

import torch

LAUNCH_OPTIONS = ("num_warps", "num_stages")
POINTER_TYPES = {
    torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float64: "*fp64",
    torch.int32: "*i32", torch.int64: "*i64", torch.int16: "*i16", torch.int8: "*i8", torch.uint8: "*u8", torch.bool: "*i1",
}


def describe(fn, args: tuple, kwargs: dict) -> dict:
    """One launch of the Python kernel `fn`: `{module, name, signature, constexprs, num_warps, num_stages}`,
    tensors as typed pointers, None and the `tl.constexpr` parameters as constexprs."""
    params = inspect.signature(fn).parameters
    bound = inspect.signature(fn).bind(*args, **{n: v for n, v in kwargs.items() if n in params})
    signature, constexprs = {}, {}
    for name, param in params.items():
        value = bound.arguments.get(name, param.default)
        if "constexpr" in str(param.annotation) or value is None:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = POINTER_TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {name} of type {type(value).__name__}")
    return dict(module=fn.__module__, name=fn.__name__, signature=signature, constexprs=constexprs,
                num_warps=kwargs.get("num_warps", 4), num_stages=kwargs.get("num_stages", 3))


@contextlib.contextmanager
def recording(execute: bool = True):
    """Inside it, every launch of one of the package's kernels under the interpreter is also noted: yields the
    list of distinct launches (`describe`), filled as they come. With `execute=False` they are noted and not run:
    their outputs keep whatever memory they were given."""
    from triton.runtime.interpreter import InterpretedFunction

    seen, launches, run = set(), [], InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        if self.fn.__module__.startswith("polyattn."):
            launch = describe(self.fn, args, kwargs)
            key = json.dumps(launch, sort_keys=True, default=repr)
            if key not in seen:
                seen.add(key)
                launches.append(launch)
            if not execute:
                return None
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    try:
        yield launches
    finally:
        InterpretedFunction.run = run


def hopper_source(launch: dict):
    """`(ASTSource, options)` of one launch for sm_90: the F32 branch switched to the tensor cores where the
    inputs are bf16/fp16 (the branch the GPU takes and the interpreter does not)."""
    from triton.compiler import ASTSource

    constexprs = dict(launch["constexprs"])
    if "F32" in constexprs and {"*bf16", "*fp16"} & set(launch["signature"].values()):
        constexprs["F32"] = False
    fn = getattr(importlib.import_module(launch["module"]), launch["name"])
    positions = {(fn.arg_names.index(n),): v for n, v in constexprs.items()}
    src = ASTSource(fn=fn, signature=launch["signature"], constexprs=positions)
    return src, dict(num_warps=launch["num_warps"], num_stages=launch["num_stages"])


def lower(launch: dict) -> None:
    """Triton's front end and GPU passes (`ttir`, `ttgir`) on one launch, for sm_90; raises what they raise."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    src, options = hopper_source(launch)
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    options = backend.parse_options(options)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)
    stages, metadata = {}, {}
    backend.add_stages(stages, options, src.language)
    stages["ttgir"](stages["ttir"](module, metadata), metadata)


def lower_all(launches: list) -> int:
    """`lower` on every launch, each failure printed; 1 if any failed. Run without the interpreter."""
    failed = 0
    for launch in launches:
        try:
            lower(launch)
        except Exception as exc:  # noqa: BLE001 -- every failing launch is reported, then the run fails
            failed += 1
            print(f"FAILED {launch['module']}.{launch['name']} {launch['constexprs']} warps {launch['num_warps']}:\n"
                  f"{type(exc).__name__}: {str(exc)[-1500:]}\n")
    print(f"{len(launches) - failed} of {len(launches)} launches lowered for sm_90")
    return 1 if failed else 0


if __name__ == "__main__":  # python -m polyattn.ops.triton.launches LAUNCHES.json
    with open(sys.argv[1]) as f:
        sys.exit(lower_all(json.load(f)))
