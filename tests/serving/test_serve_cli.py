"""`python -m harness.serve` (what `make serve` runs): ready, prints examples, Ctrl-C leaves nothing behind."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from harness.serving_client import http_generate
from harness.serving_server import free_port

pytestmark = [pytest.mark.slow, pytest.mark.server]


def _group_members(pgid: int) -> list[int]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            out.append(int(pid))
    return out


@pytest.mark.parametrize("sig", [signal.SIGINT])
def test_serve_starts_answers_and_stops_cleanly(serving_build, sig):
    ports = [free_port() for _ in range(3)]
    assert len(set(ports)) == 3
    proc = subprocess.Popen([sys.executable, "-m", "harness.serve", "--model-repository",
                             str(serving_build / "model_repository"), "--http-port", str(ports[0]),
                             "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2])],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, pid = [], None
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"pid\s+(\d+)", line)
            if m:
                pid = int(m.group(1))
            if "Ctrl-C stops the server" in line:
                break
        out = "".join(lines)
        assert pid is not None, out
        assert f"127.0.0.1:{ports[0]}" in out and "harness.client" in out and "generate_stream" in out
        body = http_generate(f"127.0.0.1:{ports[0]}", "ensemble", "The capital of France is", max_tokens=4,
                             temperature=0.0, exclude_input_in_output=True)
        assert body["text_output"].strip()
        assert len(_group_members(pid)) >= 5  # the server and its four Python stubs
        shm = [f for f in os.listdir("/dev/shm") if f.startswith(f"kiln_{proc.pid}_")]
        assert shm  # the per-server prefix is in use, so the cleanup check below is meaningful
        proc.send_signal(sig)
        rest, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, "".join(lines) + rest
        assert "stopped" in rest
        assert _group_members(pid) == []
        assert [f for f in os.listdir("/dev/shm") if f.startswith(f"kiln_{proc.pid}_")] == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if pid is not None:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
