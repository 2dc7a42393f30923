"""Soak: mixed load with cancels and malformed requests against a real Triton server (``make soak``).

    python -m harness.perf.soak [--config configs/smollm2-135m-fp8.yaml] [--requests 1000] [--concurrency 64]

Builds the config with a KV pool of ``--kv-fraction`` of what the concurrent requests need (1/8 by
default, so the scheduler must preempt), serves it on 127.0.0.1 only, records each prompt's greedy
text sent alone, then runs ``--requests`` requests at ``--concurrency`` over gRPC streams: plain
greedy requests on ``ensemble`` and ``bls`` (each completed text must equal its alone-run text), a
``--cancel-fraction`` cancelled after their first piece (on ``bls``, and on ``engine`` by token ids),
and a ``--malformed-fraction`` of requests with out-of-range fields (each must get an error response).
Afterwards the KV pool and the stubs' thread counts must return to idle, the server must still be
up, and the first prompt must give the same text as before. Every request has a deadline: one that
passes it counts as a hang. Writes ``--out`` (default build/perf/soak.json) and exits non-zero on any failure.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from harness.serving_client import grpc_stream
from harness.serving_server import TritonServer, stub_processes
from harness.model_names import DEFAULT as NAMES
from harness.perf.lib.results import REPO

PROMPT_BUDGET = 64   # tokens a soak prompt may take (checked): the KV demand is sized with it
PROMPTS = [
    "def fibonacci(n):", "Once upon a time, in a small village,", "The capital of France is",
    "List three colours:", "Write a haiku about the sea.", "import numpy as np\n",
    "The quick brown fox", "Explain what a hash table is.", "1, 2, 3, 4,", "Dear Sir or Madam,",
    "The recipe for pancakes:", "In 1969, the first", "SELECT * FROM", "Q: What is 7 times 8?\nA:",
    "The mitochondria is", "Translate 'good morning' into French:",
]
# Fields out of range for every engine: each must come back as an error response, never a crash.
MALFORMED = [{"max_tokens": 0}, {"temperature": -1.0}, {"top_p": 1.5}, {"top_k": -3},
             {"max_tokens": 10 ** 7}, {"repetition_penalty": 0.0}]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m harness.perf.soak", description=__doc__.split("\n\n")[0],
                                epilog="Loopback only; bounded by --requests and --deadline.")
    p.add_argument("--config", default="configs/smollm2-135m-fp8.yaml", help="engine config to build and serve")
    p.add_argument("--output", default=None, help="build folder (default build/soak-<config stem>)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for the soak's build, as make build's OVERRIDES (repeatable)")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--cancel-fraction", type=float, default=0.10)
    p.add_argument("--malformed-fraction", type=float, default=0.05)
    p.add_argument("--kv-fraction", type=float, default=0.125, help="KV pool as a share of the concurrent demand")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--deadline", type=float, default=300.0, help="seconds one request may take before it is a hang")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="result JSON (default build/perf/soak.json)")
    a = p.parse_args(argv)
    for name in ("requests", "concurrency", "max_tokens"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be >= 1")
    for name in ("cancel_fraction", "malformed_fraction", "kv_fraction"):
        if not 0.0 <= getattr(a, name) <= 1.0:
            p.error(f"--{name.replace('_', '-')}: {getattr(a, name)}; allowed: 0..1")
    if a.cancel_fraction + a.malformed_fraction > 1.0:
        p.error("--cancel-fraction + --malformed-fraction must be <= 1")
    return a


def kv_tokens(concurrency: int, max_tokens: int, fraction: float, block: int = 16) -> int:
    """The KV pool: ``fraction`` of the concurrent demand, never less than one whole request."""
    need = PROMPT_BUDGET + max_tokens
    tokens = max(math.ceil(concurrency * need * fraction), need + block)
    return -(-tokens // block) * block


def build(args: argparse.Namespace) -> Path:
    """The config with the soak's small KV pool; returns the build root (engine/, model_repository/)."""
    from builder.config import BuildConfig
    from builder.pipeline import run_pipeline
    kv = kv_tokens(args.concurrency, args.max_tokens, args.kv_fraction)
    # sequences as long as a soak request can be: the KV pool must hold one whole sequence, and the
    # pool is a fraction of what the soak's requests need, not of the config's longest sequence
    seq = -(-(PROMPT_BUDGET + args.max_tokens) // 16) * 16
    cfg = BuildConfig.from_yaml(args.config, [f"engine.max_kv_tokens={kv}", f"engine.max_seq_len={seq}",
                                              f"engine.max_input_len={PROMPT_BUDGET}", "verify.enabled=false",
                                              *args.override])
    out = Path(args.output or REPO / "build" / f"soak-{Path(args.config).stem}")
    run_pipeline(cfg, out, log=lambda m: print(f"[build] {m}", flush=True))
    return out


def plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every request of the run, decided up front (seeded) so a failing run can be replayed: exactly
    round(fraction x requests) malformed and cancelled requests, the rest plain, in a seeded order."""
    rng = random.Random(args.seed)
    n_bad = round(args.malformed_fraction * args.requests)
    n_cancel = min(round(args.cancel_fraction * args.requests), args.requests - n_bad)
    kinds = ["malformed"] * n_bad + ["cancel"] * n_cancel + ["plain"] * (args.requests - n_bad - n_cancel)
    rng.shuffle(kinds)
    out = []
    for i, kind in enumerate(kinds):
        prompt = rng.randrange(len(PROMPTS))
        if kind == "malformed":
            out.append({"i": i, "kind": kind, "model": rng.choice([NAMES.ensemble, NAMES.bls]), "prompt": prompt,
                        "fields": MALFORMED[rng.randrange(len(MALFORMED))]})
        elif kind == "cancel":
            out.append({"i": i, "kind": kind, "model": rng.choice([NAMES.bls, NAMES.engine]), "prompt": prompt})
        else:
            out.append({"i": i, "kind": kind, "model": rng.choice([NAMES.ensemble, NAMES.bls]), "prompt": prompt})
    return out


async def _engine_stream(client, ids: list[int], max_tokens: int, cancel_after: int | None) -> tuple[str | None, bool]:
    """One request to the engine model by token ids; returns (error, cancelled)."""
    import tritonclient.grpc as g

    def inp(name, arr, dt):
        x = g.InferInput(name, list(arr.shape), dt)
        x.set_data_from_numpy(arr)
        return x
    inputs = [inp("input_ids", np.asarray([ids], np.int32), "INT32"),
              inp("input_lengths", np.asarray([[len(ids)]], np.int32), "INT32"),
              inp("request_output_len", np.asarray([[max_tokens]], np.int32), "INT32"),
              inp("streaming", np.asarray([[True]]), "BOOL")]

    async def requests():
        yield {"model_name": NAMES.engine, "inputs": inputs}
    it = client.stream_infer(requests())
    pieces, first_error = 0, None
    async for result, error in it:
        if error is not None:
            first_error = first_error or str(error)
            continue  # final too: read to the end (harness.serving_client READ_TO_THE_END)
        final = result.get_response().parameters.get("triton_final_response")
        if final is not None and final.bool_param:
            continue  # the server ends the stream next (harness.serving_client READ_TO_THE_END)
        pieces += 1
        if cancel_after is not None and pieces >= cancel_after:
            it.cancel()
            return None, True
    return first_error, False


async def run_load(grpc_url: str, reqs: list[dict], refs: dict[int, str], prompt_ids: dict[int, list[int]],
                   args: argparse.Namespace) -> list[dict]:
    import tritonclient.grpc.aio as aio
    client = aio.InferenceServerClient(grpc_url)
    gate = asyncio.Semaphore(args.concurrency)

    async def one(r: dict) -> dict:
        async with gate:
            t0 = time.monotonic()
            out = dict(r, outcome="ok", detail="")
            try:
                if r["kind"] == "cancel" and r["model"] == NAMES.engine:
                    err, _ = await asyncio.wait_for(
                        _engine_stream(client, prompt_ids[r["prompt"]], args.max_tokens, 1), args.deadline)
                    if err is not None:
                        out.update(outcome="error", detail=err)
                    return out
                fields = r.get("fields") or {}
                res = await asyncio.wait_for(grpc_stream(
                    client, r["model"], PROMPTS[r["prompt"]], cancel_after=1 if r["kind"] == "cancel" else None,
                    **{"max_tokens": args.max_tokens, "temperature": 0.0, **fields}), args.deadline)
                if r["kind"] == "malformed":
                    if not res.error:
                        out.update(outcome="accepted_malformed", detail=json.dumps(fields))
                elif res.error:
                    out.update(outcome="error", detail=res.error)
                elif r["kind"] == "plain" and res.text != refs[r["prompt"]]:
                    out.update(outcome="mismatch", detail=f"{res.text!r} != alone {refs[r['prompt']]!r}")
            except asyncio.TimeoutError:
                out.update(outcome="hang", detail=f"no final response within {args.deadline:g} s")
            except Exception as e:  # noqa: BLE001 - a transport failure is a finding, not a soak crash
                out.update(outcome="error", detail=f"{type(e).__name__}: {e}")
            out["seconds"] = round(time.monotonic() - t0, 3)
            return out
    try:
        return list(await asyncio.gather(*(one(r) for r in reqs)))
    finally:
        await client.close()


def _metric(url: str, name: str) -> float:
    import requests
    return sum(float(line.rsplit(" ", 1)[1]) for line in requests.get(url, timeout=10).text.splitlines()
               if line.startswith(name + "{"))


def _threads(server_pid: int) -> dict[str, int]:
    """model -> threads of its stub(s) now."""
    out: dict[str, int] = {}
    for pid, model in stub_processes(server_pid).items():
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        n = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("Threads:"))
        out[model] = out.get(model, 0) + n
    return out


def wait_idle(srv: TritonServer, idle_threads: dict[str, int], timeout: float = 60.0) -> dict[str, Any]:
    """Wait until no request runs, the KV pool is empty and every stub is back to its idle thread
    count; returns what was seen last (the caller judges)."""
    deadline = time.monotonic() + timeout
    while True:
        seen = {"kv_blocks_used": _metric(srv.metrics_url, "kiln_kv_blocks_used"),
                "requests_running": _metric(srv.metrics_url, "kiln_requests_running"),
                "threads": _threads(srv.proc.pid)}
        idle = (seen["kv_blocks_used"] == 0 and seen["requests_running"] == 0
                and all(seen["threads"].get(m, 0) <= n for m, n in idle_threads.items()))
        if idle or time.monotonic() > deadline:
            seen["idle"] = idle
            return seen
        time.sleep(0.5)


def alone(srv: TritonServer, args: argparse.Namespace) -> dict[int, str]:
    """Each prompt's greedy text with nothing else running (the reference for every plain request)."""
    refs = {}
    for i, text in enumerate(PROMPTS):
        from harness.serving_client import grpc_generate
        res = grpc_generate(srv.grpc_url, NAMES.ensemble, text, max_tokens=args.max_tokens, temperature=0.0)
        if res.error:
            raise RuntimeError(f"prompt {i} alone failed: {res.error}")
        refs[i] = res.text
    return refs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from backend.serving.conversion.tokenizer import load_tokenizer
    from harness.perf.lib.results import header, write_result
    head = header("soak", "harness.perf.soak", argv)
    root = build(args)
    tok = load_tokenizer(root / "engine")
    prompt_ids = {i: tok.encode(p, chat=False) for i, p in enumerate(PROMPTS)}
    too_long = [i for i, ids in prompt_ids.items() if len(ids) > PROMPT_BUDGET]
    if too_long:
        raise SystemExit(f"error: prompts {too_long} exceed the soak's {PROMPT_BUDGET}-token budget")
    reqs = plan(args)
    load_before = [round(x, 2) for x in os.getloadavg()]  # the soak judges correctness, not speed
    t0 = time.monotonic()
    with TritonServer(root / "model_repository", exit_timeout=10) as srv:
        srv.watch()
        refs = alone(srv, args)
        idle_threads = _threads(srv.proc.pid)
        print(f"[soak] {len(reqs)} requests at concurrency {args.concurrency} "
              f"(KV pool {kv_tokens(args.concurrency, args.max_tokens, args.kv_fraction)} tokens) ...", flush=True)
        results = asyncio.run(run_load(srv.grpc_url, reqs, refs, prompt_ids, args))
        after = wait_idle(srv, idle_threads)
        failure = srv.failure()
        again = alone(srv, args) if failure is None else {}
        preemptions = _metric(srv.metrics_url, "kiln_preemptions_total") if failure is None else None
        code = srv.stop()
    counts: dict[str, int] = {}
    for r in results:
        counts[f"{r['kind']}:{r['outcome']}"] = counts.get(f"{r['kind']}:{r['outcome']}", 0) + 1
    bad = [r for r in results if r["outcome"] != "ok"]
    checks = {
        "no_crash": failure is None,
        "no_hang": not any(r["outcome"] == "hang" for r in results),
        "no_mismatch": not any(r["outcome"] == "mismatch" for r in results),
        "no_unexpected_error": not any(r["outcome"] in ("error", "accepted_malformed") for r in results),
        "idle_after": bool(after["idle"]),
        "same_text_after": again == refs,
        "clean_shutdown": code == 0,
    }
    doc = {**head, "load_average_before": load_before,
           "config": args.config,
           "requests": args.requests, "concurrency": args.concurrency, "cancel_fraction": args.cancel_fraction,
           "malformed_fraction": args.malformed_fraction, "max_tokens": args.max_tokens,
           "kv_pool_tokens": kv_tokens(args.concurrency, args.max_tokens, args.kv_fraction),
           "kv_demand_tokens": args.concurrency * (PROMPT_BUDGET + args.max_tokens),
           "wall_s": round(time.monotonic() - t0, 1), "outcomes": dict(sorted(counts.items())),
           "preemptions": preemptions, "idle_threads": idle_threads, "after": after,
           "server_failure": failure, "server_exit_code": code, "checks": checks,
           "passed": all(checks.values()), "failures": bad[:20]}
    print(json.dumps({k: doc[k] for k in ("outcomes", "checks", "passed", "wall_s")}, indent=2))
    write_result(doc, args.out, "soak.json")
    return 0 if doc["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
