"""API keys and request limits of the OpenAI front door, on the real stack with the official client.

A second front door (``harness.openai.process.OpenAIServer``, what ``make serve`` starts) runs with
keys and a max_tokens cap in front of the stack's Triton server; the stack's own front door has no
key and the default body limit."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import requests

from harness.openai.auth import load_keys
from harness.openai.limits import DEFAULT_MAX_BODY_BYTES
from harness.openai.process import OpenAIServer
from harness.serving_server import free_port
from tests.serving.openai_stack import MODEL, SHORT

pytestmark = [pytest.mark.slow, pytest.mark.server]

ENV_KEYS = ("kiln-test-key-one-7f3a9c", "kiln-test-key-two-51be02")
FILE_KEY = "kiln-test-key-file-c0ffee"
WRONG = "kiln-test-wrong-key-d15ea5e"
CAP = 24


@pytest.fixture(scope="module")
def keyed(stack, serving_build, tmp_path_factory):
    d = tmp_path_factory.mktemp("keyed")
    (d / "keys").write_text(f"# the file's key\n{FILE_KEY}\n")
    srv = OpenAIServer(serving_build / "model_repository", stack.grpc_url,
                       f"http://127.0.0.1:{stack.metrics}/metrics", port=free_port(), log_file=d / "openai.log",
                       api_keys=ENV_KEYS, extra_args=("--api-key-file", str(d / "keys"),
                                                      "--max-tokens-cap", str(CAP), "--log-level", "debug"))
    with srv:
        yield srv


def _client(srv: OpenAIServer, key: str):
    import openai
    return openai.OpenAI(base_url=srv.base_url, api_key=key, max_retries=0, timeout=120)


ROUTES = [("GET", "models", None), ("GET", f"models/{MODEL}", None), ("GET", "no-such-route", None),
          ("POST", "chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": SHORT}], "max_tokens": 2}),
          ("POST", "completions", {"model": MODEL, "prompt": SHORT, "max_tokens": 2}),
          ("POST", "responses", {"model": MODEL, "input": SHORT, "max_output_tokens": 2})]


@pytest.mark.parametrize("headers", [{}, {"Authorization": f"Bearer {WRONG}"}, {"Authorization": ENV_KEYS[0]},
                                     {"Authorization": "Bearer "}], ids=["missing", "wrong", "no-scheme", "empty"])
def test_every_v1_route_refuses_a_missing_or_wrong_key_with_openais_401(keyed, headers):
    for method, route, body in ROUTES:
        r = requests.request(method, f"{keyed.base_url}/{route}", json=body, headers=headers, timeout=30)
        assert r.status_code == 401, (route, r.status_code, r.text)
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error", err
        assert WRONG not in r.text


def test_each_key_is_served_the_wrong_one_is_an_authentication_error_and_probes_stay_open(keyed):
    import openai
    with pytest.raises(openai.AuthenticationError):
        _client(keyed, WRONG).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": SHORT}],
                                                     max_tokens=2)
    for key in (*ENV_KEYS, FILE_KEY):  # from the environment (two) and from the key file
        r = _client(keyed, key).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": SHORT}],
                                                       max_tokens=2, temperature=0)
        assert r.usage.completion_tokens == 2
    assert [m.id for m in _client(keyed, FILE_KEY).models.list()] == [MODEL]
    r = _client(keyed, ENV_KEYS[0]).responses.create(model=MODEL, input=SHORT, max_output_tokens=2, temperature=0)
    assert r.usage.output_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        _client(keyed, WRONG).responses.create(model=MODEL, input=SHORT, max_output_tokens=2)
    root = keyed.base_url.removesuffix("/v1")
    assert requests.get(f"{root}/health", timeout=10).status_code == 200
    assert requests.get(f"{root}/metrics", timeout=10).status_code == 200


def test_no_key_is_in_the_log_or_on_the_command_line(keyed):
    # requests with every key and a wrong one have been made (this module's tests, and here)
    requests.get(f"{keyed.base_url}/models", headers={"Authorization": f"Bearer {WRONG}"}, timeout=10)
    requests.get(f"{keyed.base_url}/models", headers={"Authorization": f"Bearer {FILE_KEY}"}, timeout=10)
    time.sleep(0.5)
    log = Path(keyed.log_file).read_text(errors="replace")
    assert "GET /v1/models" in log and "401" in log, log[-2000:]  # the log is the real one, at debug level
    cmdline = Path(f"/proc/{keyed.proc.pid}/cmdline").read_bytes().decode(errors="replace")
    for key in (*ENV_KEYS, FILE_KEY, WRONG):
        assert key not in log
        assert key not in cmdline


def test_the_max_tokens_cap_refuses_more_and_is_the_default(keyed):
    import openai
    c = _client(keyed, ENV_KEYS[1])
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me about Paris"}],
                                  max_tokens=CAP + 1)
    assert e.value.body["param"] == "max_tokens" and str(CAP) in e.value.body["message"]
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me about Paris"}],
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == CAP and r.choices[0].finish_reason == "length"


def test_key_sources_load_and_a_typo_is_refused(tmp_path):
    (tmp_path / "k").write_text("a\n# c\n\nb\n")
    assert load_keys(["x"], [tmp_path / "k"], env={"KILN_API_KEY": "y, a"}) == ("x", "a", "b", "y")
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ValueError, match="no API key"):
        load_keys(files=[tmp_path / "empty"], env={})
    with pytest.raises(ValueError):
        load_keys([" spaced "], env={})


def _ok_afterwards(stack):
    r = stack.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": SHORT}],
                                               max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


def test_a_6_mb_prompt_is_refused_by_size_before_it_is_read(stack):
    body = json.dumps({"model": MODEL, "prompt": "Paris " * 1_000_000, "max_tokens": 1}).encode()
    assert len(body) > 6_000_000
    t0 = time.monotonic()
    r = requests.post(f"{stack.base}/completions", data=body, headers={"Content-Type": "application/json"},
                      timeout=60)
    took = time.monotonic() - t0
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["code"] == "request_too_large" and str(DEFAULT_MAX_BODY_BYTES) in err["message"]
    assert took < 2.5, took   # tokenizing it whole took 3.2 s (and its refusal was a 400, not a 413)
    # sent without a Content-Length (chunked): counted as it arrives
    r = requests.post(f"{stack.base}/completions", data=(body[i:i + 65536] for i in range(0, len(body), 65536)),
                      headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    _ok_afterwards(stack)


@pytest.mark.parametrize("depth", [100_000, 65])
def test_deeply_nested_json_is_a_400_in_openais_shape(stack, depth):
    for route in ("chat/completions", "completions"):
        r = requests.post(f"{stack.base}/{route}", data="[" * depth + "]" * depth,
                          headers={"Content-Type": "application/json"}, timeout=60)
        assert r.status_code == 400, (r.status_code, r.text[:300])
        err = r.json()["error"]
        assert err["code"] == "invalid_json" and "deep" in err["message"], err
    # nested inside an otherwise valid request too
    r = requests.post(f"{stack.base}/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": SHORT}], "metadata": json.loads("[" * 70 + "]" * 70)})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
    _ok_afterwards(stack)


def test_make_serve_hands_keys_and_limits_to_the_front_door_but_not_on_its_command_line(serving_build, tmp_path,
                                                                                       monkeypatch):
    from harness.serve import parse_args
    (tmp_path / "keys").write_text(f"{FILE_KEY}\n")
    monkeypatch.setenv("KILN_API_KEY", ENV_KEYS[0])   # what make serve API_KEY=... sets
    a = parse_args(["--model-repository", str(serving_build / "model_repository"), "--api-key-file",
                    str(tmp_path / "keys"), "--openai-max-tokens-cap", "8", "--openai-tool-parser", "hermes",
                    "--openai-reasoning-parser", "think"])
    assert a.api_keys == (FILE_KEY, ENV_KEYS[0])
    srv = OpenAIServer(serving_build / "model_repository", "127.0.0.1:1", None, api_keys=a.api_keys,
                       extra_args=a.openai_args)
    cmd = " ".join(srv.command())
    assert "--max-tokens-cap 8" in cmd and "--tool-parser hermes" in cmd and "--reasoning-parser think" in cmd
    assert FILE_KEY not in cmd and ENV_KEYS[0] not in cmd
