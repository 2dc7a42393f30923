"""``engine.runtime: onnx-reference`` through the real Triton server (#21): the same model repository as
the native runtime, the engine model's steps run by the bundle's ``decoder.onnx`` (onnx's
ReferenceEvaluator, Kiln's nodes by the kernels' PyTorch references). Streaming both prompts at once
through the ensemble gives the native executor's greedy text for the same bundle (both in float32)."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from harness.model_names import DEFAULT as NAMES
from tests.serving.conftest import PROMPTS, SERVING_CONFIG, SERVING_OVERRIDES, _server
from tests.serving.test_cancel_storm import _stream, _text_inputs

pytestmark = [pytest.mark.slow, pytest.mark.server]

GRAPH = ["tensorrt.enabled=true", "engine.runtime=onnx-reference"]


@pytest.fixture(scope="module")
def graph_build(build_bundle) -> Path:
    return Path(build_bundle(SERVING_CONFIG, [*SERVING_OVERRIDES, *GRAPH])).parent


def test_onnx_reference_runtime_streams_the_native_text(graph_build):
    from backend.engine.executor import Executor
    from backend.engine.sampling_params import SamplingParams
    from backend.serving.conversion.tokenizer import load_tokenizer
    engine = graph_build / "engine"
    assert json.loads((engine / "engine.json").read_text())["engine"]["runtime"] == "onnx-reference"
    tok = load_tokenizer(engine)
    native = Executor(engine, start=False, runtime="native")   # engine.cpu_dtype float32, as the graph runs
    try:
        want = {key: tok.decode(r.token_ids).rstrip("\ufffd") for key, r in zip(PROMPTS, native.generate(
            [tok.encode(text) for text, _ in PROMPTS.values()],
            [SamplingParams(max_tokens=n, temperature=0.0) for _, n in PROMPTS.values()]))}
    finally:
        native.shutdown()

    with _server(graph_build) as srv:
        async def both():
            return await asyncio.gather(*[
                _stream(srv.grpc_url, NAMES.ensemble, _text_inputs(text, max_tokens=n, temperature=0.0, stream=True))
                for text, n in PROMPTS.values()])
        results = asyncio.run(both())
        log = srv.log_file.read_text(errors="replace")
    assert "onnx-reference runner: decoder.onnx in torch.float32" in log   # the engine model ran the graph
    for key, res in zip(PROMPTS, results):
        assert res["error"] is None and res["final"], res
        assert len(res["pieces"]) > 1
        assert "".join(res["pieces"]) == want[key], key
