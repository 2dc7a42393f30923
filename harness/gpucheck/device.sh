#!/usr/bin/env bash
# Every GPU check in one call, for a GPU machine reached with no venv and no network (the lent H100/H200:
# its python3 holds torch and triton). Prepare on the CPU machine first and bring build/gpu-check along:
#   make gpu-check-prepare            (CPU machine: tiny bundles built by the real builder, ~1 min)
#   harness/gpucheck/device.sh OUT    (GPU machine: writes OUT/*.json and OUT/*.log)
# Each part has its own time limit so one hang cannot eat the others' time; PARTS picks which run
# (default all: check kernels bench spec; the defaults' limits add up to more than one 600-s call,
# so a session short of time names the parts it needs, e.g. PARTS="spec" harness/gpucheck/device.sh OUT).
set -u
PARTS=" ${PARTS:-check kernels bench spec} "
want() { [[ "$PARTS" == *" $1 "* ]]; }
OUT=${1:-build/gpu-results}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  $PY -c "import sys, torch, triton, numpy, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__, 'transformers', transformers.__version__)"
  $PY -m pip list 2>/dev/null | grep -i -E "^(cuda|pytest|nvidia-ml)"
} > "$OUT/env.txt" 2>&1
if want check; then
  timeout "${T_CHECK:-170}" $PY -m harness.gpucheck run --out "$OUT/gpu-check.json" > "$OUT/gpu-check.log" 2>&1
  echo "gpu-check rc=$?"
fi
if want kernels; then
  timeout "${T_KERNELS:-210}" $PY -m harness.bench.kernels --out "$OUT/kernels.json" ${KERNEL_ARGS:-} > "$OUT/bench-kernels.log" 2>&1
  echo "bench-kernels rc=$?"
fi
if want bench; then
  timeout "${T_BENCH:-200}" $PY -m harness.bench.gpu --max-seconds "${MAX_SECONDS:-110}" --out "$OUT/gpu-bench.json" \
    > "$OUT/bench-gpu.log" 2>&1
  echo "bench-gpu rc=$?"
fi
if want spec; then
  # EAGLE-3 per-pass cost for a Llama-3.1-8B-shaped FP8 target (random weights) and the batch-1
  # speedup it implies with the SmolLM2 draft's MT-bench acceptance (harness/bench/eagle_cost.py).
  timeout "${T_SPEC:-180}" $PY -m harness.bench.eagle_cost --llama8b --breakdown --out "$OUT/eagle3-cost.json" > "$OUT/spec-cost.log" 2>&1
  echo "spec-cost rc=$?"
fi
