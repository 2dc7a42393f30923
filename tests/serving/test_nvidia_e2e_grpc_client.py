"""end_to_end_grpc_client.py: gRPC streams to ensemble / tensorrt_llm_bls (text, log probs, stop words, embedding bias).

Replays NVIDIA's tensorrtllm_backend client script request for request against the real Triton
server (shared prompts, expected answers and request building: tests/serving/nvidia_clients.py).
"""
from __future__ import annotations


import numpy as np
import pytest

from tests.serving.nvidia_clients import (E2E_N, E2E_PROMPT, NO_SUCH_WORD, TEXT_MODELS, client_text, e2e_client,
                                         e2e_client_arrays, e2e_client_outputs, errors_of, output_names, run_stream,
                                         tensor)

pytestmark = [pytest.mark.slow, pytest.mark.server]


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
@pytest.mark.parametrize("model", TEXT_MODELS)
def test_end_to_end_grpc_client_text(dec_server, refs, model, stream):
    results = e2e_client(dec_server.grpc_url, model, E2E_PROMPT, E2E_N, stream)
    for r in results:
        assert output_names(r) == ["text_output"], output_names(r)  # what the client asked for
    if stream:
        # pieces never repeat the prompt and add up to the greedy completion
        assert client_text(results, True) == refs.e2e.completion
    else:
        # the client's check: out == prompt + expected (exclude_input_in_output=False)
        assert client_text(results, False) == E2E_PROMPT + refs.e2e.completion == refs.e2e.full_text


@pytest.mark.parametrize("model", TEXT_MODELS)
def test_end_to_end_grpc_client_reads_text_output_as_output0(dec_server, refs, model):
    """The script reads each response as ``output = as_numpy('text_output'); output[0].decode('utf-8')``:
    that needs a 1-D tensor of one string per response (NVIDIA's postprocessing makes OUTPUT 1-D,
    B*W strings, and the ensemble passes it on). A [1,1] tensor makes output[0] an array and the
    script raises AttributeError."""
    for stream in (False, True):
        results = e2e_client(dec_server.grpc_url, model, E2E_PROMPT, 4, stream)
        for r in results:
            output = r.as_numpy("text_output")
            assert isinstance(output[0], bytes), (
                f"stream={stream}: text_output shape {list(output.shape)}: output[0] is "
                f"{type(output[0]).__name__}, NVIDIA's client calls output[0].decode('utf-8')")
            output[0].decode("utf-8")


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
@pytest.mark.parametrize("model", TEXT_MODELS)
def test_end_to_end_grpc_client_return_log_probs(dec_server, refs, model, stream):
    results = e2e_client(dec_server.grpc_url, model, E2E_PROMPT, E2E_N, stream, return_log_probs=True)
    lps = []
    for r in results:
        assert set(output_names(r)) == {"text_output", "cum_log_probs", "output_log_probs"}, output_names(r)
        cum, olp = r.as_numpy("cum_log_probs"), r.as_numpy("output_log_probs")
        assert cum.dtype == np.float32 and cum.shape == (1, 1), (cum.dtype, cum.shape)
        assert olp.dtype == np.float32 and olp.ndim == 3 and olp.shape[:2] == (1, 1), (olp.dtype, olp.shape)
        lps.extend(olp[0, 0].tolist())
    G = len(refs.e2e.ids)
    assert len(lps) == G
    np.testing.assert_allclose(lps, refs.e2e.logprobs, rtol=1e-4, atol=1e-4)
    if stream:
        assert client_text(results, True) == refs.e2e.completion
    else:
        [r] = results  # one response when not streaming
        assert r.as_numpy("output_log_probs").shape == (1, 1, G)
        cum = float(r.as_numpy("cum_log_probs")[0, 0])
        assert cum == pytest.approx(float(np.sum(r.as_numpy("output_log_probs"), dtype=np.float64)),
                                    rel=1e-5, abs=1e-4)
        assert client_text(results, False) == refs.e2e.full_text


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
@pytest.mark.parametrize("model", TEXT_MODELS)
def test_end_to_end_grpc_client_stop_words(dec_server, refs, model, stream):
    """--stop-words W1 W2: stop_words [1,2] BYTES; generation ends after the first match and the
    stop word stays in the text (TensorRT-LLM's semantics)."""
    results = e2e_client(dec_server.grpc_url, model, E2E_PROMPT, E2E_N, stream,
                         stop_words=[refs.stop_word, NO_SUCH_WORD])
    if stream:
        assert client_text(results, True) == refs.stop_completion
    else:
        assert client_text(results, False) == refs.stop_full_text
    assert refs.stop_full_text.endswith(refs.stop_word) and len(refs.stop_full_text) < len(refs.e2e.full_text)


@pytest.mark.parametrize("model", TEXT_MODELS)
def test_end_to_end_grpc_client_embedding_bias(dec_server, refs, model):
    """--embedding-bias-words W --embedding-bias-weights -100: embedding_bias_words [1,1] BYTES and
    embedding_bias_weights [1,1] FP32. The word is the greedy answer's first token: biased down, the
    greedy answer must start with another token; a word the answer never reaches changes nothing."""
    first = refs.tok.decode([refs.e2e.ids[0]])
    assert refs.tok.words([first]) == [[refs.e2e.ids[0]]], "the first token must be a word of its own"
    results = e2e_client(dec_server.grpc_url, model, E2E_PROMPT, E2E_N, False, embedding_bias=([first], [-100.0]))
    text = client_text(results, False)
    assert text.startswith(E2E_PROMPT) and not text[len(E2E_PROMPT):].startswith(first), text
    results = e2e_client(dec_server.grpc_url, model, E2E_PROMPT, E2E_N, False,
                         embedding_bias=([NO_SUCH_WORD], [-5.0]))  # tokens it never picks: lowered, same answer
    assert client_text(results, False) == refs.e2e.full_text




