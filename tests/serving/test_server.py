"""The rendered repository served by a real Triton server (one per module, free ports, real SmolLM2),
under load and misuse: 64 concurrent streams and cancelled ones free the KV pool, invalid requests get
an error while the server keeps serving, Kiln's metrics are exported, and the engine model unloads and
reloads without leaking.

Loading the repository at all is the check of every rendered config.pbtxt by Triton's own parser.
The answers themselves (greedy text, stop words, NVIDIA's request parameters): test_server_requests.py.
"""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
import requests

from harness.model_names import DEFAULT as NAMES
from harness.serving_client import GenerateError, grpc_inputs, http_generate
from tests.serving.conftest import PROMPTS
from tests.serving.server_helpers import MODELS, _streams, metric, run, wait_kv_idle

pytestmark = [pytest.mark.slow, pytest.mark.server]


def test_64_concurrent_streams_complete_and_free_the_kv_pool(triton_server):
    texts = ["Tell me a joke.", "What is 2 + 2?", "Name a color:", "Hello, my name is", "The sky is",
             "Why do cats purr?", "Write a haiku:", "The best pizza topping is"]
    # min_tokens: a sampled EOS as the very first token would make an empty (but correct) answer
    jobs = [(MODELS[i % 2], texts[i % len(texts)] + f" ({i})",
             dict(max_tokens=2 + i % 4, min_tokens=2 + i % 4, temperature=0.7, seed=i)) for i in range(64)]
    sent = ("kiln_engine_responses_total", "kiln_engine_response_parts_total")
    before = [metric(triton_server, name) for name in sent]
    done = metric(triton_server, "kiln_requests_finished_total")
    results = run(_streams(triton_server.grpc_url, jobs))
    assert [r.error for r in results] == [None] * 64
    assert all(r.pieces for r in results)
    used, free, total = wait_kv_idle(triton_server, finished=done + 64)
    assert total > 0 and used == 0 and free == total
    # the responder's counters (refreshed by the engine's poller): every stream had at least one
    # response, and a response carries one token group or more (more when groups were joined)
    deadline = time.monotonic() + 10
    while (grew := [metric(triton_server, n) - b for n, b in zip(sent, before)])[0] < 64 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert 64 <= grew[0] <= grew[1], grew


# Not "ensemble": Triton 24.10 checks an ensemble's cancellation only between steps and never cancels
# the engine step already streaming, so the engine cannot see it (the bls model stops the engine itself).
@pytest.mark.parametrize("model", [NAMES.bls])
def test_cancelled_stream_frees_its_blocks_and_others_finish(reference, triton_server, model):
    text, n = PROMPTS["paris"]
    before = metric(triton_server, "kiln_generated_tokens_total")
    done = metric(triton_server, "kiln_requests_finished_total")
    long_job = (model, "Write a very long story about a dragon who learns to fly.",
                dict(max_tokens=600, min_tokens=600, temperature=0.0, cancel_after=3))
    short_job = (model, text, dict(max_tokens=n, temperature=0.0))
    cancelled, other = run(_streams(triton_server.grpc_url, [long_job, short_job]))
    assert cancelled.cancelled and len(cancelled.pieces) == 3
    assert other.error is None and other.text == reference["paris"]
    used, free, total = wait_kv_idle(triton_server, finished=done + 2, timeout=10)
    assert used == 0 and free == total
    # the cancelled request stopped long before its 600 tokens
    assert metric(triton_server, "kiln_generated_tokens_total") - before < 300


