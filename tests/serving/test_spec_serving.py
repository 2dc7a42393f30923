"""EAGLE-3 through the real Triton server: the acceptance outputs and the speculation metrics.

One real server for the module, serving the real SmolLM2 bf16 bundle WITH the CI-sized draft that
the eagle tests build (same overrides, so the same cached build: ModelOpt-trained for 24 steps).
The reference is the same bundle in this process through ``backend.engine.executor.Executor``, greedy,
each prompt alone: with speculation on (the tokens and per-request draft counts the server must
reproduce) and off (which, in float32, the CPU runtime's dtype, gives the very same tokens: so the
server's speculative output equals plain decoding; a request that cannot speculate is checked
against the plain tokens directly).
"""
from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import requests

from backend.serving.metrics.acceptance import ACCEPTANCE_OUTPUTS, read_acceptance
from harness.serving_client import grpc_inputs, http_generate
from harness.model_names import DEFAULT as NAMES

pytestmark = [pytest.mark.slow, pytest.mark.server]

# raw prompts under 16 tokens (one KV block): no request reuses a cached prefix, so the server does
# exactly the arithmetic of the in-process reference and the draft sees the same context
PROMPTS = {"paris": "The capital of France is", "fox": "The quick brown fox"}
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def eagle_build(build_bundle):
    # the eagle tests' CI-sized draft (tests/eagle/conftest.py): same data, same overrides, one build
    from tests.eagle.conftest import eagle_overrides  # noqa: PLC0415

    bundle = build_bundle("smollm2-135m-bf16-eagle3", eagle_overrides(verify=False))
    assert (bundle / "draft").is_dir() and (bundle.parent / "model_repository" / NAMES.engine).is_dir()
    return bundle.parent


