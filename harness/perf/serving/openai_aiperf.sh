#!/usr/bin/env bash
# make bench-openai: NVIDIA AIPerf (an external OpenAI benchmark client) against Kiln's OpenAI front
# door, on an idle machine. AIPerf lives in its own venv under build/ (it is not one of Kiln's
# dependencies: its pins would fight the project's); the report lands in build/perf/ unless RESULT
# names another file (a committed docs/perf/ file is replaced only when named so).
#
#   harness/perf/serving/openai_aiperf.sh [REPO]   REPO: build/<stem>/model_repository (default: the
#                                                  default config's build)
# Environment (defaults in brackets):
#   URL          an OpenAI server already running, e.g. http://127.0.0.1:9000 [start one here with
#                harness.serve --openai-port, stopped at the end]
#   CONCURRENCY  [4]     REQUESTS [64]     ISL [128] OSL [128] (synthetic prompt / answer tokens;
#                the answer length is fixed with vLLM's ignore_eos, which the front door honours)
#   ENDPOINT     [chat]  (or completions)  AIPERF_VERSION [0.13.0]
#   RESULT       [build/perf/openai-aiperf.json] (not OUT: make's OUT is the build folder)
set -euo pipefail
cd "$(dirname "$0")/../../.."
REPO=${1:-build/smollm2-135m-fp8/model_repository}
PY=${PY:-.venv/bin/python}
VENV=build/aiperf-venv
CONCURRENCY=${CONCURRENCY:-4} REQUESTS=${REQUESTS:-64} ISL=${ISL:-128} OSL=${OSL:-128}
ENDPOINT=${ENDPOINT:-chat} AIPERF_VERSION=${AIPERF_VERSION:-0.13.0} RESULT=${RESULT:-build/perf/openai-aiperf.json}
ARTIFACTS=build/perf/aiperf/$(date +%Y%m%d-%H%M%S)

[[ -d $REPO ]] || { echo "error: $REPO not found; build it first: make build" >&2; exit 2; }
if [[ ! -x $VENV/bin/aiperf ]]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q "aiperf==$AIPERF_VERSION"
fi

# the model id and the tokenizer AIPerf counts tokens with: the bundle's own (engine_dir of the repository)
read -r MODEL TOKENIZER < <("$PY" -c "
import sys
from harness.openai.served_model import load_served_model
m = load_served_model(sys.argv[1]); print(m.name, m.engine_dir / 'tokenizer')" "$REPO")

SERVE_PID=
cleanup() { [[ -n $SERVE_PID ]] && kill -INT "$SERVE_PID" 2>/dev/null && wait "$SERVE_PID" || true; }
trap cleanup EXIT
if [[ -z ${URL:-} ]]; then
    PORT=$("$PY" -c "from harness.serving_server import free_port; print(free_port())")
    mkdir -p build/logs
    "$PY" -m harness.serve --model-repository "$REPO" --openai-port "$PORT" > build/logs/bench-openai-serve.log 2>&1 &
    SERVE_PID=$!
    URL=http://127.0.0.1:$PORT
    for _ in $(seq 600); do
        curl -sf "$URL/health" > /dev/null && break
        kill -0 "$SERVE_PID" 2>/dev/null || { cat build/logs/bench-openai-serve.log >&2; exit 1; }
        sleep 1
    done
    curl -sf "$URL/health" > /dev/null || { echo "error: $URL/health never answered 200" >&2; exit 1; }
fi

LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)   # recorded with the result: benchmark an idle machine
"$VENV/bin/aiperf" profile --model "$MODEL" --tokenizer "$TOKENIZER" --url "$URL" \
    --endpoint-type "$ENDPOINT" --streaming \
    --synthetic-input-tokens-mean "$ISL" --synthetic-input-tokens-stddev 0 \
    --output-tokens-mean "$OSL" --output-tokens-stddev 0 --extra-inputs '{"ignore_eos": true}' \
    --concurrency "$CONCURRENCY" --request-count "$REQUESTS" --random-seed 123 \
    --artifact-dir "$ARTIFACTS"

# the summary, with what was measured where (the one result writer: harness/perf/lib/results.py)
KILN_PERF_COMMAND="make bench-openai BENCH_ENV=\"CONCURRENCY=$CONCURRENCY REQUESTS=$REQUESTS ISL=$ISL OSL=$OSL ENDPOINT=$ENDPOINT\"" \
"$PY" - "$ARTIFACTS" "$RESULT" "$MODEL" "$URL" "$LOAD_BEFORE" <<'EOF'
import json, pathlib, sys
from harness.perf.lib.results import header, product_path, write_result
art, out, model, url, load = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
summary = next(art.rglob("profile_export_aiperf.json"))
report = {**header("openai-aiperf", "harness.perf.serving.openai_aiperf"), "tool": "aiperf", "model": model,
          "url": url, "load_before": load, "artifacts": product_path(str(art.resolve())),
          "aiperf": json.loads(summary.read_text())}
write_result(report, out, indent=1)
EOF
