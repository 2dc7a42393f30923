"""inflight_batcher_llm_client.py: token ids to tensorrt_llm (one-shot, streaming, stop).

Replays NVIDIA's tensorrtllm_backend client script request for request against the real Triton
server (shared prompts, expected answers and request building: tests/serving/nvidia_clients.py).
"""
from __future__ import annotations

import queue
import threading
import uuid

import numpy as np
import pytest

from tests.serving.nvidia_clients import (IB_N, STOP_N, STREAM_TIMEOUT, errors_of, ib_inputs, ib_stop_inputs, is_final, output_names,
                                     run_stream)

pytestmark = [pytest.mark.slow, pytest.mark.server]


@pytest.mark.parametrize("return_log_probs", [False, True], ids=["default", "return-log-probs"])
def test_inflight_batcher_client_non_streaming(nd_server, refs, return_log_probs):
    """No -S: one-shot async_infer(..., parameters={'Streaming': False}) on the non-decoupled build."""
    import tritonclient.grpc as grpcclient
    ref = refs.ib
    L = len(ref.prompt_ids)
    got: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(nd_server.grpc_url) as client:
        client.async_infer("tensorrt_llm", ib_inputs(ref.prompt_ids, IB_N, False, refs.eos,
                                                     return_log_probs=return_log_probs),
                           callback=lambda result, error: got.put((result, error)), request_id="7",
                           parameters={"Streaming": False})
        result, error = got.get(timeout=STREAM_TIMEOUT)
    assert error is None, str(error)
    resp = result.get_response()
    assert resp.id == "7"
    names = output_names(result)
    assert names[0] == "output_ids", names
    output_ids, seq = result.as_numpy("output_ids"), result.as_numpy("sequence_length")
    assert output_ids.dtype == np.int32 and output_ids.shape == (1, 1, L + IB_N), output_ids.shape
    assert seq.dtype == np.int32 and seq.tolist() == [[L + IB_N]], seq
    # the client's check (-c): output_ids[0][beam][:sequence_length[0][beam]] == input ids + expected
    seq_len = seq[0][0]
    assert list(output_ids[0][0])[:seq_len] == ref.prompt_ids + ref.ids
    assert refs.tok.decode(list(output_ids[0][0])[L:seq_len]) == ref.completion
    if return_log_probs:
        cum, olp = result.as_numpy("cum_log_probs"), result.as_numpy("output_log_probs")
        assert cum.shape == (1, 1) and olp.shape == (1, 1, IB_N), (cum.shape, olp.shape)
        np.testing.assert_allclose(olp[0, 0], ref.logprobs, rtol=1e-4, atol=1e-4)
        assert float(cum[0, 0]) == pytest.approx(float(np.sum(olp, dtype=np.float64)), rel=1e-5, abs=1e-4)


def test_inflight_batcher_client_return_logits(nd_server, refs):
    """--return-context-logits --return-generation-logits, one-shot: context_logits FP32 [1, L, vocab]
    and generation_logits FP32 [1, 1, n, vocab], whose argmax is the greedy answer."""
    import tritonclient.grpc as grpcclient
    ref = refs.ib
    L, V = len(ref.prompt_ids), refs.vocab_size
    flags = {"return_context_logits": np.array([[True]]), "return_generation_logits": np.array([[True]])}
    with grpcclient.InferenceServerClient(nd_server.grpc_url) as client:
        result = client.infer("tensorrt_llm", ib_inputs(ref.prompt_ids, IB_N, False, refs.eos, extra=flags),
                              request_id="9", client_timeout=STREAM_TIMEOUT)
    ctx, gen = result.as_numpy("context_logits"), result.as_numpy("generation_logits")
    assert ctx.dtype == gen.dtype == np.float32
    assert ctx.shape == (1, L, V) and gen.shape == (1, 1, IB_N, V), (ctx.shape, gen.shape)
    assert gen[0, 0].argmax(-1).tolist() == ref.ids
    assert list(result.as_numpy("output_ids")[0, 0]) == ref.prompt_ids + ref.ids
    np.testing.assert_allclose(ctx[0, -1], gen[0, 0, 0], atol=1e-5, rtol=1e-5)
    # a request that does not ask gets zero-sized tensors, not the logits
    with grpcclient.InferenceServerClient(nd_server.grpc_url) as client:
        plain = client.infer("tensorrt_llm", ib_inputs(ref.prompt_ids, 2, False, refs.eos),
                             client_timeout=STREAM_TIMEOUT)
    assert plain.as_numpy("context_logits").size == 0 and plain.as_numpy("generation_logits").size == 0


