"""Serving benchmark statistics: percentiles, throughput, goodput; CSV rows and the plot; the CPU
each process of the serving path took (read from /proc)."""
from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from harness.serving_server import proc_stat, stub_processes

__all__ = ["summarize", "write_csv", "plot", "snapshot", "cores_used", "cpu_seconds", "SERVER", "CLIENT"]

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
