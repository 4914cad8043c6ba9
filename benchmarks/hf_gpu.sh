#!/usr/bin/env bash
# torch.compile and generate() on one GPU in one call (at most 10 minutes: the step limits add up to 570 s); results under $1:
#   custom_ops.log       the custom-op tests on the GPU (torch.library ops under torch.compile, opcheck)
#                        and the toy-size tests of the two scripts' checks
#   train_step.json/.log benchmarks/train_step.py: a training step per mixer, eager beside
#                        torch.compile(fullgraph=True) (the Triton forms as polyattn:: custom ops in the graph)
#   hf_generate.json/.log benchmarks/hf_generate.py: generate() tokens/s per mixer, fused steps beside
#                        the PyTorch token loop, fused-step calls counted
# usage: benchmarks/hf_gpu.sh OUTDIR
# Wheels in .whl/ (e.g. the transformers version pyproject.toml pins) are installed to /tmp/site first.
# TEST_TIMEOUT, GENERATE_TIMEOUT, TRAIN_TIMEOUT (s; 0 skips the step) bound the steps; MIXERS
# (comma-separated) narrows train_step.py; both scripts rewrite their JSON after every mixer, so a
# step stopped by its timeout keeps what it finished. Exit status: 1 when any step failed.
set -uo pipefail
out=${1:?usage: hf_gpu.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
python3 -c "import torch, triton, transformers; print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU', 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
status=0
step() {  # step NAME TIMEOUT COMMAND...: run with a time limit, log to $out/NAME.log, say how it ended
  local name=$1 limit=$2
  shift 2
  [ "$limit" = 0 ] && return
  local start=$SECONDS
  timeout -k 10 "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  [ $rc = 0 ] || status=1
  echo "== $name: exit $rc after $((SECONDS - start)) s (limit $limit s)"
}
step custom_ops "${TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider tests/ops/triton/test_custom_ops.py \
  tests/benchmarks/test_gpu_benchmarks.py -rA
[ -f "$out/custom_ops.log" ] && tail -n 1 "$out/custom_ops.log"
step hf_generate "${GENERATE_TIMEOUT:-130}" python3 benchmarks/hf_generate.py --out "$out/hf_generate.json"
[ -f "$out/hf_generate.log" ] && grep -E "tok/s|FAIL" "$out/hf_generate.log"
step train_step "${TRAIN_TIMEOUT:-290}" python3 benchmarks/train_step.py --out "$out/train_step.json" ${MIXERS:+--mixers "$MIXERS"}
[ -f "$out/train_step.log" ] && grep -E "compiled|FAIL" "$out/train_step.log"
exit $status
