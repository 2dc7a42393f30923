"""serving.decoupled=false (NVIDIA's decoupled_mode=false) on the real Triton server: one response per
request, so HTTP /v2/models/<m>/infer and one-shot gRPC ModelInfer work (Triton refuses both on a
decoupled model), and a request asking to stream gets a clear error instead of hanging or streaming.
The decoupled policy (the default) is what every other serving test runs against.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import requests

from harness.model_names import DEFAULT as NAMES, repository_names
from harness.serving_client import grpc_generate, grpc_inputs, http_generate

from tests.serving.conftest import SERVING_CONFIG, SERVING_OVERRIDES

pytestmark = [pytest.mark.slow, pytest.mark.server]

PROMPT, N = "The capital of France is", 16  # under one KV block: no cached prefix changes the arithmetic


@pytest.fixture(scope="module")
def build(build_bundle) -> Path:
    root = Path(build_bundle(SERVING_CONFIG, [*SERVING_OVERRIDES, "serving.decoupled=false"])).parent
    repo = root / "model_repository"
    assert repository_names(repo) == NAMES  # NVIDIA's names by default
    for name in (NAMES.engine, NAMES.bls):
        assert "decoupled: false" in (repo / name / "config.pbtxt").read_text()
    return root


@pytest.fixture(scope="module")
def reference(build):
    from backend.engine.executor import Executor
    from backend.engine.sampling_params import SamplingParams
    from backend.serving.conversion.tokenizer import load_tokenizer
    tok = load_tokenizer(build / "engine")
    ex = Executor(build / "engine", start=False)
    try:
        ids = tok.encode(PROMPT)
        [res] = ex.generate([ids], SamplingParams(max_tokens=N, temperature=0.0))
        assert res.error is None
        return {"prompt_ids": ids, "ids": list(res.token_ids), "text": tok.decode(res.token_ids).rstrip("\ufffd")}
    finally:
        ex.shutdown()
        del ex


@pytest.fixture(scope="module")
def server(build):
    from harness.serving_server import TritonServer
    with TritonServer(build / "model_repository", model_control="explicit",
                      load_models=tuple(NAMES.as_dict().values()), exit_timeout=3) as srv:
        yield srv


def _http_infer(srv, model: str, inputs: list[dict]) -> requests.Response:
    return requests.post(f"http://{srv.http_url}/v2/models/{model}/infer", json={"inputs": inputs}, timeout=300)


def _text_inputs(**extra) -> list[dict]:
    # shapes [1, 1]: the batch dimension, then the value (max_batch_size > 0, as NVIDIA's models)
    out = [{"name": "text_input", "datatype": "BYTES", "shape": [1, 1], "data": [PROMPT]},
           {"name": "max_tokens", "datatype": "INT32", "shape": [1, 1], "data": [N]},
           {"name": "temperature", "datatype": "FP32", "shape": [1, 1], "data": [0.0]},
           {"name": "exclude_input_in_output", "datatype": "BOOL", "shape": [1, 1], "data": [True]}]
    return out + [{"name": k, "datatype": "BOOL", "shape": [1, 1], "data": [v]} for k, v in extra.items()]


@pytest.mark.parametrize("model", [NAMES.ensemble, NAMES.bls])
def test_http_infer_answers_text_models_once(server, reference, model):
    r = _http_infer(server, model, _text_inputs())
    assert r.status_code == 200, r.text
    out = {o["name"]: o for o in r.json()["outputs"]}
    assert out["text_output"]["data"] == [reference["text"]]
    # and the generate endpoint (one response) still works, prompt echoed by default
    assert http_generate(server.http_url, model, PROMPT, max_tokens=N, temperature=0.0)["text_output"] \
        == PROMPT + reference["text"]


@pytest.mark.parametrize("model", [NAMES.ensemble, NAMES.bls])
def test_one_shot_grpc_infer_on_text_models(server, reference, model):
    import tritonclient.grpc as g
    client = g.InferenceServerClient(server.grpc_url)
    try:
        res = client.infer(model, grpc_inputs(PROMPT, max_tokens=N, temperature=0.0, exclude_input_in_output=True))
    finally:
        client.close()
    assert res.as_numpy("text_output").reshape(-1)[0].decode() == reference["text"]


def test_one_shot_grpc_infer_on_the_engine_returns_the_token_ids(server, reference):
    import tritonclient.grpc as g
    ids = np.array(reference["prompt_ids"], np.int32)
    inputs = []
    for name, arr in (("input_ids", ids), ("input_lengths", np.array([len(ids)], np.int32)),
                      ("request_output_len", np.array([N], np.int32)), ("temperature", np.array([0.0], np.float32))):
        arr = arr[None]  # the batch dimension
        inp = g.InferInput(name, list(arr.shape), {np.int32: "INT32", np.float32: "FP32"}[arr.dtype.type])
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    client = g.InferenceServerClient(server.grpc_url)
    try:
        res = client.infer(NAMES.engine, inputs)
    finally:
        client.close()
    # NVIDIA's non-streamed output_ids: [batch, beam, prompt + generated]
    out = res.as_numpy("output_ids")
    assert out.shape == (1, 1, len(ids) + N) and out.reshape(-1).tolist() == reference["prompt_ids"] + reference["ids"]
    assert res.as_numpy("sequence_length").tolist() == [[len(ids) + N]]


def test_streaming_requests_get_a_clear_error(server):
    # the text models: stream=true; the engine: streaming=true
    for model in (NAMES.ensemble, NAMES.bls):
        r = _http_infer(server, model, _text_inputs(stream=True))
        assert r.status_code >= 400, r.text
        assert "needs a decoupled (streaming) model" in r.text and "serving.decoupled=true" in r.text, r.text
    r = _http_infer(server, NAMES.engine, [
        {"name": "input_ids", "datatype": "INT32", "shape": [1, 3], "data": [1, 2, 3]},
        {"name": "request_output_len", "datatype": "INT32", "shape": [1, 1], "data": [2]},
        {"name": "streaming", "datatype": "BOOL", "shape": [1, 1], "data": [True]}])
    assert r.status_code >= 400 and "streaming=true needs a decoupled" in r.text, r.text
    # over a gRPC stream too (allowed on a non-decoupled model): the error comes back, nothing hangs
    res = grpc_generate(server.grpc_url, NAMES.bls, PROMPT, max_tokens=N, stream=True)
    assert res.error and "needs a decoupled (streaming) model" in res.error, res
    # and the server still answers normally afterwards
    assert _http_infer(server, NAMES.ensemble, _text_inputs()).status_code == 200
