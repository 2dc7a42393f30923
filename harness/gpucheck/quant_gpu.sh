#!/usr/bin/env bash
# Streamed FP8 quantization of a random-weight Llama-3.1-8B-shaped checkpoint on an NVIDIA GPU host,
# for a machine with no venv and no network: its python3 holds torch and transformers, not ModelOpt.
#   CPU machine, once:   python3 -m pip download ... -d .whl nvidia-modelopt==0.47.0 (+ the wheels below)
#                        .venv/bin/python -m harness.perf.quant_gpu --save-tokenizer .whl/smollm2-tokenizer
#   GPU machine (carry .whl):  KILN_COMMIT=<sha> bash harness/gpucheck/quant_gpu.sh OUTDIR
# Writes OUTDIR/quant-gpu.json (rewritten after each phase) and OUTDIR/quant-gpu.log.
# T_QUANT (default 150) seconds: the benchmark starts no layer past it, counted from its own start
# (checkpoint writing included); `timeout` kills it T_GRACE (default 40) s later if a layer hangs.
# QUANT_ARGS adds options, e.g. "--layers 16" when writing the 16 GB checkpoint takes too long.
# .whl holds the packages the GPU host's image lacks: nvidia-modelopt
# and what it imports at load time, omegaconf, pulp, pydantic (+ pydantic-core, annotated-types,
# typing-inspection, typing-extensions >= 4.16 that pydantic-core wants).
set -u
OUT=${1:-build/quant-gpu}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
LOG="$OUT/quant-gpu.log"
{
  echo "== $(date -u +%FT%TZ) install .whl -> /tmp/site"
  t0=$SECONDS
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "pip install failed"; exit 3; }
  echo "installed in $(( SECONDS - t0 )) s"
} > "$LOG" 2>&1 || { cat "$LOG"; exit 3; }
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
T=${T_QUANT:-150}
# shellcheck disable=SC2086  # QUANT_ARGS is a list of options
# the suite table's quant-gpu row (harness/perf/suites.py)
timeout "$(( T + ${T_GRACE:-40} ))" "$PY" -m harness.perf run quant-gpu --output "$OUT/quant-gpu.json" -- \
  --time-limit "$T" ${QUANT_ARGS:-} >> "$LOG" 2>&1
rc=$?
echo "quant_gpu exit $rc" >> "$LOG"
tail -n 25 "$LOG"
exit $rc
