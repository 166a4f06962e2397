#!/usr/bin/env bash
# Every GPU check of the engine in one command, under 8 minutes on one H200 (each stage has its
# own time limit, 460 s in all): the GPU tests, decode and prefill step times of a Llama-3-8B-shaped
# model with random weights at TP1 (CUDA graphs vs eager, against the bandwidth bound), and the
# profiler's sweep that fits the cost model to this engine. No Ray, no network: torch (CUDA, with
# Triton), numpy, pyyaml and pytest, run from a checkout without installing it.
#
#   benchmarks/gpu_check.sh            # on the GPU machine
#   benchmarks/gpu_check.sh --smoke    # tiny config on CPU: tests this script, measures nothing
#
# Figures go to $OUT when set, else runs/gpu-check: gpu_tests.log, engine.json, profile.json,
# costmodel.yaml and gpu_check.md (the summary benchmarks/RESULTS.md quotes). A stage that fails
# or runs out of time is reported in gpu_check.md and the exit status; the others still run.
set -u
cd "$(dirname "$0")/.."
SMOKE=""
[ "${1:-}" = "--smoke" ] && SMOKE="--smoke"
DEST="${OUT:-runs/gpu-check}"
mkdir -p "$DEST"
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi
# data/ is the package tidal_data once installed; from a bare checkout a link stands in for it.
SHIM="$(mktemp -d)"
trap 'rm -rf "$SHIM"' EXIT
ln -s "$PWD/data" "$SHIM/tidal_data"
export PYTHONPATH="$PWD:$SHIM${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
status=0

stage() {  # stage NAME SECONDS COMMAND...
  local name=$1 limit=$2 t0=$SECONDS
  shift 2
  echo "== $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0))s"
  [ $rc -eq 0 ] || status=1
  return 0
}

if [ -n "$SMOKE" ]; then TESTS=(tests/gpu); else TESTS=(tests/gpu tests/actors/test_paged_attention.py tests/actors/test_fused_ops.py); fi
stage tests 150 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" "${TESTS[@]}" > "$DEST/gpu_tests.log" 2>&1
tail -n 3 "$DEST/gpu_tests.log"
stage engine 160 "$PY" -m benchmarks.gpu_check engine --out "$DEST" $SMOKE
stage profile 130 "$PY" -m benchmarks.gpu_check profile --out "$DEST" $SMOKE
stage report 20 "$PY" -m benchmarks.gpu_check report --out "$DEST"
exit $status
