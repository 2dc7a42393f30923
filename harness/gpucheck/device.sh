#!/usr/bin/env bash
# Every GPU check in one call, for a GPU machine reached with no venv and no network (the lent H100/H200:
# its python3 holds torch and triton). Prepare on the CPU machine first and bring build/gpu-check along:
#   make gpu-check-prepare            (CPU machine: tiny bundles built by the real builder, ~1 min)
#   harness/gpucheck/device.sh OUT    (GPU machine: writes OUT/*.json and OUT/*.log)
# Each part has its own time limit so one hang cannot eat the others' time; PARTS picks which run
# (default all: check kernels bench spec; the defaults' limits add up to more than one 600-s call,
# so a session short of time names the parts it needs, e.g. PARTS="spec" harness/gpucheck/device.sh OUT).
# Part perf (not in the default; PARTS="check perf" fits one 9-minute call): fused-kernel tests on the GPU,
# fused vs unfused decode step at batch 1 and 64 on the 8B-shaped FP8 engine with the copy-bandwidth
# floor of the same run, a per-kernel profile of one step, and the launch count on the real GPU.
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
if want perf; then
  # harness/bench/decode_perf.py: tests/kernels/test_fused_layer.py on the GPU, copy bandwidth -> floor,
  # one decode step fused vs unfused (eager and CUDA graph), torch.profiler kernel table of each.
  timeout "${T_PERF:-300}" $PY -m harness.bench.decode_perf --batches 1 64 --out "$OUT/decode-perf.json" \
    > "$OUT/decode-perf.log" 2>&1
  echo "decode-perf rc=$?"
  # the launch counter on the real GPU (nothing emulated): must agree with docs/perf/launches.json
  timeout "${T_LAUNCHES:-60}" $PY -m harness.bench.launches --device cuda --out "$OUT/launches-gpu.json" \
    > "$OUT/launches-gpu.log" 2>&1
  echo "launches rc=$?"
fi
