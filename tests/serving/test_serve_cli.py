"""`python -m harness.serve` (what `make serve` runs): ready, prints examples, Ctrl-C leaves nothing behind."""
from __future__ import annotations

import os
import signal

import pytest

from harness.serving_client import http_generate
from harness.model_names import DEFAULT as NAMES
from harness.serving_server import free_port, stub_processes
from tests.serving.serve_process import LongStreams, group_members, server_pid, start_serve, stop_serve

pytestmark = [pytest.mark.slow, pytest.mark.server]


@pytest.mark.parametrize("sig", [signal.SIGINT])
def test_serve_starts_answers_and_stops_cleanly(serving_build, sig):
    ports = [free_port() for _ in range(3)]
    assert len(set(ports)) == 3
    proc, lines = start_serve(serving_build / "model_repository", ports)
    pid = server_pid(lines)
    try:
        out = "".join(lines)
        assert pid is not None, out
        assert f"127.0.0.1:{ports[0]}" in out and "harness.client" in out and "generate_stream" in out
        body = http_generate(f"127.0.0.1:{ports[0]}", NAMES.ensemble, "The capital of France is", max_tokens=4,
                             temperature=0.0, exclude_input_in_output=True)
        assert body["text_output"].strip()
        assert len(group_members(pid)) >= 5  # the server and its four Python stubs
        shm = [f for f in os.listdir("/dev/shm") if f.startswith(f"kiln_{proc.pid}_")]
        assert shm  # the per-server prefix is in use, so the cleanup check below is meaningful
        proc.send_signal(sig)
        rest, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, "".join(lines) + rest
        assert "stopped" in rest
        assert group_members(pid) == []
        assert [f for f in os.listdir("/dev/shm") if f.startswith(f"kiln_{proc.pid}_")] == []
    finally:
        stop_serve(proc, pid)


def _start_serve(serving_build, repo=None):
    ports = [free_port() for _ in range(3)]
    proc, lines = start_serve(repo or serving_build / "model_repository", ports)
    pid = server_pid(lines)
    assert pid is not None, "".join(lines)
    return proc, pid, ports


def test_a_dead_engine_stub_ends_streams_and_stops_the_server(serving_build):
    """kill -9 of the engine's stub: Triton alone keeps answering ready while the streams hang
    forever. harness.serve notices, stops the server with exit code 3 (documented), so every
    in-flight stream ends with an error and readiness stops answering."""
    import urllib.request
    proc, pid, ports = _start_serve(serving_build)
    try:
        streams = LongStreams(ports[1], model=NAMES.ensemble)
        assert streams.started(), f"streams did not start: {streams.results}"
        engine = [p for p, model in stub_processes(pid).items() if model == NAMES.engine]
        assert len(engine) == 1
        os.kill(engine[0], signal.SIGKILL)
        rest, _ = proc.communicate(timeout=120)
        assert proc.returncode == 3, rest
        assert f"stub of model {NAMES.engine}" in rest and "died" in rest
        assert streams.all_failed(), f"a stream hangs or ended without an error: {streams.results}"
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{ports[0]}/v2/health/ready", timeout=5)
    finally:
        stop_serve(proc, pid)


def test_a_hung_step_ends_requests_with_an_error_and_stops_the_server(serving_build, tmp_path):
    """The step watchdog: a step running past serving.step_timeout_s ends the in-flight request with a
    final error response from the engine model itself, then its stub exits and harness.serve stops
    with exit code 3. The limit is 1 ms, far below any decode step of a 30-layer model on a CPU (a
    SmolLM2 step takes several ms on the fastest of these machines), so the watchdog's polls find a
    step past it whatever the machine's speed: 20 ms, the limit before, was within reach of a fast,
    idle machine's steps, and the request then ran to its end unflagged."""
    import shutil

    from harness.serving_client import grpc_generate
    repo = tmp_path / "model_repository"
    shutil.copytree(serving_build / "model_repository", repo)
    (tmp_path / "engine").symlink_to(serving_build / "engine")  # models name it as ../engine
    pbtxt = repo / NAMES.engine / "config.pbtxt"
    text = pbtxt.read_text()
    assert 'key: "step_timeout_s" value: { string_value: "300' in text  # the default is rendered
    hung = text.replace('key: "step_timeout_s" value: { string_value: "300.0" }',
                        'key: "step_timeout_s" value: { string_value: "0.001" }')
    assert hung != text
    pbtxt.write_text(hung)
    proc, pid, ports = _start_serve(serving_build, repo)
    try:
        res = grpc_generate(f"127.0.0.1:{ports[1]}", NAMES.ensemble,
                            "Count to a thousand:", max_tokens=900, min_tokens=900, temperature=0.0)
        assert res.error and "engine failure" in res.error and "more than 0.001 s" in res.error, res.error
        rest, _ = proc.communicate(timeout=120)
        assert proc.returncode == 3, rest
        # the stub's exit is seen as its death, or (when Triton 24.10 aborts as the stub goes away
        # mid-IPC) as the server's own exit: either way the server is stopped with code 3
        assert f"stub of model {NAMES.engine}" in rest or "tritonserver exited with code" in rest, rest
    finally:
        stop_serve(proc, pid)
