"""Serving benchmark over gRPC streaming against a real Triton server (``make bench``).

    python -m harness.perf.serving.sweep --url 127.0.0.1:8001                    # a server already running
    python -m harness.perf.serving.sweep --start --model-repository build/smollm2-135m-fp8/model_repository \
        --models ensemble,tensorrt_llm_bls --baseline hf

Concurrency sweep (1, 4, 16, 64 streams, each keeping that many requests in flight) and an optional
Poisson request-rate mode (``--request-rate``), on MT-bench first-turn questions (chat template
applied). Reports TTFT, TPOT, inter-token latency and end-to-end latency (p50/p90/p99), request and
output-token throughput and goodput under ``--ttft-limit``/``--tpot-limit``; writes JSON, CSV and a
PNG plot. Every request generates exactly ``--max-tokens`` tokens (min_tokens = max_tokens) so runs
and the HF baseline compare equal work. Output tokens are counted by re-tokenizing the streamed text
with the bundle's tokenizer.

Every level is measured on prompts no earlier level sent (consecutive slices of the prompt list;
a row records ``prompts_seen_before`` where the list ran out and wrapped): a repeated prompt would
find its prefill in the engine's prefix cache, which the HF baseline has no counterpart of. One short
warm-up request (not from the list) runs first, as the HF baseline warms up with one short batch.
The HF baseline generates the very prompts of the level it is compared with.

With ``--start`` every row also records the CPU the server, each model's stubs and this client took
during the level (``cpu_cores``: CPU-seconds per wall second, read from /proc below): on a small
CPU they share the cores the engine computes on.

The statistics (percentiles, throughput, goodput; CSV rows and the plot; the CPU each process of the
serving path took) are this module's too: ``summarize`` is shared with ``serving/ceiling.py``.
"""
from __future__ import annotations

import argparse
import asyncio
import csv
import os
import datetime as dt
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from harness.serving_client import StreamResult, grpc_stream
from harness.perf.lib.results import REPO, default_output, header, write_result
from harness.perf.lib.prompts import load_prompts
from harness.model_names import DEFAULT
from harness.serving_server import proc_stat, stub_processes

ROOT = REPO


PCTS = (50, 90, 99)


def _pcts(values: Sequence[float]) -> dict[str, float | None]:
    if not len(values):
        return {f"p{p}": None for p in PCTS} | {"mean": None}
    a = np.asarray(values, dtype=np.float64)
    return {f"p{p}": float(np.percentile(a, p)) for p in PCTS} | {"mean": float(a.mean())}


def summarize(results: list[Any], tokens: list[int], wall_s: float, ttft_limit: float,
              tpot_limit: float) -> dict[str, Any]:
    """``results``: StreamResult per request; ``tokens``: output tokens of each."""
    ok = [(r, n) for r, n in zip(results, tokens) if r.error is None and r.ttft is not None]
    ttft = [r.ttft for r, _ in ok]
    tpot = [(r.latency - r.ttft) / (n - 1) for r, n in ok if n > 1]
    itl = [b - a for r, _ in ok for a, b in zip(r.token_times, r.token_times[1:])]
    e2e = [r.latency for r, _ in ok]
    good = sum(1 for r, n in ok if r.ttft <= ttft_limit and (n <= 1 or (r.latency - r.ttft) / (n - 1) <= tpot_limit))
    out_tokens = sum(n for _, n in ok)
    return {
        "requests": len(results), "completed": len(ok), "errors": len(results) - len(ok),
        "wall_s": wall_s, "output_tokens": out_tokens,
        "request_throughput": len(ok) / wall_s, "output_token_throughput": out_tokens / wall_s,
        "goodput": good / wall_s, "goodput_limits": {"ttft_s": ttft_limit, "tpot_s": tpot_limit},
        "ttft_s": _pcts(ttft), "tpot_s": _pcts(tpot), "itl_s": _pcts(itl), "e2e_s": _pcts(e2e),
    }


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    flat = []
    for r in rows:
        f = {k: v for k, v in r.items() if not isinstance(v, dict)}
        for k in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
            for p, v in r[k].items():
                f[f"{k[:-2]}_{p}_s"] = v
        flat.append(f)
    keys = list(dict.fromkeys(k for f in flat for k in f))
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        w.writerows(flat)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for model in dict.fromkeys(r["model"] for r in rows):
        rs = [r for r in rows if r["model"] == model and r["mode"] == "concurrency"]
        if not rs:
            continue
        x = [r["output_token_throughput"] for r in rs]
        axes[0].plot(x, [r["ttft_s"]["p50"] for r in rs], "o-", label=f"{model} TTFT p50")
        axes[0].plot(x, [r["tpot_s"]["p50"] or 0 for r in rs], "s--", label=f"{model} TPOT p50")
        for r in rs:
            axes[0].annotate(f"c={r['concurrency']}", (r["output_token_throughput"], r["ttft_s"]["p50"]),
                             fontsize=7)
        axes[1].plot([r["concurrency"] for r in rs], x, "o-", label=model)
    axes[0].set(xlabel="output tokens/s", ylabel="latency (s)", yscale="log", title="latency vs throughput")
    axes[1].set(xlabel="concurrent streams", ylabel="output tokens/s", xscale="log", title="throughput")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------