@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
@pytest.mark.parametrize("model", TEXT_MODELS)
def test_end_to_end_grpc_client_return_logits(dec_server, refs, model, stream):
    """--return-context-logits --return-generation-logits: two BOOL [1,1] inputs; the script names
    context_logits and generation_logits as outputs. Context logits [1, prompt, vocab] come once (the
    first response), generation logits [1, 1, n, vocab] with each response's tokens: their argmax is
    the greedy answer, and their log-softmax at each token is the engine's own log-probability."""
    results = e2e_client(dec_server.grpc_url, model, E2E_PROMPT, E2E_N, stream,
                         return_context_logits=True, return_generation_logits=True)
    V, L, G = refs.vocab_size, len(refs.e2e.prompt_ids), len(refs.e2e.ids)
    ctx = [r.as_numpy("context_logits") for r in results]
    gen = [r.as_numpy("generation_logits") for r in results]
    assert all(c is not None and c.dtype == np.float32 for c in ctx + gen)
    assert ctx[0].shape == (1, L, V), ctx[0].shape
    assert all(c.size == 0 for c in ctx[1:])          # sent once
    assert all(g.ndim == 4 and g.shape[:2] == (1, 1) for g in gen), [g.shape for g in gen]
    rows = np.concatenate([g[0, 0] for g in gen if g.size])
    assert rows.shape == (G, V)
    assert rows.argmax(-1).tolist() == refs.e2e.ids
    z = rows.astype(np.float64)
    logz = z.max(-1) + np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1))
    np.testing.assert_allclose(z[np.arange(G), refs.e2e.ids] - logz, refs.e2e.logprobs, atol=1e-4, rtol=1e-4)
    # the last prompt position predicts the first token: the same row in both
    np.testing.assert_allclose(ctx[0][0, -1], rows[0], atol=1e-5, rtol=1e-5)
    assert client_text(results, stream) == (refs.e2e.completion if stream else refs.e2e.full_text)


@pytest.mark.parametrize("model", TEXT_MODELS)
def test_inputs_kiln_cannot_honour_pass_when_neutral_and_are_refused_otherwise(dec_server, refs, model):
    """NVIDIA's ensemble/bls inputs for LoRA, prompt tables, external drafts, beam search: declared
    (Triton would otherwise answer "unexpected inference input"), neutral values change nothing, any
    other value is an error naming the input and what Kiln lacks."""
    import tritonclient.grpc as grpcclient
    base = e2e_client_arrays(E2E_PROMPT, E2E_N, False)
    neutral = {"length_penalty": np.array([[1.0]], np.float32), "num_draft_tokens": np.array([[0]], np.int32),
               "lookahead_window_size": np.array([[0]], np.int32),
               "lora_weights": np.zeros((1, 0, 8), np.float16), "early_stopping": np.array([[True]])}
    [(result, error)] = run_stream(dec_server.grpc_url, [(model, [tensor(grpcclient, k, v) for k, v in {**base, **neutral}.items()],
                                                         dict(outputs=e2e_client_outputs()))])
    assert error is None, str(error)
    assert client_text([result], False) == refs.e2e.full_text
    for name, value, why in (("lora_task_id", np.array([[5]], np.uint64), "Kiln serves no LoRA adapters"),
                             ("prompt_vocab_size", np.array([[8]], np.int32), "prompt tables"),
                             ("num_draft_tokens", np.array([[4]], np.int32), "EAGLE-3")):
        results = run_stream(dec_server.grpc_url, [(model, [tensor(grpcclient, k, v) for k, v in {**base, name: value}.items()],
                                                    dict(outputs=e2e_client_outputs()))])
        errors = errors_of(results)
        assert errors and f"input '{name}'" in errors[0] and why in errors[0], (name, errors)


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
@pytest.mark.parametrize("model", TEXT_MODELS)
def test_end_to_end_grpc_client_guided_decoding(dec_server, refs, model, stream):
    """--guided-decoding-guide-type json_schema --guided-decoding-guide SCHEMA: two BYTES [1, 1]
    inputs; the completion is JSON that validates against the schema. A guide that does not compile
    is an error naming it."""
    import json

    import jsonschema
    import tritonclient.grpc as grpcclient
    from harness.perf.grammar import SCHEMAS
    schema = SCHEMAS["person"]
    arrays = {**e2e_client_arrays(E2E_PROMPT, 48, stream),
              "guided_decoding_guide_type": np.array([[b"json_schema"]], dtype=object),
              "guided_decoding_guide": np.array([[json.dumps(schema).encode()]], dtype=object)}
    results = run_stream(dec_server.grpc_url, [(model, [tensor(grpcclient, k, v) for k, v in arrays.items()],
                                                dict(outputs=e2e_client_outputs()))])
    assert not errors_of(results), errors_of(results)
    text = client_text([r for r, _ in results], stream)
    completion = text if stream else text[len(E2E_PROMPT):]
    assert stream or text.startswith(E2E_PROMPT)
    jsonschema.validate(json.loads(completion), schema)
    arrays["guided_decoding_guide"] = np.array([[b"{not json"]], dtype=object)
    errors = errors_of(run_stream(dec_server.grpc_url, [(model, [tensor(grpcclient, k, v) for k, v in arrays.items()],
                                                         dict(outputs=e2e_client_outputs()))]))
    assert errors and "json_schema guide does not compile" in errors[0], errors
