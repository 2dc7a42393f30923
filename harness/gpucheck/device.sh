#!/usr/bin/env bash
# Every GPU check in one call, for a GPU machine reached with no venv and no network (the lent H100/H200:
# its python3 holds torch and triton). Prepare on the CPU machine first and bring build/gpu-check along:
#   make gpu-check-prepare            (CPU machine: tiny bundles built by the real builder, ~1 min)
#   harness/gpucheck/device.sh OUT    (GPU machine: writes OUT/*.json and OUT/*.log)
#
# Time: the parts share one budget, T_TOTAL seconds (default 530: one 600-s call of the lent machine
# with room for start-up and the transfers). Each part runs under its own limit T_<PART>, cut to what
# is left of T_TOTAL, and is skipped (said so in the output) when less than MIN_PART_S (20) is left,
# so one slow or hung part cannot take the others' time and the whole call ends within T_TOTAL.
# PARTS picks which run, in this order (default all five; sweep, ncu and tp only when named):
#   check   170 s -> 100  harness.gpucheck run: tiny bundles of every format (AOT cubins, no JIT, vs CPU),
#                         and the build's streamed verify on the GPU vs the CPU (verify.device: cuda)
#   kernels 210 s -> 120  harness.bench.kernels: kernel tests on the GPU, decode/prefill/W4A16 bandwidth,
#                         small-M FP8 GEMM vs torch._scaled_mm and small-M W4A16 vs bf16 (M = 1, 4, 16),
#                         graphed FP8-KV decode at b1 ctx8192 / b64 ctx2048, AOT without JIT (the JSON is
#                         written after each section, "complete": false until the end)
#   dtests         60     tests/kernels/test_paged_decode.py on the GPU (a failure keeps SWEEP_APPLY off)
#   sweep         150     harness.bench.kernels --sweep-only SWEEP_KERNELS (default paged_decode_fp8);
#                         SWEEP_APPLY=<kernel>/<variant> runs the later parts with its winner (KILN_TUNING)
#   ncu            60     Nsight Compute on the FP8-KV decode (NCU_CASE, NCU_CFGS: ';'-separated JSON)
#   bench   200 s -> 115  harness.bench.gpu: 8B-shaped FP8 engine, single stream (graphs) and the 1000/1000
#                         throughput run (KV pool 0.95 of free memory, concurrency bounded by KV) cut
#                         to the part's limit (--budget-s): partial, and the result says so; before it
#                  25     harness.bench.overhead at 512 sequences: this host's time per engine step with a
#                         zero-cost model (scheduler parts, and the whole Executor.step in both loops)
#   spec    180 s ->  70  harness.bench.eagle_cost: EAGLE-3 pass cost at k = 0, 4 (SPEC_ARGS)
#   perf    360 s -> 100  harness.bench.decode_perf (fused vs unfused decode step, 1, 64, 512) + the launch
#                         count on the real GPU (30 s of it); the fused-kernel tests are skipped when
#                         part kernels ran (they are among its tests)
#   tp             90     harness.bench.tp_overhead: decode step of TP 1 plain vs TP 1 through the distributed
#                         path (TPDriver, world size 1, NCCL) on the gpu-check fp8 bundle: the collectives'
#                         cost per step, torch-eager and fused layer + CUDA graphs (TP_ARGS="--pairs fast"
#                         for the second alone); exits 3 with one line when TPDriver(spec, tp_size=1,
#                         device="cuda") fails (#20), and the other parts run on
# (old limit -> the default now: together 530 s). Which to run together:
#   * one 9-minute call, everything at once: the defaults (PARTS unset);
#   * a complete 3000-request throughput run: PARTS=bench T_BENCH=560 T_TOTAL=570 (the run stops at the
#     limit if it has not finished: TIME_LIMIT=S states a shorter one); BENCH_ARGS="--profile-at 120"
#     adds 3 s of torch.profiler inside it (GPU busy fraction and kernels of the engine's real steps);
#   * kernel work (tuning, the FP8 GEMM sweep): PARTS="kernels perf" T_KERNELS=300, or
#     PARTS=kernels KERNEL_ARGS=--sweep T_KERNELS=560;
#   * EAGLE-3 cost in full: PARTS=spec T_SPEC=300 SPEC_ARGS="--draft-lens 0,1,2,3,4,6 --reps 3 --breakdown".
set -u
PARTS=" ${PARTS:-check kernels bench spec perf} "
want() { [[ "$PARTS" == *" $1 "* ]]; }
OUT=${1:-build/gpu-results}
PY=${PYTHON:-python3}
T_TOTAL=${T_TOTAL:-530}
START=$SECONDS
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# cap LIMIT: the part's limit cut to what is left of T_TOTAL
cap() { local left=$(( T_TOTAL - (SECONDS - START) )); (( $1 < left )) && echo "$1" || echo "$left"; }
# part NAME LIMIT LOG CMD...: run CMD under LIMIT seconds, output to OUT/LOG
part() {
  local name=$1 limit=$2 log=$3 t0=$SECONDS
  shift 3
  if (( limit < ${MIN_PART_S:-20} )); then
    echo "$name skipped: ${limit}s left for it (MIN_PART_S ${MIN_PART_S:-20}; T_TOTAL=${T_TOTAL}s, $(( SECONDS - START ))s used)"
    return 0
  fi
  timeout "$limit" "$@" > "$OUT/$log" 2>&1
  echo "$name rc=$? limit=${limit}s took=$(( SECONDS - t0 ))s"
}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  $PY -c "import sys, torch, triton, numpy, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__, 'transformers', transformers.__version__)"
  $PY -m pip list 2>/dev/null | grep -i -E "^(cuda|pytest|nvidia-ml)"
} > "$OUT/env.txt" 2>&1
if want check; then
  L=$(cap "${T_CHECK:-100}")
  part gpu-check "$L" gpu-check.log $PY -m harness.gpucheck run --out "$OUT/gpu-check.json"