# CPU time of the processes a serving run involves, by kind, from /proc: the Triton server, each
# model's Python backend stubs (the engine's, the tokenizer models'), and this process (the benchmark's
# client). On a 2-core machine they all share the cores the engine computes on, so how much each takes
# during a level says what the serving path costs beside the engine (harness/perf/serving/sweep.py adds it
# to every row it can: ``cpu_cores``, CPU-seconds per wall second).
#
#     before = snapshot(server_pid)
#     ...                                  # the level
#     cores = cores_used(before, snapshot(server_pid), wall_s)   # {"tritonserver": 0.1, ...}

_TICK = os.sysconf("SC_CLK_TCK")
SERVER, CLIENT = "tritonserver", "client"


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (all its threads), None when it is gone."""
    fields = proc_stat(pid)
    return None if fields is None else (int(fields[11]) + int(fields[12])) / _TICK   # utime, stime


def snapshot(server_pid: int) -> dict[int, tuple[str, float]]:
    """pid -> (kind, CPU seconds) for the server, its stubs (kind: the model's name) and this process."""
    kinds = {server_pid: SERVER, os.getpid(): CLIENT, **stub_processes(server_pid)}
    out = {}
    for pid, kind in kinds.items():
        t = cpu_seconds(pid)
        if t is not None:
            out[pid] = (kind, t)
    return out


def cores_used(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
               wall_s: float) -> dict[str, float]:
    """CPU-seconds per wall second of each kind between two snapshots (processes in both only; a
    kind's instances summed), largest first."""
    per: dict[str, float] = {}
    for pid, (kind, t1) in after.items():
        if pid in before and wall_s > 0:
            per[kind] = per.get(kind, 0.0) + (t1 - before[pid][1]) / wall_s
    return {k: round(v, 3) for k, v in sorted(per.items(), key=lambda kv: -kv[1])}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m harness.perf.serving.sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="127.0.0.1:8001", help="gRPC host:port of a running server")
    p.add_argument("--start", action="store_true", help="start a server for the run (free ports)")
    p.add_argument("--model-repository", default=str(ROOT / "build/smollm2-135m-fp8/model_repository"))
    p.add_argument("--models", default=DEFAULT.ensemble,
                   help=f"comma-separated model names, e.g. {DEFAULT.ensemble},{DEFAULT.bls} (serving.model_names)")
    p.add_argument("--concurrency", default="1,4,16,64", help="comma-separated stream counts ('' = none)")
    p.add_argument("--request-rate", type=float, default=None, help="also run Poisson arrivals at this rate (req/s)")
    p.add_argument("--num-prompts", type=int, default=0, help="requests per level (default max(16, concurrency))")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompts", default="mtbench", help="mtbench | a JSONL with text/prompt/turns")
    p.add_argument("--ttft-limit", type=float, default=2.0, help="goodput TTFT limit, seconds")
    p.add_argument("--tpot-limit", type=float, default=0.2, help="goodput TPOT limit, seconds")
    p.add_argument("--baseline", choices=("hf",), default=None, help="also run HF transformers generate")
    p.add_argument("--baseline-batch", type=int, default=16, help="HF generate batch size")
    p.add_argument("--output", default=None, help="result stem: .json, .csv, .png (default build/perf/serving-<time>)")
    p.add_argument("--note", default="", help="free text stored in the results (e.g. machine load)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.max_tokens < 1:
        p.error(f"--max-tokens: {a.max_tokens}; allowed: >= 1")
    try:
        a.levels = [int(c) for c in a.concurrency.split(",") if c.strip()]
    except ValueError:
        p.error(f"--concurrency: {a.concurrency!r}; allowed: comma-separated integers, e.g. 1,4,16,64")
    if any(c < 1 for c in a.levels):
        p.error(f"--concurrency: {a.concurrency}; every level must be >= 1")
    a.model_list = [m for m in a.models.split(",") if m]
    if not a.levels and a.request_rate is None:
        p.error("nothing to run: give --concurrency levels and/or --request-rate")
    if a.request_rate is not None and a.request_rate <= 0:
        p.error(f"--request-rate: {a.request_rate}; allowed: > 0")
    return a


async def _run_level(url: str, model: str, prompts: list[str], concurrency: int | None, rate: float | None,
                     max_tokens: int, seed: int) -> tuple[list[StreamResult], float]:
    import tritonclient.grpc.aio as aio
    client = aio.InferenceServerClient(url)
    # only the text, as a chat client asks: the other eight outputs (log probs, speculation counters,
    # logits) would be serialized on every streamed token by the server and parsed by this client
    kw = dict(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0, apply_chat_template=True,
              outputs=["text_output"])
    sem = asyncio.Semaphore(concurrency or len(prompts))
    rng = random.Random(seed)

    async def one(text: str, delay: float) -> StreamResult:
        await asyncio.sleep(delay)
        async with sem:
            return await grpc_stream(client, model, text, **kw)
    delays, t = [], 0.0
    for _ in prompts:
        delays.append(t if rate else 0.0)
        t += rng.expovariate(rate) if rate else 0.0
    t0 = time.perf_counter()
    try:
        results = await asyncio.gather(*(one(p, d) for p, d in zip(prompts, delays)))
    finally:
        await client.close()
    return list(results), time.perf_counter() - t0


WARMUP_PROMPT = "Reply with one word: ready?"   # not an MT-bench question: nothing of it is reused


def level_prompts(base: list[str], start: int, n: int) -> tuple[list[str], int]:
    """The ``n`` prompts from ``start`` on (wrapping), and how many of them a level before this one
    (which sent ``base[0:start]``, wrapping too) already sent."""
    idx = [(start + i) % len(base) for i in range(n)]
    seen = set(range(len(base))) if start >= len(base) else set(range(start))
    return [base[i] for i in idx], sum(i in seen for i in idx)


def run(a: argparse.Namespace, url: str, tokenizer, server_pid: int | None = None) -> dict[str, Any]:
    """Every level of every model; with ``server_pid`` (a server this run started) each row also gets
    the CPU its processes and this client took during the level (``cpu_cores``: ``snapshot`` and ``cores_used`` above)."""
    base = load_prompts(a.prompts)
    rows = []
    # one count across models too: ensemble and bls both drive the same engine model, whose prefix
    # cache would otherwise serve the second model the first one's prompts
    start = 0
    for model in a.model_list:
        plan = [("concurrency", c, None) for c in a.levels]
        if a.request_rate:
            plan.append(("poisson", None, a.request_rate))
        warm, _ = asyncio.run(_run_level(url, model, [WARMUP_PROMPT], 1, None, 4, a.seed))
        if warm[0].error:
            raise RuntimeError(f"warm-up request to {model} failed: {warm[0].error}")
        for mode, conc, rate in plan:
            n = a.num_prompts or max(16, conc or 16)
            prompts, seen = level_prompts(base, start, n)
            cpu0 = snapshot(server_pid) if server_pid else None
            results, wall = asyncio.run(_run_level(url, model, prompts, conc, rate, a.max_tokens, a.seed))
            cpu = cores_used(cpu0, snapshot(server_pid), wall) if cpu0 is not None else None
            tokens = [len(tokenizer.encode(r.text, chat=False)) if r.error is None else 0 for r in results]
            row = {"model": model, "mode": mode, "concurrency": conc, "request_rate": rate,
                   "prompt_start": start % len(base), "prompts_seen_before": seen}
            start += n
            row |= summarize(results, tokens, wall, a.ttft_limit, a.tpot_limit)
            if cpu is not None:
                row["cpu_cores"] = cpu
            errors = [r.error for r in results if r.error]
            if errors:
                row["first_error"] = errors[0]
            rows.append(row)
            print(f"{model:9s} {mode:11s} c={conc or '-':>3} rate={rate or '-':>4}  "
                  f"{row['output_token_throughput']:7.1f} tok/s  {row['request_throughput']:5.2f} req/s  "
                  f"TTFT p50 {row['ttft_s']['p50'] or 0:6.3f}s p99 {row['ttft_s']['p99'] or 0:6.3f}s  "
                  f"TPOT p50 {row['tpot_s']['p50'] or 0:6.3f}s  errors {row['errors']}", flush=True)
            if cpu:
                print("          CPU cores: " + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items()), flush=True)
    return {"rows": rows}


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from backend import bundle
    from backend.serving.conversion.tokenizer import load_tokenizer
    repo = Path(a.model_repository)
    engine_dir = repo.parent / "engine"
    srv = None
    if a.start:
        from harness.serving_server import TritonServer
        srv = TritonServer(repo, exit_timeout=3)
        print(f"starting tritonserver on {repo} ...", flush=True)
        srv.start()
        url = srv.grpc_url
    else:
        url = a.url
    if not (engine_dir / bundle.MANIFEST).is_file():
        print(f"error: {engine_dir}: engine bundle needed for token counting (--model-repository)", file=sys.stderr)
        return 2
    tok = load_tokenizer(engine_dir)
    started = dt.datetime.now(dt.timezone.utc)
    head = header("serving", "harness.perf.serving.sweep", argv)
    head["machine"]["platform"] = platform.platform()
    try:
        out = run(a, url, tok, srv.proc.pid if srv is not None and srv.proc is not None else None)
        if srv is not None:
            out["engine_compute_dtype"] = engine_compute_dtype(srv.metrics_url)
    finally:
        if srv is not None:
            srv.stop()
    engine = bundle.read(engine_dir)
    report: dict[str, Any] = {
        **head, "what": "Kiln serving benchmark: real Triton server, gRPC streaming, MT-bench first turns",
        "note": a.note, "engine": {"quantization": engine.quantization.format,
                                   "kv_cache": engine.quantization.kv_cache,
                                   "dtype": engine.model.dtype, **bundle.as_dict(engine.engine)},
        "settings": {"max_tokens": a.max_tokens, "prompts": a.prompts, "temperature": 0.0,
                     "chat_template": True, "ttft_limit_s": a.ttft_limit, "tpot_limit_s": a.tpot_limit},
        **out,
    }
    stem = Path(a.output) if a.output else default_output(f"serving-{started:%Y%m%d-%H%M%S}")
    _write(report, out["rows"], stem, started)  # kept even if the baseline is interrupted
    if a.baseline == "hf":
        from harness.perf.throughput.engine import hf_throughput, in_each_dtype
        # the prompts of the level HF is compared with (that level's row), else the first ones
        ref = [r for r in out["rows"] if r["mode"] == "concurrency" and r["concurrency"] == a.baseline_batch]
        n = (a.num_prompts or max(16, a.baseline_batch)) if ref else max(a.baseline_batch * 2, 16)
        prompts, _ = level_prompts(load_prompts(a.prompts), ref[0]["prompt_start"] if ref else 0, n)

        def hf_run(dtype: str) -> dict[str, Any]:
            print(f"running HF transformers generate baseline in {dtype} ...", flush=True)
            return hf_throughput(prompts, a.max_tokens, a.baseline_batch, chat=True,
                                 checkpoint=repo.parent / "work" / "import", dtype=dtype)
        hf = in_each_dtype(hf_run, "output_token_throughput")
        report["baseline_hf"] = hf
        ratio = ratio_vs_hf(out["rows"], hf, a.baseline_batch)
        if ratio is not None:
            report["ratio_vs_hf"] = ratio
            print(f"Kiln ({ratio['kiln_model']}, {a.baseline_batch} streams) {ratio['kiln_tok_s']:.1f} tok/s vs "
                  f"HF generate (batch {a.baseline_batch}, the faster: {hf['best']}) {ratio['hf_tok_s']:.1f} "
                  f"tok/s: {ratio['ratio']:.2f}x ({', '.join(f'{k} {v:.2f}x' for k, v in ratio['ratio_each'].items())})",
                  flush=True)
        _write(report, out["rows"], stem, started)
    return 0


