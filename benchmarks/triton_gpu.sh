#!/usr/bin/env bash
# Triton kernels on one GPU in one call: tests at real shapes, the kernel benchmark, the decode
# benchmark and the delta-rule profile; logs and results under $1.
# usage: benchmarks/triton_gpu.sh OUTDIR [extra args for `python -m polyattn.bench kernels`]
# fla wheels in .whl/ (if any) are installed to /tmp/site first. Kernel compilation (CPU-bound)
# runs in parallel with the tests before anything is timed (COMPILE_ARGS: its bench arguments, default
# the benchmark's own, so only what will be timed is compiled: every op's kernels did not compile in 540 s
# beside the tests on an H100). TESTS (pytest paths), TEST_WORKERS (default: one per 20 GiB of GPU memory, at most
# six: six workers ran an H100's 80 GiB out of memory), TEST_TIMEOUT,
# BENCH_TIMEOUT, DECODE_TIMEOUT, TUNE_TIMEOUT (default 0: off; TUNE_OPS, TUNE_ARGS for tune_kernels.py), PROFILE_TIMEOUT and
# PRECISION_TIMEOUT (s; 0 skips the step) bound the steps. PROFILE_OPS (bench op names) adds the
# per-kernel profile of those rows at PROFILE_T (default 8192) tokens per sequence, with PROFILE_ARGS
# passed on (e.g. `--by-launch`: one row per launch).
set -uo pipefail
out=${1:?usage: triton_gpu.sh OUTDIR [bench args...]}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > /tmp/compile.log 2>&1
gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)  # MiB
workers=$(( ${gib:-122880} / 20480 )); workers=$(( workers > 6 ? 6 : workers < 1 ? 1 : workers ))
if [ -n "${COMPILE_ARGS:-}" ]; then read -ra compile <<< "$COMPILE_ARGS"; else compile=("$@"); fi
python3 -m polyattn.bench kernels --out /tmp/compile "${compile[@]}" --compile-only >> /tmp/compile.log 2>&1 &
c1=$!
tests=${TESTS:-tests/ops/delta/test_delta_triton.py tests/ops/triton tests/ops/linear/test_triton.py tests/ops/hla/test_hla_triton.py tests/ops/kata/test_kata_triton.py tests/ops/loglinear/test_loglinear_triton.py}
timeout -s INT "${TEST_TIMEOUT:-300}" python3 -m pytest -n "${TEST_WORKERS:-$workers}" -q -p no:cacheprovider $tests -rA --durations=15 > "$out/test_triton_gpu.log" 2>&1
grep -E "passed|failed" "$out/test_triton_gpu.log" | tail -n 2
grep -E "^(FAILED|ERROR)" "$out/test_triton_gpu.log" | head -30
wait $c1
tail -n 3 /tmp/compile.log
if [ "${BENCH_TIMEOUT:-400}" != 0 ]; then
  timeout "${BENCH_TIMEOUT:-400}" python3 -m polyattn.bench kernels --out "$out" "$@" > "$out/kernels.log" 2>&1
  grep -E "${BENCH_GREP:-delta_rule|decay}" "$out/kernels.log" | tail -n 40
fi
if [ "${DECODE_TIMEOUT:-120}" != 0 ]; then
  timeout "${DECODE_TIMEOUT:-120}" python3 -m polyattn.bench decode --out "$out" --seqlens 4096 32768 > /tmp/decode.log 2>&1
  tail -n 16 /tmp/decode.log
fi
if [ "${TUNE_TIMEOUT:-0}" != 0 ]; then
  timeout "${TUNE_TIMEOUT}" python3 benchmarks/tune_kernels.py --ops ${TUNE_OPS:-linear_attn linear_attn_decay} --seqlens 8192 ${TUNE_ARGS:-} --out "$out/tune.json" > "$out/tune.log" 2>&1
  tail -n 30 "$out/tune.log"
fi
if [ "${PROFILE_TIMEOUT:-60}" != 0 ]; then
  timeout "${PROFILE_TIMEOUT:-60}" python3 benchmarks/profile_delta.py --T 8192 --warps 4 --block-v 32 --fp32-dot ${PROFILE_DOTS:-split} --out "$out/profile.json" 2>&1 | grep -v -i warn | tail -n 20
  [ "${PRECISION_TIMEOUT:-60}" != 0 ] && timeout "${PRECISION_TIMEOUT:-60}" python3 benchmarks/delta_precision.py --out "$out/precision.json" 2>&1 | tail -n 4
fi
if [ -n "${PROFILE_OPS:-}" ]; then
  timeout "${PROFILE_TIMEOUT:-60}" python3 benchmarks/profile_kernels.py --ops $PROFILE_OPS --T ${PROFILE_T:-8192} ${PROFILE_ARGS:-} --out "$out/profile_kernels.json" 2>&1 | grep -v -i warn | tail -n 40
fi
