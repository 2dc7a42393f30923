"""CPU time of the processes a serving run involves, by kind, from /proc: the Triton server, each
model's Python backend stubs (the engine's, the tokenizer models'), and this process (the benchmark's
client). On a 2-core machine they all share the cores the engine computes on, so how much each takes
during a level says what the serving path costs beside the engine (harness/perf/serving/sweep.py adds it
to every row it can: ``cpu_cores``, CPU-seconds per wall second).

    before = snapshot(server_pid)
    ...                                  # the level
    cores = cores_used(before, snapshot(server_pid), wall_s)   # {"tritonserver": 0.1, ...}
"""
from __future__ import annotations

import os

from harness.serving_server import proc_stat, stub_processes

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