def test_cancelled_engine_request_frees_its_blocks(reference, triton_server):
    """A client of the engine model itself (token ids in, like tensorrtllm_backend's engine)."""
    import tritonclient.grpc as g
    import tritonclient.grpc.aio as aio
    from backend.serving.conversion.tokenizer import load_tokenizer
    ids = load_tokenizer(triton_server.repo.parent / "engine").encode("Write a long story about a dragon.")
    inputs = []
    for name, arr in (("input_ids", np.array(ids, np.int32)), ("request_output_len", np.array([600], np.int32)),
                      ("min_tokens", np.array([600], np.int32)), ("streaming", np.array([True]))):
        arr = arr[None]  # the batch dimension (max_batch_size > 0, as NVIDIA's models)
        inp = g.InferInput(name, list(arr.shape), "BOOL" if arr.dtype == bool else "INT32")
        inp.set_data_from_numpy(arr)
        inputs.append(inp)

    done = metric(triton_server, "kiln_requests_finished_total")

    async def go():
        client = aio.InferenceServerClient(triton_server.grpc_url)

        async def reqs():
            yield {"model_name": NAMES.engine, "inputs": inputs}
        n = 0
        it = client.stream_infer(reqs())
        async for result, error in it:
            assert error is None
            n += result.as_numpy("output_ids").size
            if n >= 3:
                it.cancel()
                break
        await client.close()
        return n
    assert run(go()) >= 3
    used, free, total = wait_kv_idle(triton_server, finished=done + 1, timeout=10)
    assert used == 0 and free == total


INVALID = [
    ({"max_tokens": 4}, None, "text_input"),
    ({"text_input": "Hi", "max_tokens": 0}, None, "max_tokens"),
    ({"text_input": "Hi", "max_tokens": 5000}, None, "5000: more than the"),
    ({"text_input": "word " * 700, "max_tokens": 4}, None, "max_input_len"),
    ({"text_input": "Hi", "temperature": -1.0}, None, "temperature"),
    ({"text_input": "Hi", "top_p": -0.5}, None, "top_p"),
    ({"text_input": "Hi", "end_id": -2}, None, "end_id"),
    ({"text_input": "Hi", "beam_width": 4}, None, "beam_width"),
    ({"text_input": "Hi", "top_p": 1.5}, None, "top_p"),
    ({"text_input": "Hi", "top_k": -1}, None, "top_k"),
    ({"text_input": b"caf\xc3(", "max_tokens": 4}, None, "UTF-8"),
    ({"text_input": "Hi", "max_tokens": np.array([[4.0]], np.float32)}, {"max_tokens": "FP32"}, "max_tokens"),
    ({"text_input": "Hi", "return_perf_metrics": np.array([[1]], np.int32)}, {"return_perf_metrics": "INT32"},
     "return_perf_metrics"),
    ({"text_input": np.array([[b"a", b"b"]], dtype=object)}, None, "text_input"),
    # two rows of text but one of max_tokens: every input needs one row per sequence (Triton checks)
    ({"text_input": np.array([[b"a"], [b"b"]], dtype=object), "max_tokens": 4}, None,
     "batch size does not match"),  # Triton checks this before the model
]


@pytest.mark.parametrize("model", MODELS)
def test_invalid_requests_get_an_error_and_the_server_keeps_serving(reference, triton_server, model):
    import tritonclient.grpc as g
    client = g.InferenceServerClient(triton_server.grpc_url)
    for params, datatypes, fragment in INVALID:
        params = dict(params)
        text = params.pop("text_input", None)
        inputs = grpc_inputs(text, datatypes, **params) if text is not None else \
            [i for i in grpc_inputs("x", datatypes, **params) if i.name() != "text_input"]
        with pytest.raises(Exception) as e:  # noqa: PT011 - tritonclient raises InferenceServerException
            # plain infer is refused on decoupled models, so go through the streaming API like clients do
            res = run(_one_raw(triton_server.grpc_url, model, inputs))
            if res is not None:
                raise GenerateError(res)
        assert fragment in str(e.value), (params, str(e.value))
    client.close()
    text, n = PROMPTS["paris"]
    assert http_generate(triton_server.http_url, model, text, max_tokens=n, temperature=0.0,
                         exclude_input_in_output=True)["text_output"] == reference["paris"]


async def _one_raw(url, model, inputs):
    """Send raw inputs on a stream; return the error text of the first response (or None)."""
    import tritonclient.grpc.aio as aio
    client = aio.InferenceServerClient(url)

    async def reqs():
        yield {"model_name": model, "inputs": inputs}
    first_error = None
    try:
        # read to the stream's end (harness.serving_client READ_TO_THE_END)
        async for result, error in client.stream_infer(reqs()):
            if error is not None and first_error is None:
                first_error = str(error)
    finally:
        await client.close()
    return first_error