fi
if want kernels; then
  L=$(cap "${T_KERNELS:-120}")
  part bench-kernels "$L" bench-kernels.log $PY -m harness.bench.kernels --out "$OUT/kernels.json" ${KERNEL_ARGS:-}
fi
DTESTS_RC=0
if want dtests; then
  # the decode attention's tests on this GPU (every tuning knob of the sweep below, against the reference)
  L=$(cap "${T_DTESTS:-60}")
  part dtests "$L" dtests.log env KILN_KERNEL_TESTS_ON_GPU=1 TRITON_INTERPRET=0 $PY -m pytest \
    tests/kernels/test_paged_decode.py -q -p no:cacheprovider -n 8
  DTESTS_RC=$(grep -q " passed" "$OUT/dtests.log" && ! grep -q -E "[0-9]+ (failed|error)" "$OUT/dtests.log"; echo $?)
  tail -1 "$OUT/dtests.log"
fi
if want sweep; then
  # a lean sweep: only SWEEP_KERNELS' candidates (default the FP8-KV decode attention), no tests
  L=$(cap "${T_SWEEP:-150}")
  part sweep "$L" sweep.log $PY -m harness.bench.kernels --sweep-only ${SWEEP_KERNELS:-paged_decode_fp8} \
    --out "$OUT/sweep.json"
  # SWEEP_APPLY=<kernel>/<variant>: the later parts of this call run that entry's winner (KILN_TUNING)
  if [[ -n "${SWEEP_APPLY:-}" && "$DTESTS_RC" != 0 ]]; then
    echo "sweep winner NOT applied: the decode tests failed on this GPU (dtests.log)"
  elif [[ -n "${SWEEP_APPLY:-}" ]]; then
    if W=$($PY -m harness.bench.kernel_sweep "$OUT/sweep.json" "$SWEEP_APPLY"); then
      export KILN_TUNING="$W"
    fi
    echo "sweep winner of $SWEEP_APPLY: KILN_TUNING=${KILN_TUNING:-unset (no winner)}"
  fi
