"""The OpenAI front door's test stack (tests/serving/test_openai_*.py): ``python -m harness.serve
--openai-port`` (what ``make serve`` runs) on the real SmolLM2 serving build, started once for the
package by the ``stack`` fixture (tests/serving/conftest.py), and the checks the tests share: the
ensemble's and the engine model's own answers, server-sent events."""
from __future__ import annotations

import re
import signal
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import requests

from harness.model_names import DEFAULT as NAMES
from harness.serving_client import grpc_generate
from harness.serving_server import free_port
from tests.serving.serve_process import READY, start_serve

MODEL = "smollm2-135m-bf16"   # the serving build's config stem: the model id the front door serves
ASK = "Tell me about Paris"   # greedy answers run on for many tokens: finish_reason "length"
SHORT = "What is the capital of France?"  # greedy answer ends with the end token in 8 tokens


class Stack:
    def __init__(self, proc, banner, ports):
        self.proc, self.banner = proc, banner
        self.http, self.grpc, self.metrics, self.openai = ports
        self.base = f"http://127.0.0.1:{self.openai}/v1"
        self.root = f"http://127.0.0.1:{self.openai}"
        self.grpc_url = f"127.0.0.1:{self.grpc}"

    def client(self, **kw):
        import openai
        return openai.OpenAI(base_url=self.base, api_key="unused", max_retries=0, timeout=120, **kw)

    def metric(self, name: str, **labels) -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/metrics", timeout=5).read().decode()
        want = {"model": NAMES.engine, **labels}
        for line in text.splitlines():
            m = re.match(rf"^{name}\{{([^}}]*)\}} (\S+)$", line)
            if m and all(f'{k}="{v}"' in m.group(1) for k, v in want.items()):
                return float(m.group(2))
        raise AssertionError(f"{name} {want} not in Triton's metrics")



def run_stack(serving_build: Path):
    """Generator behind the ``stack`` fixture: start, yield the Stack, stop with make serve's Ctrl-C."""
    ports = [free_port() for _ in range(4)]
    assert len(set(ports)) == 4
    proc, lines = start_serve(serving_build / "model_repository", ports)
    try:
        assert READY in "".join(lines), "".join(lines)
        yield Stack(proc, "".join(lines), ports)
        # make serve's Ctrl-C stops the front door too, and the whole thing exits cleanly
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, "".join(lines) + rest
        with pytest.raises(requests.ConnectionError):
            requests.get(f"http://127.0.0.1:{ports[3]}/health", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def ensemble_text(stack: Stack, prompt: str, max_tokens: int, chat: bool) -> str:
    """The same prompt through Triton's ensemble, greedy (it sets neither top_k nor top_p)."""
    res = grpc_generate(stack.grpc_url, NAMES.ensemble, prompt, max_tokens=max_tokens, apply_chat_template=chat)
    assert res.error is None, res.error
    return res.text


def engine_stream(grpc_url: str, prompt_ids: list[int], max_tokens: int) -> list:
    """The responses of one greedy streamed request straight to the engine model (no front door),
    read to the stream's end; asserts none is an error and a final one came."""
    import tritonclient.grpc as g
    inputs = []
    for name, arr, dt in [("input_ids", np.array([prompt_ids], np.int32), "INT32"),
                          ("request_output_len", np.array([[max_tokens]], np.int32), "INT32"),
                          ("streaming", np.array([[True]]), "BOOL")]:
        inp = g.InferInput(name, list(arr.shape), dt)
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    got, done = [], []
    client = g.InferenceServerClient(grpc_url)
    client.start_stream(callback=lambda result, error: (got.append((result, error)), done.append(
        error is not None or result.as_numpy("finish_reason").reshape(-1)[0] != b"")))
    client.async_stream_infer(NAMES.engine, inputs)
    client.stop_stream()  # waits for the stream's end
    client.close()
    assert all(e is None for _, e in got) and any(done), got
    return [r for r, _ in got]


def engine_token_count(stack: Stack, prompt_ids: list[int], max_tokens: int) -> int:
    """Generated ids of a greedy request straight to the engine model (no front door)."""
    return sum(r.as_numpy("output_ids").size for r in engine_stream(stack.grpc_url, prompt_ids, max_tokens))


def sse_events(resp) -> list[str]:
    return [line[5:].strip() for line in resp.iter_lines(decode_unicode=True) if line.startswith("data:")]


def sse_events_of(text: str) -> list[str]:
    return [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]


