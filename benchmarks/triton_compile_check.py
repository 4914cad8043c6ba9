"""Compile, for sm_90a and without a GPU, every Triton kernel launch that a CPU test run makes.

The interpreter (`TRITON_INTERPRET=1`) runs kernels as Python and so never sees a compile error of the
GPU's Triton (a kernel that passes every CPU test can fail to compile on the GPU machine). This script
records each distinct launch (signature and constexprs) of a pytest selection under the interpreter, then
compiles each whole for Hopper with the Triton found on the path, the fp32 branch (`F32`, which the interpreter
takes) switched to the tensor-core one wherever the inputs are bf16/fp16 (`polyattn.ops.triton.launches`), and
reports each kernel whose shared memory exceeds the H200's 227 KiB per block (a launch the GPU refuses with
OutOfResources). The CPU tests make the quicker check, through the GPU passes only, on every kernel
(tests/ops/triton/test_hopper_compile.py).

    python benchmarks/triton_compile_check.py record LAUNCHES tests/ops/kata/test_kata_triton.py ...
    PYTHONPATH=DIR_WITH_OTHER_TRITON python benchmarks/triton_compile_check.py compile LAUNCHES
"""
import collections
import json
import os
import sys
import warnings

from polyattn.ops.triton.launches import hopper_source, recording

SHARED_LIMIT = 232448  # bytes of shared memory one block may use on the H200 (sm_90)


def record(path: str, pytest_args: list) -> int:
    os.environ["TRITON_INTERPRET"] = "1"
    import pytest

    with recording() as launches:
        code = pytest.main([*pytest_args, "-q", "-p", "no:cacheprovider"])
    with open(path, "w") as f:
        json.dump(launches, f)
    print(f"{len(launches)} distinct launches recorded; pytest exit {code}")
    return int(code)


def compile_all(path: str) -> int:
    import triton
    from triton.backends.compiler import GPUTarget

    warnings.filterwarnings("ignore")
    with open(path) as f:
        launches = json.load(f)
    ok, failed, peak = collections.Counter(), collections.Counter(), collections.Counter()
    for x in launches:
        if "*fp64" in x["signature"].values():
            continue  # float64 runs only the PyTorch forms on a GPU
        src, options = hopper_source(x)
        try:
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
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
            print(f"FAIL {x['name']} {x['constexprs']}: {' <- '.join(chain)}")
    print(f"triton {triton.__version__}, sm_90a: compiled {dict(ok)}; failed {dict(failed)}; peak shared bytes {dict(peak)}")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("record", "compile"):
        sys.exit(__doc__)
    sys.exit(record(sys.argv[2], sys.argv[3:]) if sys.argv[1] == "record" else compile_all(sys.argv[2]))