fi
if want ncu; then
  # Nsight Compute on one decode launch per NCU_CFGS entry (JSON tuning values, ';'-separated):
  # DRAM throughput, occupancy, warp stall reasons; text report in OUT/ncu.txt
  L=$(cap "${T_NCU:-60}")
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  ARGS=()
  IFS=';' read -ra CFGS <<< "${NCU_CFGS:-{\}}"
  for c in "${CFGS[@]}"; do ARGS+=(--cfg "$c"); done
  part ncu "$L" ncu.txt "$NCU" -k regex:paged_decode_kernel --launch-skip 3 \
    --launch-count "${#CFGS[@]}" --section SpeedOfLight --section Occupancy --section WarpStateStats \
    --section MemoryWorkloadAnalysis $PY -m harness.bench.decode_ncu --case "${NCU_CASE:-fp8-b512-ctx1536}" "${ARGS[@]}"
fi
if want bench; then
  # this host's share first: the whole executor step with a zero-cost model at 512 sequences, both
  # loops (harness.bench.overhead): does the host keep up with the ~500-sequence steps of the run?
  L=$(cap "${T_HOST:-25}")
  part host-overhead "$L" host-overhead.log $PY -m harness.bench.overhead --num-seqs 512 --steps 200 \
    --output "$OUT/host-overhead.json"
  # --budget-s: the throughput run ends in time for the result to be written inside the part's limit
  L=$(cap "${T_BENCH:-115}")
  TL=${TIME_LIMIT:-${MAX_SECONDS:-}}
  part bench-gpu "$L" bench-gpu.log $PY -m harness.bench.gpu --budget-s "$(( L - 5 ))" ${TL:+--time-limit "$TL"} \
    --skip-eager --out "$OUT/gpu-bench.json" ${BENCH_ARGS:-}
fi
if want spec; then
  # EAGLE-3 per-pass cost for a Llama-3.1-8B-shaped FP8 target (random weights) and the batch-1
  # speedup it implies with the SmolLM2 draft's MT-bench acceptance (harness/bench/eagle_cost.py).
  L=$(cap "${T_SPEC:-70}")
  part spec-cost "$L" spec-cost.log $PY -m harness.bench.eagle_cost --llama8b ${SPEC_ARGS:---draft-lens 0,4 --reps 3 --breakdown} \
    --out "$OUT/eagle3-cost.json"
fi
if want perf; then
  # harness/bench/decode_perf.py: tests/kernels/test_fused_layer.py on the GPU (unless part kernels ran
  # them), copy bandwidth -> floor, one decode step fused vs unfused (eager and CUDA graph), torch.profiler
  # kernel table of each; then the launch counter on the real GPU (nothing emulated): must agree with
  # docs/perf/launches.json
  T_LAUNCHES=${T_LAUNCHES:-30}
  L=$(cap "$(( ${T_PERF:-100} - T_LAUNCHES ))")
  SKIP=""
  want kernels && SKIP="--skip-tests"
  part decode-perf "$L" decode-perf.log $PY -m harness.bench.decode_perf --batches 1 64 512 ${PERF_ARGS:-$SKIP} \
    --out "$OUT/decode-perf.json"
  L=$(cap "$T_LAUNCHES")
  part launches "$L" launches-gpu.log $PY -m harness.bench.launches --device cuda --out "$OUT/launches-gpu.json"
fi
if want tp; then
  # the refusal (exit 3) or the result's last line, in this call's output
  L=$(cap "${T_TP:-90}")
  rm -f "$OUT/tp.log"
  part tp "$L" tp.log $PY -m harness.bench.tp_overhead --out "$OUT/tp-overhead.json" ${TP_ARGS:-}
  [[ -f "$OUT/tp.log" ]] && tail -1 "$OUT/tp.log"
fi
echo "device.sh: $(( SECONDS - START ))s of T_TOTAL=${T_TOTAL}s"
