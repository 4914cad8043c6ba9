"""Compile, for sm_90a and without a GPU, every Triton kernel launch that a CPU test run makes.

The interpreter (`TRITON_INTERPRET=1`) runs kernels as Python and so never sees a compile error of the
GPU's Triton (a kernel that passes every CPU test can fail to compile on the GPU machine). This script
records each distinct launch (signature and constexprs) of a pytest selection under the interpreter, then
compiles each for Hopper with the Triton found on the path, the fp32 branch (`F32`, which the interpreter
takes) switched to the tensor-core one wherever the inputs are bf16/fp16, and reports each kernel whose
shared memory exceeds the H200's 227 KiB per block (a launch the GPU refuses with OutOfResources).

    python benchmarks/triton_compile_check.py record LAUNCHES tests/ops/kata/test_kata_triton.py ...
    PYTHONPATH=DIR_WITH_OTHER_TRITON python benchmarks/triton_compile_check.py compile LAUNCHES
"""
import collections
import importlib
import inspect
import os
import pickle
import sys
import warnings

SHARED_LIMIT = 232448  # bytes of shared memory one block may use on the H200 (sm_90)
POINTER_TYPES = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32", "float64": "*fp64",
                 "int32": "*i32", "int64": "*i64", "bool": "*i1", "uint8": "*u8"}


def record(path: str, pytest_args: list) -> int:
    os.environ["TRITON_INTERPRET"] = "1"
    import pytest
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    launches, run = {}, InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        params = inspect.signature(self.fn).parameters
        bound = dict(zip(params, args)) | {k: v for k, v in kwargs.items() if k in params}
        signature, constexprs = {}, {}
        for name, p in params.items():
            value = bound.get(name)
            if "constexpr" in str(p.annotation) or value is None:
                signature[name], constexprs[name] = "constexpr", value
            elif isinstance(value, torch.Tensor):
                signature[name] = POINTER_TYPES[str(value.dtype).removeprefix("torch.")]
            elif isinstance(value, bool):
                signature[name] = "i1"
            elif isinstance(value, int):
                signature[name] = "i64" if abs(value) >= 2**31 else "i32"
            elif isinstance(value, float):
                signature[name] = "fp32"
            else:
                signature[name], constexprs[name] = "constexpr", value
        key = (self.fn.__module__, self.fn.__name__, repr(sorted(constexprs.items())), repr(sorted(signature.items())))
        launches[key] = dict(module=self.fn.__module__, name=self.fn.__name__, signature=signature, constexprs=constexprs,
                             num_warps=kwargs.get("num_warps", 4), num_stages=kwargs.get("num_stages", 3))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    code = pytest.main([*pytest_args, "-q", "-p", "no:cacheprovider"])
    with open(path, "wb") as f:
        pickle.dump([x for x in launches.values() if x["module"].startswith("polyattn")], f)
    print(f"{len(launches)} distinct launches recorded; pytest exit {code}")
    return int(code)


def compile_all(path: str) -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    warnings.filterwarnings("ignore")
    with open(path, "rb") as f:
        launches = pickle.load(f)
    ok, failed, peak = collections.Counter(), collections.Counter(), collections.Counter()
    for x in launches:
        if "*fp64" in x["signature"].values():
            continue  # float64 runs only the PyTorch forms on a GPU
        constexprs = dict(x["constexprs"])
        if "F32" in constexprs and {"*bf16", "*fp16"} & set(x["signature"].values()):
            constexprs["F32"] = False  # the GPU's tensor-core branch
        fn = getattr(importlib.import_module(x["module"]), x["name"])
        src = ASTSource(fn=fn, signature=x["signature"], constexprs={(fn.arg_names.index(n),): v for n, v in constexprs.items()})
        try:
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=x["num_warps"], num_stages=x["num_stages"]))
            peak[x["name"]] = max(peak[x["name"]], kernel.metadata.shared)
            if kernel.metadata.shared > SHARED_LIMIT:
                raise RuntimeError(f"shared memory {kernel.metadata.shared} > {SHARED_LIMIT} bytes")
            ok[x["name"]] += 1
        except Exception as e:  # every compile error is reported, the rest still compile
            failed[x["name"]] += 1
            chain = []
            while e is not None:
                chain.append(str(e).strip().splitlines()[-1][:160])
                e = e.__cause__
            print(f"FAIL {x['name']} {constexprs}: {' <- '.join(chain)}")
    print(f"triton {triton.__version__}, sm_90a: compiled {dict(ok)}; failed {dict(failed)}; peak shared bytes {dict(peak)}")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("record", "compile"):
        sys.exit(__doc__)
    sys.exit(record(sys.argv[2], sys.argv[3:]) if sys.argv[1] == "record" else compile_all(sys.argv[2]))
