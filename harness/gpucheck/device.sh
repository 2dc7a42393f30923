#!/usr/bin/env bash
# Every GPU check in one call, for a GPU host reached with no venv and no network (its python3 holds
# torch and triton). Prepare on the CPU machine first and bring build/gpu-check along:
#   make gpu-check-prepare            (CPU machine: tiny bundles built by the real builder, ~1 min)
#   harness/gpucheck/device.sh OUT    (GPU host: writes OUT/*.json and OUT/*.log)
#
# The parts, their order, their steps and time budgets are data: GPU_HOST in harness/perf/suites.py
# (`python -m harness.perf gpu-host OUT --dry-run` prints the plan). This script records the host's
# stack in OUT/env.txt and runs that plan. The knobs are environment variables (harness/perf/runner.py):
#   PARTS       which parts run (default "check kernels bench spec perf"; dtests, sweep, ncu, tp, families
#               when named: families checks the Qwen3, Mistral and Gemma 3 bundles)
#   T_TOTAL     seconds the whole call may take (default 530); T_<STEP> one step's limit (T_CHECK, T_KERNELS,
#               T_DTESTS, T_SWEEP, T_NCU, T_HOST, T_BENCH, T_SPEC, T_PERF, T_LAUNCHES, T_TP, T_FAMILIES)
#   KERNEL_ARGS, BENCH_ARGS, SPEC_ARGS, PERF_ARGS, TP_ARGS, SWEEP_KERNELS   arguments of those steps
#   TIME_LIMIT  the throughput run's own limit; SWEEP_APPLY=<kernel>/<variant>: later steps run its winner
#   NCU_CASE, NCU_CFGS ';'-separated JSON tuning values for Nsight Compute
# Which to run together:
#   * one 9-minute call, everything at once: the defaults (PARTS unset);
#   * a complete 3000-request throughput run: PARTS=bench T_BENCH=560 T_TOTAL=570; BENCH_ARGS="--profile-at 120"
#     adds 3 s of torch.profiler inside it;
#   * kernel work (tuning, the FP8 GEMM sweep): PARTS="kernels perf" T_KERNELS=300, or
#     PARTS=kernels KERNEL_ARGS=--sweep T_KERNELS=560;
#   * EAGLE-3 cost in full: PARTS=spec T_SPEC=300 SPEC_ARGS="--draft-lens 0,1,2,3,4,6 --reps 3 --breakdown".
set -u
OUT=${1:-build/gpu-results}
PY=${PYTHON:-python3}
START=$SECONDS
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)          # the plan runs from the checkout's root
cd "$(dirname "$0")/../.."
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  $PY -c "import sys, torch, triton, numpy, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__, 'transformers', transformers.__version__)"
  $PY -m pip list 2>/dev/null | grep -i -E "^(cuda|pytest|nvidia-ml)"
} > "$OUT/env.txt" 2>&1
PYTHON=$PY $PY -m harness.perf gpu-host "$OUT"
echo "device.sh: $(( SECONDS - START ))s of T_TOTAL=${T_TOTAL:-530}s"
