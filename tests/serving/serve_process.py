"""`python -m harness.serve` (what `make serve` runs) started for a test, read up to its ready line."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

READY = "Ctrl-C stops the server"   # harness.serve prints it once the server answers


def start_serve(repo: Path, ports: list[int], timeout: float = 300.0, extra: tuple[str, ...] = (),
                env: dict[str, str] | None = None) -> tuple[subprocess.Popen, list[str]]:
    """Start it on ``ports`` (http, grpc, metrics[, openai]), with ``extra`` arguments and ``env`` (default:
    this process's) -> (process, lines printed up to READY or its exit). The caller checks the lines
    and stops the process; a failure while reading kills it."""
    names = ("--http-port", "--grpc-port", "--metrics-port", "--openai-port")
    args = [a for name, port in zip(names, ports) for a in (name, str(port))]
    proc = subprocess.Popen([sys.executable, "-m", "harness.serve", "--model-repository", str(repo), *args, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if READY in line:
                break
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, lines


def server_pid(lines: list[str]) -> int | None:
    """The Triton server's pid, from the first "pid N" harness.serve printed."""
    for line in lines:
        m = re.search(r"pid\s+(\d+)", line)
        if m:
            return int(m.group(1))
    return None


# ---- processes, read from /proc (what a test asserts about a server's or engine's processes) ------

def _stat(pid: int | str) -> list[str] | None:
    """/proc/<pid>/stat fields after the command name (state, ppid, pgrp, ...); None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _living(match) -> list[int]:
    """Pids (zombies excluded: they have exited) whose stat fields satisfy ``match``."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        fields = _stat(pid)
        if fields is not None and fields[0] != "Z" and match(fields):
            out.append(int(pid))
    return out


def group_members(pgid: int) -> list[int]:
    return _living(lambda f: int(f[2]) == pgid)


def children(pid: int) -> list[int]:
    return _living(lambda f: int(f[1]) == pid)


def alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def stop_serve(proc: subprocess.Popen, pid: int | None) -> None:
    """A test's cleanup: the harness.serve process, then whatever is left of the server's group."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    if pid is not None:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class LongStreams:
    """``n`` long greedy ensemble streams on ``grpc_port``, run in a thread; ``started()`` waits until
    each has streamed a piece. ``results``: each stream's StreamResult, or the exception that ended
    its RPC (the server going away fails it with UNAVAILABLE)."""

    def __init__(self, grpc_port: int, n: int = 3, model: str = "ensemble", tokens: int = 900) -> None:
        import asyncio
        import threading
        self.n, self.seen, self.results = n, set(), []

        async def streams():
            import tritonclient.grpc.aio as grpcclient

            from harness.serving_client import grpc_stream
            client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
            # forced tokens (the serving build's max_seq_len is 1024): minutes on this CPU
            self.results.extend(await asyncio.gather(*[
                grpc_stream(client, model, f"Count to a thousand, {i}:", on_piece=lambda _s, i=i: self.seen.add(i),
                            max_tokens=tokens, min_tokens=tokens, temperature=0.0) for i in range(n)],
                return_exceptions=True))
            await client.close()

        self.thread = threading.Thread(target=lambda: asyncio.run(streams()), daemon=True)
        self.thread.start()

    def started(self, timeout: float = 120.0) -> bool:
        deadline = time.monotonic() + timeout
        while len(self.seen) < self.n and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        return len(self.seen) == self.n

    def all_failed(self, timeout: float = 60.0) -> bool:
        """Every stream ended (none hangs) and each with an error: a final error response, or its RPC's
        failure."""
        self.thread.join(timeout)
        return (not self.thread.is_alive() and len(self.results) == self.n
                and all(isinstance(r, Exception) or r.error for r in self.results))
