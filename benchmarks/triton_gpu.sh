#!/usr/bin/env bash
# Triton kernels on one GPU: tests at real shapes, then the kernel benchmark, logs under $1.
# usage: benchmarks/triton_gpu.sh OUTDIR [extra args for `python -m polyattn.bench kernels`]
# fla wheels in .whl/ (if any) are installed to /tmp/site first. Kernel compilation (CPU-bound)
# runs in parallel with the tests before anything is timed. TESTS (pytest paths), TEST_TIMEOUT
# and BENCH_TIMEOUT (s) set the two steps (one device command may last 600 s).
set -uo pipefail
out=${1:?usage: triton_gpu.sh OUTDIR [bench args...]}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$out/compile.log" 2>&1
python3 -m polyattn.bench kernels --out "$out/compile" --dims 128 --compile-only >> "$out/compile.log" 2>&1 &
c1=$!
tests=${TESTS:-tests/ops/delta/test_delta_triton.py tests/ops/linear/test_triton.py tests/ops/hla/test_hla_triton.py}
timeout -s INT "${TEST_TIMEOUT:-300}" python3 -m pytest -n 8 -q -p no:cacheprovider $tests -rA --durations=15 > "$out/test_triton_gpu.log" 2>&1
tail -n 4 "$out/test_triton_gpu.log"
grep -E "^(FAILED|ERROR)" "$out/test_triton_gpu.log" | head -30
wait $c1
tail -n 3 "$out/compile.log"
timeout "${BENCH_TIMEOUT:-400}" python3 -m polyattn.bench kernels --out "$out" "$@" > "$out/kernels.log" 2>&1
cat "$out/kernels.log" | tail -n 60
