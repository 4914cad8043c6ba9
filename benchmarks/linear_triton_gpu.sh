#!/usr/bin/env bash
# Triton linear_attn on one GPU: tests at real shapes, then the kernel benchmark, logs under $1.
# usage: benchmarks/linear_triton_gpu.sh OUTDIR [extra args for `python -m polyattn.bench kernels`]
# Kernel compilation (CPU-bound) runs in parallel with the tests before anything is timed.
# TEST_TIMEOUT / BENCH_TIMEOUT (s) bound the two steps (one device command may last 600 s).
set -uo pipefail
out=${1:?usage: linear_triton_gpu.sh OUTDIR [bench args...]}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$out/compile.log" 2>&1
python3 -m polyattn.bench kernels --out "$out" --dims 128 --compile-only >> "$out/compile.log" 2>&1 &
c1=$!
python3 -m polyattn.bench kernels --out "$out" --dims 64 --compile-only >> "$out/compile.log" 2>&1 &
c2=$!
timeout -s INT "${TEST_TIMEOUT:-400}" python3 -m pytest -n 8 -q -p no:cacheprovider tests/ops/linear/test_triton.py tests/ops/hla/test_hla_triton.py -rA --durations=15 > "$out/test_triton_gpu.log" 2>&1
tail -n 4 "$out/test_triton_gpu.log"
wait $c1 $c2
tail -n 3 "$out/compile.log"
timeout "${BENCH_TIMEOUT:-540}" python3 -m polyattn.bench kernels --out "$out" "$@" > "$out/kernels.log" 2>&1
tail -n 4 "$out/kernels.log"