def engine_compute_dtype(metrics_url: str) -> list[dict[str, str]]:
    """What each engine instance computed in (engine.cpu_dtype's choice), from the server's
    ``kiln_engine_compute_dtype`` series: one label set per instance."""
    import re
    import urllib.request
    try:
        with urllib.request.urlopen(metrics_url, timeout=10) as resp:
            text = resp.read().decode()
    except OSError as exc:
        return [{"error": str(exc)}]
    return [dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            for m in re.finditer(r"^kiln_engine_compute_dtype\{([^}]*)\}", text, re.MULTILINE)]


def ratio_vs_hf(rows: list[dict[str, Any]], hf: dict[str, Any], concurrency: int) -> dict[str, Any] | None:
    """Kiln's first model at ``concurrency`` streams against HF generate at that batch size: the ratio
    to the faster of HF's dtypes (what a user comparing the two would pick), and to each."""
    ref = [r for r in rows if r["mode"] == "concurrency" and r["concurrency"] == concurrency]
    if not ref:
        return None
    kiln = ref[0]["output_token_throughput"]
    return {"kiln_model": ref[0]["model"], "concurrency": concurrency, "kiln_tok_s": kiln,
            "hf_dtype": hf["best"], "hf_tok_s": hf["best_tok_s"], "ratio": kiln / hf["best_tok_s"],
            "ratio_each": {dt: kiln / r["output_token_throughput"] for dt, r in hf["runs"].items()}}


def _write(report: dict[str, Any], rows: list[dict[str, Any]], stem: Path, started: dt.datetime) -> None:
    machine = report["machine"]
    write_result(report, stem.with_suffix(".json"))
    write_csv(rows, stem.with_suffix(".csv"))
    plot(rows, stem.with_suffix(".png"),
         f"Kiln serving, {machine['cpu']} ({machine['cores']} cores), {started:%Y-%m-%d}, commit {report['commit'][:8]}")
    print(f"wrote {stem}.csv, .png", flush=True)


if __name__ == "__main__":
    sys.exit(main())
