"""Triton's own endpoints with an API key, on the real tritonserver.

A one-model repository (a Python-backend echo: up in ~2 s) shows what Triton's restricted-API
options do, bound to 0.0.0.0 with a key and to loopback with one; ``harness.serve`` on the real
SmolLM2 repository shows the whole stack (Kiln's clients, the OpenAI front door's engine calls) with
a restricted Triton and that the key appears in nothing it prints or logs."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest
import requests

from harness import client as kiln_client
from harness.model_names import DEFAULT as NAMES
from harness.serving_client import GenerateError, http_generate
from harness.serving_server import TritonServer, free_port
from harness.triton_auth import GRPC_HEADER, grpc_headers, http_headers
from tests.serving.openai_stack import MODEL, SHORT
from tests.serving.serve_process import server_pid, start_serve, stop_serve

pytestmark = [pytest.mark.slow, pytest.mark.server]

KEY = "kiln-triton-key-3b9d27"        # the first key: the one Triton holds
OTHER = "kiln-triton-key-two-90ac41"  # a second key: opens the OpenAI API only
WRONG = "kiln-triton-wrong-7d0c11"

ECHO_CONFIG = """name: "echo"
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""
ECHO_MODEL = """import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(
            r, "IN").as_numpy())]) for r in requests]
"""
INFER = {"inputs": [{"name": "IN", "shape": [2], "datatype": "INT32", "data": [4, 2]}]}


