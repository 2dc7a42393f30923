"""`python -m harness.serve` (what `make serve` runs) started for a test, read up to its ready line."""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

READY = "Ctrl-C stops the server"   # harness.serve prints it once the server answers


def start_serve(repo: Path, ports: list[int], timeout: float = 300.0) -> tuple[subprocess.Popen, list[str]]:
    """Start it on ``ports`` (http, grpc, metrics[, openai]) -> (process, lines printed up to READY or
    its exit). The caller checks the lines and stops the process; a failure while reading kills it."""
    names = ("--http-port", "--grpc-port", "--metrics-port", "--openai-port")
    args = [a for name, port in zip(names, ports) for a in (name, str(port))]
    proc = subprocess.Popen([sys.executable, "-m", "harness.serve", "--model-repository", str(repo), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
