"""The ports in an engine config are the ports `make serve` / `python -m harness.serve --config` listen
on, and the clients' defaults follow the same config."""
from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from harness import client as kiln_client
from harness.model_names import DEFAULT as NAMES
from harness.openai.__main__ import parse_args as openai_args
from harness.serve import parse_args as serve_args
from harness.serve_ports import DEFAULT, config_ports
from harness.serving_client import http_generate
from harness.serving_server import free_port
from tests.serving.serve_process import READY, server_pid, stop_serve

ROOT = Path(__file__).resolve().parents[2]
BASE_CONFIG = ROOT / "configs" / "smollm2-135m-bf16.yaml"


def _config_with_ports(tmp_path: Path, http: int, grpc: int, metrics: int) -> Path:
    data = yaml.safe_load(BASE_CONFIG.read_text())
    data["serving"].update(http_port=http, grpc_port=grpc, metrics_port=metrics)
    path = tmp_path / "ports.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_the_config_ports_are_the_defaults_of_serve_and_clients(tmp_path):
    cfg = _config_with_ports(tmp_path, 18080, 18081, 18082)
    (tmp_path / "repo").mkdir()
    a = serve_args(["--config", str(cfg), "--model-repository", str(tmp_path / "repo")])
    assert (a.http_port, a.grpc_port, a.metrics_port) == (18080, 18081, 18082)
    a = serve_args(["--config", str(cfg), "--model-repository", str(tmp_path / "repo"), "--http-port", "18090"])
    assert a.http_port == 18090 and a.grpc_port == 18081   # a flag beats the config
    a = serve_args(["--config", str(cfg), "--override", "serving.grpc_port=18091",
                    "--model-repository", str(tmp_path / "repo")])
    assert a.grpc_port == 18091                            # and so does an override, as in make build
    a = serve_args(["--model-repository", str(tmp_path / "repo")])
    assert (a.http_port, a.grpc_port, a.metrics_port) == (DEFAULT.http, DEFAULT.grpc, DEFAULT.metrics) \
        == (8000, 8001, 8002)
    assert kiln_client.parse_args(["--config", str(cfg), "hi"]).url == "127.0.0.1:18081"
    assert kiln_client.parse_args(["--config", str(cfg), "--protocol", "http", "hi"]).url == "127.0.0.1:18080"
    o = openai_args(["--config", str(cfg), "--model-repository", str(tmp_path / "repo")])
    assert o.triton_url == "127.0.0.1:18081" and o.metrics_url == "http://127.0.0.1:18082/metrics"
    assert config_ports(cfg).metrics == 18082


def test_a_bad_port_in_the_config_is_refused_naming_the_key(tmp_path, capsys):
    cfg = _config_with_ports(tmp_path, 8000, 8000, 8002)
    with pytest.raises(SystemExit):
        serve_args(["--config", str(cfg), "--model-repository", str(tmp_path)])
    err = capsys.readouterr().err
    assert "serving" in err and "ports must differ" in err, err
    with pytest.raises(SystemExit):
        serve_args(["--override", "serving.http_port=9", "--model-repository", str(tmp_path)])
    assert "pass --config" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.server
def test_serve_listens_on_the_ports_of_its_config(serving_build, tmp_path):
    http, grpc, metrics = (free_port() for _ in range(3))
    cfg = _config_with_ports(tmp_path, http, grpc, metrics)
    proc = subprocess.Popen([sys.executable, "-m", "harness.serve", "--config", str(cfg),
                             "--model-repository", str(serving_build / "model_repository")],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    pid = None
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if READY in line:
                break
        out = "".join(lines)
        pid = server_pid(lines)
        assert pid is not None and READY in out, out
        assert f"127.0.0.1:{http}" in out and f"127.0.0.1:{grpc}" in out
        body = http_generate(f"127.0.0.1:{http}", NAMES.ensemble, "The capital of France is", max_tokens=4,
                             temperature=0.0, exclude_input_in_output=True)
        assert body["text_output"].strip()
        import tritonclient.grpc as tg
        g = tg.InferenceServerClient(f"127.0.0.1:{grpc}")
        try:
            assert g.is_model_ready(NAMES.engine)
        finally:
            g.close()
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10).read().decode()
        assert "nv_inference_request_success" in text
        # the client finds the server from the same config, with no --url
        res = subprocess.run([sys.executable, "-m", "harness.client", "--config", str(cfg), "--json",
                              "--max-tokens", "4", "Hi"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["text"].strip()
    finally:
        stop_serve(proc, pid)
