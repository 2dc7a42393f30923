"""What the Triton serving path costs per token, measured with a model that costs almost nothing.

    python -m harness.perf.serving.ceiling [--output F]

A GPU decodes a step of an 8B model in milliseconds; on the 2-core CPU only a tiny model does. So
this builds (once, under build/perf/serving-ceiling/) a random-weight Llama of hidden size 64 and
2 layers with SmolLM2's tokenizer (no quantization, no verify), and on the same MT-bench prompts
(chat template, exactly ``--max-tokens`` tokens each: min_tokens = max_tokens) measures:

* the executor alone, every request submitted at once with max_batch_size = ``--concurrency``:
  what the engine can do (the peer);
* the real Triton server, gRPC streaming to the ensemble at ``--concurrency`` streams, once per
  ``serving.stream_interval`` value (tokens per streamed response) and ``serving.response_thread``
  value (``--response-thread``: on, off or both, off first) and ``serving.coalesce_responses`` value
  (``--coalesce``, likewise), the repository re-rendered and a fresh server started for each;
  ``--rounds`` repeats them all, the order reversed every other round. Each run also records the
  streamed text pieces per request (the responses that reached the client, coalesced or not).

Engine tokens are counted exactly (completed requests x max_tokens), not by re-tokenizing the
random model's text. The gap between the two is the serving path: per streamed response one
Python-backend send (a round trip from the engine's stub to the server) and one postprocessing
execute (another), plus the server's own work.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from harness.perf.lib.prompts import load_prompts
from harness.perf.lib.results import header, write_result
from harness.perf.serving.sweep import WARMUP_PROMPT, _run_level, level_prompts, summarize

ROOT = Path(__file__).resolve().parents[3]
SHAPE = {"hidden": 64, "layers": 2, "heads": 2, "kv_heads": 1, "intermediate": 128, "tie": True}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m harness.perf.serving.ceiling",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default=str(ROOT / "build/perf/serving-ceiling"))
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=160)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--stream-intervals", default="1,4", help="comma-separated serving.stream_interval values")
    p.add_argument("--response-thread", choices=("on", "off", "both"), default="on",
                   help="serving.response_thread of the served runs (both: an A/B, off first)")
    p.add_argument("--coalesce", choices=("on", "off", "both"), default="on",
                   help="serving.coalesce_responses of the served runs (both: an A/B, off first)")
    p.add_argument("--rounds", type=int, default=1, help="repeat the served runs (order reversed each round)")
    p.add_argument("--output", default=None, help="results JSON (default build/perf/serving-ceiling-<time>.json)")
    p.add_argument("--note", default="")
    a = p.parse_args(argv)
    try:
        a.intervals = [int(x) for x in a.stream_intervals.split(",") if x.strip()]
    except ValueError:
        p.error(f"--stream-intervals: {a.stream_intervals!r}; allowed: comma-separated integers >= 1")
    if not a.intervals or min(a.intervals) < 1:
        p.error(f"--stream-intervals: {a.stream_intervals!r}; allowed: comma-separated integers >= 1")
    if a.concurrency < 1 or a.num_prompts < 1 or a.max_tokens < 2 or a.rounds < 1:
        p.error("--concurrency, --num-prompts and --rounds must be >= 1, --max-tokens >= 2")
    switch = {"on": [True], "off": [False], "both": [False, True]}
    a.threads, a.coalesces = switch[a.response_thread], switch[a.coalesce]
    return a


def _flag(on: bool) -> str:
    return "true" if on else "false"


def build(workdir: Path, stream_interval: int, response_thread: bool = True, coalesce: bool = True) -> Path:
    """The tiny bundle and its repository rendered with ``stream_interval``, ``response_thread`` and
    ``coalesce`` (only the package stage runs again once the engine exists); returns the build folder."""
    ckpt = workdir / "checkpoint"
    if not (ckpt / "config.json").is_file():
        from harness.perf.build_cost import _tokenizer_dir  # the builder's own SmolLM2 import
        from harness.perf.lib.models import write_random_llama
        write_random_llama(ckpt, _tokenizer_dir(workdir), **SHAPE)
    out = workdir / "build"
    cmd = [sys.executable, "-m", "builder", "build", "configs/smollm2-135m-bf16.yaml", f"model.source={ckpt}",
           "verify.enabled=false", f"serving.stream_interval={stream_interval}",
           f"serving.response_thread={_flag(response_thread)}", f"serving.coalesce_responses={_flag(coalesce)}",
           "--output", str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return out


def executor_alone(engine: Path, prompt_ids: list[list[int]], max_tokens: int, concurrency: int,
                   reps: int = 3) -> dict[str, Any]:
    """The best of ``reps`` runs (a run is a few seconds: a shared machine's hiccups would decide a single one)."""
    from harness.perf.throughput.engine import run_executor
    runs = [run_executor(str(engine), prompt_ids, max_tokens, None, concurrency) for _ in range(reps)]
    best = max(runs, key=lambda r: r["output_tok_per_s"])
    return {"output_tok_s": best["output_tok_per_s"], "seconds": best["seconds"], "tpot_s_p50": best["tpot_s_p50"],
            "steps": best["steps"], "output_tok_s_each_run": [r["output_tok_per_s"] for r in runs]}


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    """User + system CPU seconds of each process (from /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[pid] = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return out


def through_triton(build_dir: Path, prompts: list[str], a: argparse.Namespace) -> dict[str, Any]:
    from harness.model_names import repository_names
    from harness.serving_server import TritonServer
    repo = build_dir / "model_repository"
    model = repository_names(repo).ensemble
    with TritonServer(repo, exit_timeout=3) as srv:
        warm, _ = asyncio.run(_run_level(srv.grpc_url, model, [WARMUP_PROMPT], 1, None, 4, 0))
        if warm[0].error:
            raise RuntimeError(f"warm-up failed: {warm[0].error}")
        roles = {srv.proc.pid: "tritonserver", os.getpid(): "client (this process)", **srv.stub_pids()}
        before = cpu_seconds(list(roles))
        results, wall = asyncio.run(_run_level(srv.grpc_url, model, prompts, a.concurrency, None, a.max_tokens, 0))
        after = cpu_seconds(list(roles))
    # exact counts: every completed request generated max_tokens (min_tokens = max_tokens)
    row = summarize(results, [a.max_tokens if r.error is None else 0 for r in results], wall, 2.0, 0.2)
    tokens = max(row["output_tokens"], 1)
    cpu = {roles[p]: round((after[p] - before[p]) * 1e3 / tokens, 3) for p in roles if p in before and p in after}
    done = [r for r in results if r.error is None]
    return {"output_tok_s": row["output_token_throughput"], "seconds": wall, "completed": row["completed"],
            "errors": row["errors"], "tpot_s_p50": row["tpot_s"]["p50"], "cpu_ms_per_token": cpu,
            "pieces_per_request": sum(len(r.pieces) for r in done) / max(len(done), 1)}


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from backend.serving.conversion.tokenizer import load_tokenizer
    workdir = Path(a.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    started = dt.datetime.now(dt.timezone.utc)
    head = header("serving-ceiling", "harness.perf.serving.ceiling", argv)
    prompts, _ = level_prompts(load_prompts("mtbench"), 0, a.num_prompts)
    first = build(workdir, a.intervals[0])
    tok = load_tokenizer(first / "engine")
    alone = executor_alone(first / "engine", [tok.encode(p, chat=True) for p in prompts], a.max_tokens,
                           a.concurrency)
    print(f"executor alone: {alone['output_tok_s']:.0f} tok/s (best of {alone['output_tok_s_each_run']})", flush=True)
    # coalescing only exists with the responder's thread
    plan = list(dict.fromkeys((k, t, c and t) for k in a.intervals for t in a.threads for c in a.coalesces))
    served = []
    for rnd in range(a.rounds):
        for k, t, c in (plan if rnd % 2 == 0 else plan[::-1]):
            r = {"round": rnd, "stream_interval": k, "response_thread": t, "coalesce_responses": c,
                 **through_triton(build(workdir, k, t, c), prompts, a)}
            r["share_of_executor"] = r["output_tok_s"] / alone["output_tok_s"]
            served.append(r)
            print(f"Triton, stream_interval {k}, response_thread {t}, coalesce {c}: {r['output_tok_s']:.0f} tok/s "
                  f"({r['share_of_executor']:.2f} of the executor alone), errors {r['errors']}, "
                  f"{r['pieces_per_request']:.1f} pieces per request, CPU ms per token {r['cpu_ms_per_token']}",
                  flush=True)
    medians = {f"stream_interval={k},response_thread={_flag(t)},coalesce_responses={_flag(c)}": statistics.median(
        r["output_tok_s"] for r in served
        if (r["stream_interval"], r["response_thread"], r["coalesce_responses"]) == (k, t, c)) for k, t, c in plan}
    report = {**head, "what": "serving-path cost with a near-zero-cost model: the executor alone vs the same engine "
                      "through the real Triton server (ensemble, gRPC streaming), same prompts, exact token counts",
              "note": a.note, "model": {"random_llama": SHAPE, "tokenizer": "SmolLM2", "quantization": "none"},
              "settings": {"concurrency": a.concurrency, "num_prompts": a.num_prompts, "max_tokens": a.max_tokens,
                           "rounds": a.rounds},
              "executor_alone": alone, "triton_median_output_tok_s": medians, "triton_runs": served}
    write_result(report, a.output, f"serving-ceiling-{started:%Y%m%d-%H%M%S}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