@pytest.fixture(scope="module")
def echo_repo(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("echo") / "model_repository"
    (repo / "echo" / "1").mkdir(parents=True)
    (repo / "echo" / "config.pbtxt").write_text(ECHO_CONFIG)
    (repo / "echo" / "1" / "model.py").write_text(ECHO_MODEL)
    return repo


@pytest.fixture(scope="module")
def keyed(echo_repo, tmp_path_factory):
    log = tmp_path_factory.mktemp("keyed-log") / "tritonserver.log"
    with TritonServer(echo_repo, host="0.0.0.0", api_key=KEY, log_file=log, exit_timeout=3) as srv:
        yield srv


def _grpc_infer(url: str, headers: dict | None):
    import tritonclient.grpc as tg
    inp = tg.InferInput("IN", [2], "INT32")
    inp.set_data_from_numpy(np.array([4, 2], np.int32))
    c = tg.InferenceServerClient(url)
    try:
        return c.infer("echo", [inp], headers=headers).as_numpy("OUT").tolist()
    finally:
        c.close()


def test_inference_needs_the_key_over_http_and_grpc(keyed):
    url = f"http://{keyed.http_url}/v2/models/echo/infer"
    for headers in ({}, {"Authorization": f"Bearer {WRONG}"}, {"Authorization": KEY}):
        r = requests.post(url, json=INFER, headers=headers, timeout=30)
        assert r.status_code == 403 and "This API is restricted" in r.json()["error"], r.text
    r = requests.post(url, json=INFER, headers=keyed.http_headers, timeout=30)
    assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [4, 2], r.text
    # the header's name is matched whatever its case
    assert requests.post(url, json=INFER, headers={"AUTHORIZATION": f"Bearer {KEY}"}, timeout=30).status_code == 200

    from tritonclient.utils import InferenceServerException
    for headers in (None, {GRPC_HEADER: f"Bearer {WRONG}"}, {"authorization": f"Bearer {KEY}"}):
        with pytest.raises(InferenceServerException) as e:
            _grpc_infer(keyed.grpc_url, headers)
        assert "This protocol is restricted" in str(e.value) and GRPC_HEADER in str(e.value), str(e.value)
    assert _grpc_infer(keyed.grpc_url, keyed.grpc_headers) == [4, 2]


def test_health_stays_open_and_model_control_and_metadata_need_the_key(keyed):
    import tritonclient.grpc as tg
    from tritonclient.utils import InferenceServerException
    base = f"http://{keyed.http_url}"
    for path in ("/v2/health/ready", "/v2/health/live", "/v2/models/echo/ready"):
        assert requests.get(base + path, timeout=10).status_code == 200, path
    for method, path in (("POST", "/v2/repository/index"), ("POST", "/v2/repository/models/echo/unload"),
                         ("GET", "/v2/models/echo"), ("GET", "/v2/models/echo/config"), ("GET", "/v2/models/stats"),
                         ("GET", "/v2/logging"), ("GET", "/v2/trace/setting")):
        r = requests.request(method, base + path, timeout=10)
        assert r.status_code == 403 and "restricted" in r.text, (path, r.status_code, r.text)
    r = requests.post(base + "/v2/repository/index", headers=http_headers(KEY), timeout=10)
    assert r.status_code == 200 and r.json()[0]["name"] == "echo", r.text
    c = tg.InferenceServerClient(keyed.grpc_url)
    try:
        assert c.is_server_ready() and c.is_model_ready("echo")
        with pytest.raises(InferenceServerException, match="restricted"):
            c.get_model_repository_index()
        with pytest.raises(InferenceServerException, match="restricted"):
            c.unload_model("echo")
        assert [m.name for m in c.get_model_repository_index(headers=grpc_headers(KEY)).models] == ["echo"]
    finally:
        c.close()
    # Triton has no option to restrict metrics: they stay open (documented)
    assert requests.get(keyed.metrics_url, timeout=10).status_code == 200
    assert KEY not in keyed.log_file.read_text(errors="replace")


def test_on_loopback_a_key_changes_nothing_and_harness_serve_never_prints_it(echo_repo, tmp_path):
    ports = [free_port() for _ in range(3)]
    env = dict(os.environ, KILN_API_KEY=KEY)
    proc, lines = start_serve(echo_repo, ports, extra=("--log-file", str(tmp_path / "t.log")), env=env)
    pid = server_pid(lines)
    try:
        assert pid is not None, "".join(lines)
        assert "this machine only" in "".join(lines)
        r = requests.post(f"http://127.0.0.1:{ports[0]}/v2/models/echo/infer", json=INFER, timeout=30)
        assert r.status_code == 200, r.text   # as before keys existed: local clients send nothing
        assert _grpc_infer(f"127.0.0.1:{ports[1]}", None) == [4, 2]
        assert KEY not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
        out = "".join(lines) + rest
        assert KEY not in out and "warning" not in out, out
    finally:
        stop_serve(proc, pid)


def test_beyond_loopback_without_a_key_harness_serve_warns(echo_repo):
    ports = [free_port() for _ in range(3)]
    env = {k: v for k, v in os.environ.items() if k != "KILN_API_KEY"}
    proc, lines = start_serve(echo_repo, ports, extra=("--triton-host", "0.0.0.0"), env=env)
    pid = server_pid(lines)
    try:
        out = "".join(lines)
        assert pid is not None, out
        assert "warning: Triton's HTTP, gRPC and metrics endpoints listen on 0.0.0.0 with no API key" in out
        assert "open to anyone who reaches it" in out
        proc.send_signal(signal.SIGINT)   # a clean stop: a killed server leaves its shared memory behind
        proc.communicate(timeout=120)
    finally:
        stop_serve(proc, pid)


def test_the_whole_stack_with_a_restricted_triton(serving_build, tmp_path, monkeypatch, capsys):
    """harness.serve --triton-host 0.0.0.0 with two keys: Kiln's clients need the first key, the OpenAI
    front door sends it to Triton itself (so any key opens /v1), and no key is printed or logged."""
    (tmp_path / "keys").write_text(f"{KEY}\n")
    ports = [free_port() for _ in range(4)]
    log = tmp_path / "triton.log"
    env = dict(os.environ, KILN_API_KEY=OTHER)
    proc, lines = start_serve(serving_build / "model_repository", ports, env=env, extra=(
        "--triton-host", "0.0.0.0", "--api-key-file", str(tmp_path / "keys"), "--log-file", str(log)))
    pid = server_pid(lines)
    try:
        out = "".join(lines)
        assert pid is not None, out
        assert "every protocol but health needs the first API key" in out and "warning" not in out, out
        http, grpc = f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"
        with pytest.raises(GenerateError, match="restricted"):
            http_generate(http, NAMES.ensemble, SHORT, max_tokens=2)
        body = http_generate(http, NAMES.ensemble, SHORT, max_tokens=2, temperature=0.0, headers=http_headers(KEY))
        assert body["text_output"]

        monkeypatch.delenv("KILN_API_KEY", raising=False)
        assert kiln_client.main(["--url", grpc, "--max-tokens", "2", SHORT]) == 2
        assert "restricted" in capsys.readouterr().err
        monkeypatch.setenv("KILN_API_KEY", KEY)
        assert kiln_client.main(["--url", grpc, "--max-tokens", "2", "--json", SHORT]) == 0
        assert kiln_client.main(["--url", http, "--protocol", "http", "--model", NAMES.bls, "--max-tokens", "2",
                                 SHORT]) == 0
        captured = capsys.readouterr()
        assert '"text"' in captured.out, captured

        assert requests.get(f"http://{http}/v2/health/ready", timeout=10).status_code == 200
        chat = f"http://127.0.0.1:{ports[3]}/v1/chat/completions"
        req = {"model": MODEL, "messages": [{"role": "user", "content": SHORT}], "max_tokens": 2, "temperature": 0}
        for key in (KEY, OTHER):   # the front door's engine calls carry Triton's key, whichever key opened /v1
            r = requests.post(chat, json=req, headers={"Authorization": f"Bearer {key}"}, timeout=120)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
        assert requests.post(chat, json=req, timeout=30).status_code == 401
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out + rest
        logs = log.read_text(errors="replace") + log.with_name("triton-openai.log").read_text(errors="replace")
        for key in (KEY, OTHER):
            assert key not in out + rest and key not in logs
    finally:
        stop_serve(proc, pid)
