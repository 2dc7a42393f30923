"""Requests of several rows (end_to_end_grpc_client.py --batch-inputs) and their refusal when not decoupled.

Replays NVIDIA's tensorrtllm_backend client script request for request against the real Triton
server (shared prompts, expected answers and request building: tests/serving/nvidia_clients.py).
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from harness.model_names import DEFAULT as NAMES

from tests.serving.nvidia_clients import (E2E_N, E2E_PROMPT, ETE_N, ETE_PROMPT, STREAM_TIMEOUT, client_text, e2e_client,
                                     e2e_client_arrays, e2e_client_outputs, errors_of, is_final,
                                     one_text, output_names, run_stream, tensor)

pytestmark = [pytest.mark.slow, pytest.mark.server]


# ---- batch size 2 --------------------------------------------------------------------------------

def _batch_error_ok(msg: str) -> bool:
    return "batch" in msg.lower() and re.search(r"\b2\b", msg) is not None


@pytest.mark.parametrize("model", [NAMES.ensemble, NAMES.bls, NAMES.engine])
def test_batch_of_two_is_refused_and_the_server_keeps_serving(nd_server, refs, model):
    """A non-decoupled build answers one response per request, so a [2, ...] request gets an error
    naming the batch size (as NVIDIA's backend refuses it); then a normal request works (HTTP infer)."""
    import tritonclient.http as httpclient
    client = httpclient.InferenceServerClient(nd_server.http_url, network_timeout=STREAM_TIMEOUT)
    ref = refs.ete
    try:
        if model == NAMES.engine:
            two = [tensor(httpclient, "input_ids", np.array([ref.prompt_ids] * 2, dtype=np.int32)),
                   tensor(httpclient, "input_lengths", np.array([[len(ref.prompt_ids)]] * 2, dtype=np.int32)),
                   tensor(httpclient, "request_output_len", np.array([[4]] * 2, dtype=np.int32))]
            one = [tensor(httpclient, "input_ids", np.array([ref.prompt_ids], dtype=np.int32)),
                   tensor(httpclient, "input_lengths", np.array([[len(ref.prompt_ids)]], dtype=np.int32)),
                   tensor(httpclient, "request_output_len", np.array([[4]], dtype=np.int32))]
        else:
            two = [tensor(httpclient, "text_input", np.array([[ETE_PROMPT], [E2E_PROMPT]]).astype(object)),
                   tensor(httpclient, "max_tokens", np.array([[4], [4]], dtype=np.int32))]
            one = [tensor(httpclient, "text_input", np.array([[ETE_PROMPT]]).astype(object)),
                   tensor(httpclient, "max_tokens", np.array([[4]], dtype=np.int32))]
        with pytest.raises(httpclient.InferenceServerException) as err:
            client.infer(model, two)
        assert _batch_error_ok(str(err.value)), str(err.value)
        res = client.infer(model, one)
        if model == NAMES.engine:
            assert res.as_numpy("output_ids")[0, 0].tolist() == ref.prompt_ids + ref.ids[:4]
        else:
            assert one_text(res.as_numpy("text_output")) == refs.tok.decode(ref.prompt_ids + ref.ids[:4])
    finally:
        client.close()


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
@pytest.mark.parametrize("model", [NAMES.ensemble, NAMES.bls])
def test_batch_inputs_are_answered_row_by_row(dec_server, refs, model, stream):
    """end_to_end_grpc_client.py --batch-inputs on the decoupled build: two prompts stacked on the
    batch dimension in one request (each its own max_tokens). Every response carries one row's text
    and its batch_index; per row, the text is that prompt's greedy answer; the request ends with ONE
    final response (after both rows)."""
    import tritonclient.grpc as grpcclient
    rows_ = [(E2E_PROMPT, E2E_N, refs.e2e), (ETE_PROMPT, ETE_N, refs.ete)]
    arrays = [e2e_client_arrays(prompt, n, stream) for prompt, n, _ in rows_]
    stacked = [tensor(grpcclient, k, np.concatenate([a[k] for a in arrays], axis=0)) for k in arrays[0]]
    outputs = e2e_client_outputs() + [grpcclient.InferRequestedOutput("batch_index")]
    results = run_stream(dec_server.grpc_url, [(model, stacked, dict(outputs=outputs, request_id="2"))])
    assert not errors_of(results), errors_of(results)
    texts: dict[int, list[str]] = {0: [], 1: []}
    for result, _ in results:
        if "text_output" not in output_names(result):
            continue
        row = int(result.as_numpy("batch_index").reshape(-1)[0])
        texts[row].append(one_text(result.as_numpy("text_output")))
    assert sum(is_final(r) for r, _ in results) == 1 and is_final(results[-1][0])
    for row, (_prompt, _n, ref) in enumerate(rows_):
        if stream:  # pieces add up to the completion
            assert "".join(texts[row]) == ref.completion, row
        else:       # one response per row: the prompt, then the completion
            assert texts[row] == [ref.full_text], row
    ok = e2e_client(dec_server.grpc_url, NAMES.ensemble, E2E_PROMPT, E2E_N, False)
    assert client_text(ok, False) == refs.e2e.full_text