def test_engine_counts_aliases_and_inputs_it_cannot_honour(nd_server, refs):
    """return_num_input_tokens / return_num_output_tokens add NVIDIA's counts; min_length is NVIDIA's
    older name of min_tokens; LoRA and external-draft inputs pass when neutral, else are refused."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException
    ref = refs.ib
    extra = {"return_num_input_tokens": np.array([[True]]), "return_num_output_tokens": np.array([[True]]),
             "min_length": np.array([[2]], np.int32), "lora_config": np.zeros((1, 0, 3), np.int32),
             "draft_input_ids": np.zeros((1, 0), np.int32), "len_penalty": np.array([[0.5]], np.float32)}
    with grpcclient.InferenceServerClient(nd_server.grpc_url) as client:
        result = client.infer("tensorrt_llm", ib_inputs(ref.prompt_ids, IB_N, False, refs.eos, extra=extra),
                              client_timeout=STREAM_TIMEOUT)
        assert result.as_numpy("num_input_tokens").tolist() == [[len(ref.prompt_ids)]]
        assert result.as_numpy("num_output_tokens").tolist() == [[IB_N]]   # the prompt echoed is not counted
        assert list(result.as_numpy("output_ids")[0, 0]) == ref.prompt_ids + ref.ids
        for bad, message in (({"min_length": np.array([[2]], np.int32), "min_tokens": np.array([[3]], np.int32)},
                              "input 'min_length': 2 differs from 'min_tokens'=3"),
                             ({"lora_task_id": np.array([[1]], np.uint64)}, "input 'lora_task_id'.*no LoRA adapters"),
                             ({"draft_input_ids": np.array([[5, 6]], np.int32)}, "input 'draft_input_ids'.*EAGLE-3")):
            with pytest.raises(InferenceServerException, match=message):
                client.infer("tensorrt_llm", ib_inputs(ref.prompt_ids, 2, False, refs.eos, extra=bad),
                             client_timeout=STREAM_TIMEOUT)


def test_inflight_batcher_client_streaming(dec_server, refs):
    """-S: a stream; each response carries only its new tokens, appended after the prompt ids."""
    ref = refs.ib
    results = run_stream(dec_server.grpc_url, [("tensorrt_llm", ib_inputs(ref.prompt_ids, IB_N, True, refs.eos),
                                                dict(request_id="8"))])
    assert not errors_of(results), errors_of(results)
    actual = list(ref.prompt_ids)
    for r, _ in results:
        assert r.get_response().id == "8"
        assert output_names(r)[0] == "output_ids", output_names(r)
        output_ids, seq = r.as_numpy("output_ids"), r.as_numpy("sequence_length")
        assert output_ids.ndim == 3 and output_ids.shape[:2] == (1, 1), output_ids.shape
        assert seq is None or seq.shape == (1, 1), seq.shape
        if seq is None or seq[0][0] > 0:
            actual += list(output_ids[0][0])
    assert actual == ref.prompt_ids + ref.ids, refs.tok.decode(actual)


def test_inflight_batcher_client_stop_request(dec_server, refs):
    """--stop-after-ms with --request-id: after the first streamed token the client sends, on the
    same stream and with the same request id, input_ids [1,1], input_lengths [[0]],
    request_output_len [[0]], stop [[True]] (parameters {'Streaming': True}). The stop gets one final
    response with no output_ids; the stopped request ends with a final response, having generated
    fewer than request_output_len tokens. min_tokens (a Kiln input) keeps the end token from ending
    the request early, so only the stop can end it before STOP_N."""
    import tritonclient.grpc as grpcclient
    ref = refs.ib
    rid = uuid.uuid4().hex  # Kiln honours a stop only for an id of >= 16 characters
    got: queue.Queue = queue.Queue()
    first_token = threading.Event()
    results: list = []

    def callback(result, error):
        got.put((result, error))
        if error is None and result.as_numpy("output_ids") is not None and result.as_numpy("output_ids").size:
            first_token.set()

    client = grpcclient.InferenceServerClient(dec_server.grpc_url)
    try:
        client.start_stream(callback=callback, stream_timeout=STREAM_TIMEOUT)
        client.async_stream_infer("tensorrt_llm", ib_inputs(ref.prompt_ids, STOP_N, True, refs.eos,
                                                            extra={"min_tokens": np.array([[STOP_N]], np.int32)}),
                                  request_id=rid, enable_empty_final_response=True)
        assert first_token.wait(120), "no token streamed within 120 s"
        client.async_stream_infer("tensorrt_llm", ib_stop_inputs(), request_id=rid,
                                  parameters={"Streaming": True}, enable_empty_final_response=True)
        client.stop_stream()  # waits for the server to end the stream
    finally:
        client.close()
    while not got.empty():
        results.append(got.get())
    errors = [str(e) for _, e in results if e is not None and e.status() != "StatusCode.CANCELLED"]
    assert not errors, errors
    data = [r for r, e in results if e is None]
    for r in data:
        assert r.get_response().id == rid
    finals = [r for r in data if is_final(r)]
    stop_finals = [r for r in finals if r.as_numpy("output_ids") is None]
    assert len(finals) == 2 and len(stop_finals) == 1, \
        [(output_names(r), is_final(r)) for r in data]
    assert output_names(stop_finals[0]) == [], output_names(stop_finals[0])  # no outputs at all
    # the stopped request: every response but the stop's has output_ids, its last one is final
    stopped = [r for r in data if r is not stop_finals[0]]
    assert stopped and is_final(stopped[-1]), [(output_names(r), is_final(r)) for r in stopped]
    generated = []
    for r in stopped:
        output_ids, seq = r.as_numpy("output_ids"), r.as_numpy("sequence_length")
        assert output_ids is not None and output_ids.ndim == 3, output_names(r)
        if seq is None or seq[0][0] > 0:
            generated += list(output_ids[0][0])
    assert 1 <= len(generated) < STOP_N, len(generated)
    head = min(len(generated), len(ref.ids))
    assert generated[:head] == ref.ids[:head]  # greedy, as far as the reference goes
    # the server goes on serving on a fresh stream
    again = run_stream(dec_server.grpc_url, [("tensorrt_llm", ib_inputs(ref.prompt_ids, 4, True, refs.eos),
                                              dict(request_id="9"))])
    assert not errors_of(again)
    assert [t for r, _ in again if r.as_numpy("output_ids") is not None
            for t in r.as_numpy("output_ids")[0][0]] == ref.ids[:4]