@pytest.fixture(scope="module")
def reference(eagle_build):
    """prompt key -> (prompt ids, greedy ids without speculation, with it, (proposed, accepted),
    the text with speculation); plus "dtype": the runtime's compute dtype."""
    from backend.engine.executor import Executor
    from backend.engine.sampling_params import SamplingParams
    from backend.serving.conversion.tokenizer import load_tokenizer
    tok = load_tokenizer(eagle_build / "engine")
    ex = Executor(eagle_build / "engine", start=False)
    assert ex.speculator is not None, "the bundle's draft was not attached"
    out = {}
    try:
        for key, text in PROMPTS.items():  # one at a time, like the sequential requests below
            ids = tok.encode(text)
            [plain] = ex.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                        speculative=False))
            [spec] = ex.generate([ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
            s = ex.speculator.request_stats(spec.request_id)
            out[key] = (ids, plain.token_ids, spec.token_ids,
                        (s["draft_tokens_proposed"], s["draft_tokens_accepted"]),
                        tok.decode(spec.token_ids).rstrip("\ufffd"))
        dtype = ex.runner.dtype
    finally:
        ex.shutdown()
        del ex
    # the consistency checks below mean something only if the draft was right at least once
    assert any(r[3][1] > 0 for r in out.values()), {k: r[3] for k, r in out.items()}
    out["dtype"] = dtype
    return out


@pytest.fixture(scope="module")
def server(eagle_build, reference):  # the reference first: one model in memory at a time
    from harness.serving_server import TritonServer
    models = tuple(NAMES.as_dict().values())
    with TritonServer(eagle_build / "model_repository", model_control="explicit", load_models=models,
                      exit_timeout=3) as srv:
        yield srv


def metric(srv, name: str) -> float:
    for line in requests.get(srv.metrics_url, timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} missing from {srv.metrics_url}")


async def _stream(url: str, model: str, inputs: list) -> list:
    """Every data response of one gRPC stream, as {output name: array} (errors fail the test)."""
    import tritonclient.grpc.aio as aio
    client = aio.InferenceServerClient(url)
    out = []

    async def reqs():
        yield {"model_name": model, "inputs": inputs}
    try:
        # read to the stream's end (harness.serving_client READ_TO_THE_END)
        async for result, error in client.stream_infer(reqs()):
            assert error is None, error
            names = [o.name for o in result.get_response().outputs]
            if names:
                out.append({n: result.as_numpy(n) for n in names})
    finally:
        await client.close()
    return out


def stream(url, model, inputs):
    return asyncio.run(_stream(url, model, inputs))


def engine_inputs(ids, **flags) -> list:
    import tritonclient.grpc as g
    arrays = {"input_ids": np.array(ids, np.int32), "request_output_len": np.array([MAX_TOKENS], np.int32),
              "temperature": np.array([0.0], np.float32), "streaming": np.array([True]),
              **{k: np.array([v]) for k, v in flags.items()}}
    out = []
    for name, arr in arrays.items():
        arr = arr[None]  # the batch dimension (max_batch_size > 0)
        inp = g.InferInput(name, list(arr.shape), {"i": "INT32", "f": "FP32", "b": "BOOL"}[arr.dtype.kind])
        inp.set_data_from_numpy(arr)
        out.append(inp)
    return out


def check_cumulative(responses: list, expected: tuple[int, int]) -> None:
    """Figures on every response, never decreasing, rate = accepted / proposed, final = expected."""
    figs = [read_acceptance(r) for r in responses]
    assert figs and all(f is not None for f in figs), "a response lacks the acceptance outputs"
    for a, b in zip(figs, figs[1:]):
        assert a["total_draft_tokens"] <= b["total_draft_tokens"]
        assert a["total_accepted_draft_tokens"] <= b["total_accepted_draft_tokens"]
    for f in figs:
        assert 0 <= f["total_accepted_draft_tokens"] <= f["total_draft_tokens"]
        want = f["total_accepted_draft_tokens"] / f["total_draft_tokens"] if f["total_draft_tokens"] else 0.0
        assert f["acceptance_rate"] == pytest.approx(want, abs=1e-6)
    last = figs[-1]
    assert (last["total_draft_tokens"], last["total_accepted_draft_tokens"]) == expected


def test_speculation_leaves_greedy_output_unchanged(reference):
    """What the server is compared with below: with speculation, the same tokens as without it.
    Exact only in float32 (the CPU runtime's dtype unless the CPU computes bf16 natively): in bf16
    a verify pass over 1 + k rows rounds differently from a one-row decode step."""
    import torch
    if reference["dtype"] != torch.float32:
        pytest.skip(f"the runtime computes in {reference['dtype']} here; exact equality holds in float32")
    for key in PROMPTS:
        _ids, plain, spec, _counts, _text = reference[key]
        assert spec == plain, key


@pytest.mark.parametrize("key", list(PROMPTS))
def test_engine_streams_the_executors_tokens_and_counts(reference, server, key):
    ids, _plain, spec, counts, _text = reference[key]
    responses = stream(server.grpc_url, NAMES.engine, engine_inputs(ids, return_perf_metrics=True))
    got = [int(t) for r in responses for t in r["output_ids"].reshape(-1)]
    assert got == spec
    check_cumulative(responses, counts)
    assert counts[0] > 0  # it did speculate: drafts were proposed for this request


def test_ensemble_and_bls_report_the_same_figures(reference, server):
    _ids, _plain, _spec, counts, text = reference["paris"]
    # ensemble, HTTP generate, no flag: the ensemble always carries the figures
    body = http_generate(server.http_url, NAMES.ensemble, PROMPTS["paris"], max_tokens=MAX_TOKENS,
                         temperature=0.0, exclude_input_in_output=True)
    assert body["text_output"] == text
    f = read_acceptance(body)
    assert (f["total_draft_tokens"], f["total_accepted_draft_tokens"]) == counts
    # bls, gRPC streaming with the flag: cumulative on every response
    flag = dict(datatypes={"return_perf_metrics": "BOOL"}, return_perf_metrics=np.array([[True]]))
    responses = stream(server.grpc_url, NAMES.bls, grpc_inputs(PROMPTS["paris"], max_tokens=MAX_TOKENS,
                                                           temperature=0.0, stream=True, **flag))
    assert "".join(r["text_output"].reshape(-1)[0].decode() for r in responses) == text
    check_cumulative(responses, counts)


def test_clients_that_do_not_ask_see_no_acceptance_outputs(reference, server):
    ids, _plain, spec, _counts, text = reference["fox"]
    responses = stream(server.grpc_url, NAMES.engine, engine_inputs(ids))
    assert [int(t) for r in responses for t in r["output_ids"].reshape(-1)] == spec
    assert all(not set(ACCEPTANCE_OUTPUTS) & r.keys() for r in responses)
    responses = stream(server.grpc_url, NAMES.bls, grpc_inputs(PROMPTS["fox"], max_tokens=MAX_TOKENS,
                                                           temperature=0.0, stream=True))
    assert "".join(r["text_output"].reshape(-1)[0].decode() for r in responses) == text
    assert all(set(r) == {"text_output", "output_log_probs", "cum_log_probs"} for r in responses)


def test_request_that_cannot_speculate_reports_zeros(reference, server):
    # log-probabilities rule drafts out for the request (backend/speculative/accept.py): plain decoding
    ids, plain, _spec, _counts, _text = reference["paris"]
    responses = stream(server.grpc_url, NAMES.engine, engine_inputs(ids, return_perf_metrics=True,
                                                                return_log_probs=True))
    assert [int(t) for r in responses for t in r["output_ids"].reshape(-1)] == plain
    check_cumulative(responses, (0, 0))


def test_speculation_metrics_grow_by_the_requests_counts(reference, server):
    names = ("kiln_spec_draft_tokens_proposed_total", "kiln_spec_draft_tokens_accepted_total")
    ids, _plain, _spec, counts, _text = reference["paris"]
    before = [metric(server, n) for n in names]
    responses = stream(server.grpc_url, NAMES.engine, engine_inputs(ids, return_perf_metrics=True))
    check_cumulative(responses, counts)
    # the engine publishes a request's metrics before its final response: no waiting needed
    assert [metric(server, n) - b for n, b in zip(names, before)] == [float(c) for c in counts]
    proposed, accepted = (metric(server, n) for n in names)
    assert proposed > 0
    assert metric(server, "kiln_spec_acceptance_rate") == pytest.approx(accepted / proposed, abs=1e-6)
    assert metric(server, "kiln_spec_mean_acceptance_length") >= 1.0  # the target's own token at least


@pytest.mark.parametrize("protocol,model,stream", [("grpc", NAMES.ensemble, True), ("http", NAMES.bls, False),
                                                   ("http", NAMES.ensemble, True)])
def test_client_json_shows_the_figures(reference, server, capsys, protocol, model, stream):
    from harness import client
    _ids, _plain, _spec, counts, text = reference["paris"]
    url = server.grpc_url if protocol == "grpc" else server.http_url
    argv = ["--url", url, "--protocol", protocol, "--model", model, "--no-chat",
            "--max-tokens", str(MAX_TOKENS), PROMPTS["paris"]] + (["--stream"] if stream else [])
    assert client.main(argv + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["text"] == text
    assert (doc["total_draft_tokens"], doc["total_accepted_draft_tokens"]) == counts
    assert doc["acceptance_rate"] == pytest.approx(counts[1] / counts[0], abs=1e-6)
    # without --json: the text on stdout, the figures on one stderr line
    assert client.main(argv) == 0
    cap = capsys.readouterr()
    assert cap.out == text + "\n"
    assert f"{counts[1]} of {counts[0]} draft tokens accepted" in cap.err