def test_custom_metrics_are_exported(triton_server):
    # its own request, so it does not depend on what ran before; the engine publishes a request's
    # metrics before its final response, so they include it once the response is here
    grown = ("kiln_requests_finished_total", "kiln_time_to_first_token_seconds_count",
             "kiln_time_per_output_token_seconds_count")
    before = {name: metric(triton_server, name) for name in (*grown, "kiln_generated_tokens_total")}
    text, n = PROMPTS["paris"]
    body = http_generate(triton_server.http_url, NAMES.ensemble, text, max_tokens=n, temperature=0.0,
                         exclude_input_in_output=True)
    assert body["text_output"]
    exported = requests.get(triton_server.metrics_url, timeout=10).text
    for name in ("kiln_requests_running", "kiln_requests_waiting", "kiln_kv_blocks_used", "kiln_kv_blocks_free",
                 "kiln_kv_blocks_cached", "kiln_prefix_cache_hit_rate", "kiln_generated_tokens_total",
                 "kiln_time_to_first_token_seconds_bucket", "kiln_time_per_output_token_seconds_count"):
        assert name + "{" in exported, name
    # what the engine computes in, set at load: this build pins engine.cpu_dtype=float32
    assert 'kiln_engine_compute_dtype{asked="float32",dtype="float32",' in exported
    assert {name: metric(triton_server, name) - before[name] for name in grown} == dict.fromkeys(grown, 1.0)
    assert metric(triton_server, "kiln_generated_tokens_total") > before["kiln_generated_tokens_total"]


def test_a_bundle_without_a_draft_reports_zero_acceptance(reference, triton_server):
    """This bundle has no EAGLE draft: the acceptance outputs are zeros (present in the ensemble
    always, in bls when asked) and the speculation metrics exist and stay at 0."""
    from backend.serving.metrics.acceptance import read_acceptance
    zeros = {"acceptance_rate": 0.0, "total_accepted_draft_tokens": 0, "total_draft_tokens": 0}
    text, n = PROMPTS["paris"]
    for model, flag in ((NAMES.ensemble, {}), (NAMES.bls, {"return_perf_metrics": True})):
        body = http_generate(triton_server.http_url, model, text, max_tokens=n, temperature=0.0,
                             exclude_input_in_output=True, **flag)
        assert body["text_output"] == reference["paris"]
        assert read_acceptance(body) == zeros, model
    for name in ("kiln_spec_draft_tokens_proposed_total", "kiln_spec_draft_tokens_accepted_total",
                 "kiln_spec_acceptance_rate", "kiln_spec_mean_acceptance_length"):
        assert metric(triton_server, name) == 0.0, name


def _stubs(server_pid: int) -> dict[int, int]:
    """pid -> RSS kB of the server's Python backend stubs."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) != server_pid:
                continue
            with open(f"/proc/{pid}/status") as f:
                status = f.read()
        except OSError:
            continue
        if "triton_python_b" in status.split("\n", 1)[0]:
            rss = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS")), 0)
            out[int(pid)] = rss
    return out


def test_engine_model_unloads_and_reloads_without_leaking(reference, triton_server):
    import tritonclient.http as th
    client = th.InferenceServerClient(triton_server.http_url)
    pid = triton_server.proc.pid
    before = _stubs(pid)
    assert len(before) == 4  # one stub per Python model instance (the ensemble has none)
    for _ in range(2):
        client.unload_model(NAMES.engine)
        deadline = time.monotonic() + 60
        while (client.is_model_ready(NAMES.engine) or len(_stubs(pid)) != len(before) - 1) \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not client.is_model_ready(NAMES.engine)
        assert len(_stubs(pid)) == len(before) - 1  # the engine's stub process is gone
        with pytest.raises(GenerateError):
            http_generate(triton_server.http_url, NAMES.ensemble, "Hi", max_tokens=2)
        client.load_model(NAMES.engine)
        assert client.is_model_ready(NAMES.engine)
    after = _stubs(pid)
    assert len(after) == len(before)
    assert sum(after.values()) < 1.3 * sum(before.values()) + 200_000
    text, n = PROMPTS["paris"]
    assert http_generate(triton_server.http_url, NAMES.ensemble, text, max_tokens=n, temperature=0.0,
                         exclude_input_in_output=True)["text_output"] == reference["paris"]
    client.close()
