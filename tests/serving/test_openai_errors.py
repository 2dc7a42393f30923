"""The OpenAI front door under bad input and departures on the real stack: a client that goes away
frees its KV blocks, malformed requests get OpenAI-shaped errors and the server goes on, and without
a ready engine health and requests answer 503."""
from __future__ import annotations

import time

import pytest
import requests

from harness.serving_server import free_port
from tests.serving.openai_stack import ASK, MODEL, SHORT

pytestmark = [pytest.mark.slow, pytest.mark.server]


def _wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s: {what}")


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_frees_its_kv_blocks(stack, stream):
    """The request could run ~900 tokens (tens of seconds); the client leaves after a moment and the
    engine cancels it: the KV blocks are back within seconds and the engine counts a cancellation."""
    idle = stack.metric("kiln_kv_blocks_used")
    cancelled = stack.metric("kiln_request_errors_total", kind="cancelled")
    body = {"model": MODEL, "prompt": ASK, "max_tokens": 900, "ignore_eos": True, "stream": stream}
    if stream:
        with requests.post(f"{stack.base}/completions", json=body, stream=True, timeout=60) as r:
            lines = r.iter_lines()
            assert [next(lines) for _ in range(4)]  # a few events: the request runs in the engine
            _wait(lambda: stack.metric("kiln_kv_blocks_used") > idle, 10, "the request holds KV blocks")
    else:
        with pytest.raises(requests.exceptions.ReadTimeout):
            requests.post(f"{stack.base}/completions", json=body, timeout=(5, 1.5))
    # Both together: the engine's poller may publish the freed blocks before the loop thread has
    # handled the cancelled request's last event (and counted it), so neither implies the other.
    _wait(lambda: (stack.metric("kiln_kv_blocks_used") == idle
                   and stack.metric("kiln_request_errors_total", kind="cancelled") == cancelled + 1), 10,
          "KV blocks back to their idle count and the request counted as cancelled")
    # and the server goes on serving
    r = stack.client().completions.create(model=MODEL, prompt=ASK, max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


# ---- refusals ------------------------------------------------------------------------------------

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
LONG = " ".join(["Paris"] * 600)  # over the serving build's max_input_len=512

MALFORMED = [  # (route, body, status, param, words in the message)
    ("chat/completions", b"{not json", 400, None, "not valid JSON"),
    ("chat/completions", {"messages": CHAT["messages"]}, 400, "model", "required"),
    ("chat/completions", {"model": MODEL}, 400, "messages", "required"),
    ("chat/completions", {**CHAT, "messages": []}, 400, "messages", "non-empty"),
    ("chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", "wizard"),
    ("chat/completions", {**CHAT, "temperature": 3}, 400, "temperature", "out of range"),
    ("chat/completions", {**CHAT, "top_p": "high"}, 400, "top_p", "finite number"),
    ("chat/completions", {**CHAT, "max_tokens": 0}, 400, "max_tokens", "out of range"),
    ("chat/completions", {**CHAT, "max_tokens": 5000}, 400, "max_tokens", "max_seq_len"),
    ("chat/completions", {**CHAT, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4"),
    ("chat/completions", {**CHAT, "n": 2}, 400, "n", "n=1"),
    ("chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "allowed: [0, 20]"),
    ("chat/completions", {**CHAT, "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400, "messages[0].content[0]", "only text"),
    ("chat/completions", {**CHAT, "response_format": {"type": "xml"}}, 400, "response_format", "allowed: text, json_object"),
    ("chat/completions", {**CHAT, "response_format": "json"}, 400, "response_format", "expected an object"),
    ("chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, 400, "response_format", "json_schema object"),
    ("chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400,
     "response_format", "json_schema.schema"),
    ("completions", {"model": MODEL, "prompt": "x", "guided_json": "{not json"}, 400, "guided_json", "not valid JSON"),
    ("completions", {"model": MODEL, "prompt": "x", "guided_regex": ""}, 400, "guided_regex", "non-empty string"),
    ("completions", {"model": MODEL, "prompt": "x", "guided_choice": ["a", "b"]}, 400, "guided_choice", "guided_regex"),
    ("chat/completions", {**CHAT, "functions": [{"name": "f"}]}, 400, "functions", "send tools"),
    ("completions", {"model": MODEL, "prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "tools", "chat feature"),
    ("completions", {"model": MODEL, "prompt": LONG}, 400, "prompt", "max_input_len"),
    ("completions", {"model": MODEL, "prompt": "x", "logprobs": 6}, 400, "logprobs", "allowed: [0, 5]"),
    ("completions", {"model": MODEL, "prompt": "x", "logit_bias": {"50": 101}}, 400, "logit_bias", "[-100, 100]"),
    ("completions", {"model": MODEL, "prompt": "x", "logit_bias": {"hello": 1}}, 400, "logit_bias", "not a token id"),
    ("completions", {"model": MODEL, "prompt": "x", "logit_bias": {"999999": 1}}, 400, "logit_bias", "outside the vocabulary"),
    ("completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt", "one prompt"),
    ("completions", {"model": "gpt-4o", "prompt": "x"}, 404, "model", "does not exist"),
]


def test_malformed_requests_are_refused_and_the_server_goes_on(stack):
    failures = []
    for route, body, status, param, words in MALFORMED:
        kw = {"data": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else {"json": body}
        r = requests.post(f"{stack.base}/{route}", timeout=30, **kw)
        err = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") else {}
        if r.status_code != status or err.get("param") != param or words not in err.get("message", ""):
            failures.append((route, str(body)[:80], r.status_code, r.text[:200]))
    assert not failures, failures
    r = stack.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": SHORT}],
                                               max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3 and r.choices[0].message.content


def test_the_official_client_sees_openai_errors(stack):
    import openai
    client = stack.client()
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert e.value.code == "model_not_found" and "no-such-model" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=3)
    assert e.value.param == "n" and e.value.status_code == 400
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=LONG, max_tokens=1)
    assert e.value.code == "context_length_exceeded"


def test_without_a_ready_engine_health_and_requests_answer_503(serving_build):
    """A front door whose Triton is not there (not started yet, or gone): 503, and it keeps running."""
    from harness.openai.process import OpenAIServer
    with OpenAIServer(serving_build / "model_repository", f"127.0.0.1:{free_port()}", None,
                      port=free_port()) as oai:
        h = requests.get(f"http://127.0.0.1:{oai.port}/health", timeout=10)
        assert h.status_code == 503 and h.json()["error"]["code"] == "engine_unavailable"
        r = requests.post(f"{oai.base_url}/chat/completions", json=CHAT, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert requests.get(f"{oai.base_url}/models", timeout=10).json()["data"][0]["id"] == MODEL
