"""Triton's address and API key without a server: the tritonserver command line ``TritonServer`` builds
for each case, ``harness.serve``'s two addresses, the clients' key sources, and the front door's key for
Triton travelling in its environment."""
from __future__ import annotations

from pathlib import Path

import pytest

from harness import client as kiln_client
from harness.openai.process import OpenAIServer
from harness.serve import parse_args as serve_args
from harness.serving_server import TritonBinary, TritonServer
from harness.triton_auth import (GRPC_HEADER, RESTRICTED_APIS, TRITON_KEY_ENV, client_key, connect_host,
                                 grpc_headers, http_headers, is_loopback, mask)

KEY = "kiln-unit-key-5e1f"
APIS = "metadata,inference,shared-memory,model-config,model-repository,statistics,trace,logging"


def _server(tmp_path: Path, host: str, key: str | None) -> TritonServer:
    srv = TritonServer(tmp_path, http_port=18000, grpc_port=18001, metrics_port=18002, host=host, api_key=key)
    srv.binary = TritonBinary(Path("/opt/tritonserver/bin/tritonserver"), None, "PATH")
    return srv


def _restrictions(cmd: list[str]) -> list[str]:
    return [a for a in cmd if "restricted" in a]


def test_beyond_loopback_with_a_key_every_protocol_but_health_needs_it(tmp_path):
    srv = _server(tmp_path, "0.0.0.0", KEY)
    cmd = srv.command()
    assert {f"--{n}-address=0.0.0.0" for n in ("http", "grpc", "metrics")} <= set(cmd)
    assert _restrictions(cmd) == [f"--http-restricted-api={APIS}:authorization=Bearer {KEY}",
                                  f"--grpc-restricted-protocol={APIS}:authorization=Bearer {KEY}"]
    assert "health" not in RESTRICTED_APIS and srv.restricted
    assert srv.http_headers == {"Authorization": f"Bearer {KEY}"}
    assert srv.grpc_headers == {"triton-grpc-protocol-authorization": f"Bearer {KEY}"} == {GRPC_HEADER: f"Bearer {KEY}"}
    # clients on this machine reach a wildcard bind on loopback
    assert srv.http_url == "127.0.0.1:18000" and srv.grpc_url == "127.0.0.1:18001"
    assert srv.metrics_url == "http://127.0.0.1:18002/metrics"
    shown = srv.shown_command()
    assert KEY not in " ".join(shown) and KEY in " ".join(cmd)
    assert len(shown) == len(cmd) and "--http-restricted-api=" + APIS + ":authorization=Bearer ***" in shown


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "127.0.0.2", "::1", "ipv6:[::1]"])
def test_on_loopback_a_key_restricts_nothing(tmp_path, host):
    srv = _server(tmp_path, host, KEY)
    assert is_loopback(host) and not srv.restricted
    assert _restrictions(srv.command()) == [] and srv.http_headers == {} and srv.grpc_headers == {}
    assert KEY not in " ".join(srv.command())


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "gpu-node-7", "::"])
def test_beyond_loopback_without_a_key_nothing_is_restricted(tmp_path, host):
    srv = _server(tmp_path, host, None)
    assert not is_loopback(host) and not srv.restricted and _restrictions(srv.command()) == []
    assert connect_host(host) == ("127.0.0.1" if host == "0.0.0.0" else host)


def test_serve_binds_the_front_door_and_triton_separately(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("KILN_API_KEY", raising=False)
    a = serve_args(["--model-repository", str(tmp_path)])
    assert (a.host, a.triton_host, a.api_keys) == ("127.0.0.1", "127.0.0.1", ())
    a = serve_args(["--model-repository", str(tmp_path), "--host", "0.0.0.0"])
    assert (a.host, a.triton_host) == ("0.0.0.0", "127.0.0.1")   # Triton stays on loopback unless asked
    (tmp_path / "keys").write_text("first-key\nsecond-key\n")
    monkeypatch.setenv("KILN_API_KEY", "env-key")
    a = serve_args(["--model-repository", str(tmp_path), "--triton-host", "0.0.0.0",
                    "--api-key-file", str(tmp_path / "keys")])
    assert a.triton_host == "0.0.0.0" and a.api_keys == ("first-key", "second-key", "env-key")
    with pytest.raises(SystemExit):
        serve_args(["--help"])
    usage = capsys.readouterr().out
    assert "--triton-host" in usage and "OpenAI front door's address" in usage and "first key" in usage


def test_clients_send_the_first_key_from_flag_file_or_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("KILN_API_KEY", raising=False)
    assert kiln_client.parse_args(["hi"]).key is None
    monkeypatch.setenv("KILN_API_KEY", "env-one,env-two")
    assert kiln_client.parse_args(["hi"]).key == "env-one"
    (tmp_path / "k").write_text("# ours\nfile-key\n")
    assert kiln_client.parse_args(["--api-key-file", str(tmp_path / "k"), "hi"]).key == "file-key"
    assert kiln_client.parse_args(["--api-key", "flag-key", "hi"]).key == "flag-key"
    assert client_key(env={}) is None
    assert http_headers(None) == {} == grpc_headers(None)
    assert mask(["--x=Bearer abc", "abc", "y"], ["abc", None]) == ["--x=Bearer ***", "***", "y"]


def test_the_front_door_gets_tritons_key_in_its_environment_not_its_command_line(tmp_path, monkeypatch):
    monkeypatch.setenv(TRITON_KEY_ENV, "stale-from-the-caller")
    srv = OpenAIServer(tmp_path, "127.0.0.1:1", None, api_keys=("a-key",), triton_api_key=KEY)
    assert KEY not in " ".join(srv.command())
    assert srv.env()[TRITON_KEY_ENV] == KEY and srv.env()["KILN_API_KEY"] == "a-key"
    assert TRITON_KEY_ENV not in OpenAIServer(tmp_path, "127.0.0.1:1", None).env()   # never inherited
