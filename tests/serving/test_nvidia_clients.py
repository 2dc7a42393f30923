"""NVIDIA's four tensorrtllm_backend client scripts, request for request, against the real Triton
server on Kiln repositories built with NVIDIA's model names.

Each test sends what one of NVIDIA's scripts sends (model names, tensor names, datatypes, shapes
with the batch dimension, call kinds) and checks what comes back, not only that no error came back:

* ``end_to_end_grpc_client.py``: one gRPC stream per request to ``ensemble`` / ``tensorrt_llm_bls``
  (also when not streaming), ``text_input`` [1,1] ... ``exclude_input_in_output`` [[False]];
  ``--return-log-probs``; ``--stop-words``.
* ``inflight_batcher_llm_client.py``: token ids to ``tensorrt_llm``; one-shot ``async_infer``
  (non-decoupled build), a stream (decoupled build), and a ``stop`` request on the same stream.
* ``end_to_end_test.py``: preprocessing -> tensorrt_llm -> postprocessing by hand, then ``ensemble``
  and ``tensorrt_llm_bls``, over HTTP and gRPC ``infer`` (non-decoupled build); same text, same
  log probabilities.
* ``benchmark_core_model.py``: concurrent ``async_infer`` to ``tensorrt_llm`` over HTTP and gRPC
  with ``request_id=str(i)``, including the synthetic workload's random ids far past the vocabulary.

Expected tokens come from the in-process engine (``Executor``, greedy) on the same bundle: NVIDIA's
defaults (``temperature`` 1.0 with no top-k/top-p, or ``runtime_top_k`` 1 / ``runtime_top_p`` 0)
decode greedily. Every prompt is shorter than one KV block (16 tokens), so no cached prefix changes
the arithmetic between requests. Streams are read to their end (READ_TO_THE_END in
harness/serving_client.py): ``stop_stream()`` waits for the server to end the stream.
"""
from __future__ import annotations

import dataclasses
import json
import queue
import re
import threading
import uuid
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness.model_names import DEFAULT as NAMES, repository_names

from tests.serving.conftest import SERVING_CONFIG, SERVING_OVERRIDES

pytestmark = [pytest.mark.slow, pytest.mark.server]

STREAM_TIMEOUT = 300.0  # seconds; a stream the server never ends becomes an error, not a hang

# end_to_end_grpc_client.py: -p PROMPT -o N (ASCII completion, no end token within N)
E2E_PROMPT, E2E_N = "Once upon a time, there was a", 12
# inflight_batcher_llm_client.py: its default --text and --request-output-len
IB_TEXT, IB_N = "Born in north-east France, Soyer trained as a", 16
STOP_N = 200  # the stopped request: far more than it gets to generate before the stop arrives
# end_to_end_test.py: one dataset prompt
ETE_PROMPT, ETE_N = "Photosynthesis is the process by which", 10
# benchmark_core_model.py: dataset prompts (tokenizer ids) and synthetic random ids
BENCH_PROMPTS = ("The quick brown fox", "In the beginning, the universe was", "The best way to learn a language is",
                 "Photosynthesis is the process by which", "Once upon a time, there was a", "The capital of France is")
BENCH_N, BENCH_RANDOM = 8, (2, 5)  # request indices that carry random ids (of 8)
NO_SUCH_WORD = " zebra crossing"   # a stop word that never occurs in the completions


# ------------------------------------------------------------------------------------------------
# builds, servers, expected outputs

@pytest.fixture(scope="module")
def nd_build(build_bundle) -> Path:
    """serving.decoupled=false (NVIDIA's decoupled_mode=false): HTTP infer and one-shot gRPC infer."""
    root = Path(build_bundle(SERVING_CONFIG, [*SERVING_OVERRIDES, "serving.decoupled=false"])).parent
    assert repository_names(root / "model_repository") == NAMES
    return root


@pytest.fixture(scope="module")
def dec_build(serving_build) -> Path:
    """The default build: decoupled (streaming) engine and bls models, NVIDIA's names."""
    assert repository_names(serving_build / "model_repository") == NAMES
    return serving_build


def _server(build: Path):
    from harness.serving_server import TritonServer
    return TritonServer(build / "model_repository", model_control="explicit",
                        load_models=tuple(NAMES.as_dict().values()), exit_timeout=3)


@pytest.fixture(scope="module")
def dec_server(dec_build):
    with _server(dec_build) as srv:
        yield srv


@pytest.fixture(scope="module")
def nd_server(nd_build):
    with _server(nd_build) as srv:
        yield srv


@dataclasses.dataclass
class Ref:
    """The in-process engine's greedy answer to one prompt."""
    prompt: str
    prompt_ids: list[int]
    ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    full_text: str     # decode(prompt ids + generated ids), special tokens skipped
    completion: str    # full_text without the decoded prompt


@dataclasses.dataclass
class Refs:
    tok: Any
    eos: int
    vocab_size: int
    e2e: Ref
    ib: Ref
    ete: Ref
    bench: list[Ref]
    stop_word: str          # a word of e2e's completion: one token, first seen at position stop_at
    stop_at: int
    stop_full_text: str     # decode(prompt + generated[:stop_at + 1]): the stop word stays in
    stop_completion: str


@pytest.fixture(scope="module")
def refs(dec_build) -> Refs:
    from backend.engine.executor import Executor
    from backend.engine.sampling_params import SamplingParams
    from backend.serving.tokenizer import load_tokenizer
    engine_dir = dec_build / "engine"
    tok = load_tokenizer(engine_dir)
    # what NVIDIA's clients do: encode(eos_token, add_special_tokens=False)[0]
    eos = tok.tokenizer.encode(tok.special["eos_token"], add_special_tokens=False).ids[0]
    assert eos in json.loads((engine_dir / "engine.json").read_text())["model"]["eos_token_ids"]
    jobs = [(E2E_PROMPT, E2E_N), (IB_TEXT, IB_N), (ETE_PROMPT, ETE_N)] + [(p, BENCH_N) for p in BENCH_PROMPTS]
    ex = Executor(engine_dir, start=False)
    try:
        ids = [tok.encode(p) for p, _ in jobs]
        results = ex.generate(ids, [SamplingParams(max_tokens=n, temperature=0.0, logprobs=1) for _, n in jobs])
    finally:
        ex.shutdown()
        del ex
    out = []
    for (prompt, n), pids, res in zip(jobs, ids, results):
        assert res.error is None, res.error
        assert len(pids) < 16, f"{prompt!r}: {len(pids)} tokens, more than one KV block"
        # every prompt is chosen so that greedy decoding runs to its length (no end token)
        assert res.finish_reason == "length" and len(res.token_ids) == n, (prompt, res)
        full = tok.decode(pids + list(res.token_ids))
        assert tok.decode(pids) == prompt and full.startswith(prompt), (prompt, full)
        lps = [float(lp[0] if isinstance(lp, (list, tuple)) else lp) for lp in res.logprobs]
        out.append(Ref(prompt, pids, list(res.token_ids), lps, res.finish_reason, full, full[len(prompt):]))
    e2e = out[0]
    # --stop-words: a word of the completion that is one token on its own (tokenized as NVIDIA's
    # preprocessing does: no special tokens), not generated before position k >= 2
    for k in range(2, len(e2e.ids)):
        word = tok.decode([e2e.ids[k]])
        if word.strip() and tok.words([word]) == [[e2e.ids[k]]] and e2e.ids[k] not in e2e.ids[:k]:
            break
    else:
        raise AssertionError(f"no single-token stop word in {e2e.completion!r}")
    stop_full = tok.decode(e2e.prompt_ids + e2e.ids[: k + 1])
    assert NO_SUCH_WORD not in e2e.full_text
    return Refs(tok, eos, tok.vocab_size, e2e, out[1], out[2], out[3:], word, k, stop_full,
                stop_full[len(E2E_PROMPT):])


# ------------------------------------------------------------------------------------------------
# helpers

def tensor(mod, name: str, arr: np.ndarray):
    """NVIDIA's prepare_tensor: the numpy array's own shape and datatype."""
    from tritonclient.utils import np_to_triton_dtype
    inp = mod.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
    inp.set_data_from_numpy(arr)
    return inp


def one_text(arr: np.ndarray | None, what: str = "text_output") -> str:
    """The single string of a B=1 text tensor (shape [1] or [1,1])."""
    assert arr is not None, f"no {what} in the response"
    assert arr.size == 1 and arr.shape[0] == 1, f"{what}: shape {list(arr.shape)}, expected one string"
    return arr.reshape(-1)[0].decode("utf-8")


def errors_of(results) -> list[str]:
    return [str(e) for r, e in results if e is not None]


def run_stream(url: str, sends: list[tuple[str, list, dict]]) -> list[tuple[Any, Any]]:
    """One gRPC stream, NVIDIA-style: start_stream, async_stream_infer for each (model, inputs,
    kwargs), stop_stream() (which waits for the server to end the stream). Every (result, error)."""
    import tritonclient.grpc as grpcclient
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    try:
        client.start_stream(callback=lambda result, error: got.put((result, error)), stream_timeout=STREAM_TIMEOUT)
        for model, inputs, kwargs in sends:
            client.async_stream_infer(model, inputs, **kwargs)
        client.stop_stream()
    finally:
        client.close()
    out = []
    while not got.empty():
        out.append(got.get())
    return out


def is_final(result) -> bool:
    p = result.get_response().parameters.get("triton_final_response")
    return p is not None and p.bool_param


def output_names(result) -> list[str]:
    return [o.name for o in result.get_response().outputs]


# ---- end_to_end_grpc_client.py -----------------------------------------------------------------

def e2e_client_arrays(prompt: str, n: int, stream: bool, *, return_log_probs: bool = False,
                      stop_words: list[str] | None = None,
                      embedding_bias: tuple[list[str], list[float]] | None = None) -> dict[str, np.ndarray]:
    """What end_to_end_grpc_client.py's prepare_inputs sends by default (+ the flags given)."""
    arrays = {
        "text_input": np.array([[prompt]]).astype(object),
        "max_tokens": np.array([[n]], dtype=np.int32),
        "stream": np.array([[stream]], dtype=bool),
        "beam_width": np.array([[1]], dtype=np.int32),
        "temperature": np.array([[1.0]], dtype=np.float32),
    }
    if stop_words:
        arrays["stop_words"] = np.array([stop_words], dtype=object)
    if return_log_probs:
        arrays["return_log_probs"] = np.array([[True]], dtype=bool)
    if embedding_bias is not None:  # --embedding-bias-words W... --embedding-bias-weights X...
        arrays["embedding_bias_words"] = np.array([embedding_bias[0]], dtype=object)
        arrays["embedding_bias_weights"] = np.array([embedding_bias[1]], dtype=np.float32)
    arrays["exclude_input_in_output"] = np.array([[False]], dtype=bool)
    return arrays


def e2e_client_inputs(prompt: str, n: int, stream: bool, **flags) -> list:
    import tritonclient.grpc as grpcclient
    return [tensor(grpcclient, k, v) for k, v in e2e_client_arrays(prompt, n, stream, **flags).items()]


def e2e_client_outputs(return_log_probs: bool = False) -> list:
    import tritonclient.grpc as grpcclient
    names = ["text_output"] + (["cum_log_probs", "output_log_probs"] if return_log_probs else [])
    return [grpcclient.InferRequestedOutput(n) for n in names]


def e2e_client(url: str, model: str, prompt: str, n: int, stream: bool, request_id: str = "1",
               **flags) -> list[Any]:
    """One prompt the way end_to_end_grpc_client.py sends it (a stream even when not streaming);
    fails on an error response. Returns the results in arrival order."""
    results = run_stream(url, [(model, e2e_client_inputs(prompt, n, stream, **flags),
                                dict(outputs=e2e_client_outputs(flags.get("return_log_probs", False)),
                                     request_id=request_id))])
    assert not errors_of(results), errors_of(results)
    assert results, "no response"
    return [r for r, _ in results]


def client_text(results: list, stream: bool) -> str:
    """The client's text: streamed pieces appended; otherwise each response replaces the text."""
    text = ""
    for r in results:
        piece = one_text(r.as_numpy("text_output"))
        text = text + piece if stream else piece
    return text


TEXT_MODELS = [NAMES.ensemble, NAMES.bls]


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


# ---- inflight_batcher_llm_client.py ------------------------------------------------------------

def ib_inputs(ids: list[int], n: int, streaming: bool, eos: int, *, return_log_probs: bool = False,
              extra: dict[str, np.ndarray] | None = None) -> list:
    """What inflight_batcher_llm_client.py's prepare_inputs sends by default."""
    import tritonclient.grpc as grpcclient
    arrays = {
        "input_ids": np.array([ids], dtype=np.int32),
        "input_lengths": np.array([[len(ids)]], dtype=np.int32),
        "request_output_len": np.array([[n]], dtype=np.int32),
        "beam_width": np.array([[1]], dtype=np.int32),
        "temperature": np.array([[1.0]], dtype=np.float32),
        "streaming": np.array([[streaming]], dtype=bool),
        "end_id": np.array([[eos]], dtype=np.int32),
        "pad_id": np.array([[eos]], dtype=np.int32),
        "return_log_probs": np.array([[return_log_probs]], dtype=bool),
        "runtime_top_k": np.array([[1]], dtype=np.int32),
        "runtime_top_p": np.array([[0.0]], dtype=np.float32),
        **(extra or {}),
    }
    return [tensor(grpcclient, k, v) for k, v in arrays.items()]


def ib_stop_inputs() -> list:
    """The client's stop request: dummy input_ids [1,1] (np.empty there: any value), zero lengths, stop."""
    import tritonclient.grpc as grpcclient
    arrays = {"input_ids": np.array([[1234567]], dtype=np.int32),
              "input_lengths": np.zeros([1, 1], dtype=np.int32),
              "request_output_len": np.array([[0]], dtype=np.int32),
              "stop": np.array([[True]], dtype=bool)}
    return [tensor(grpcclient, k, v) for k, v in arrays.items()]


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


# ---- end_to_end_test.py ------------------------------------------------------------------------

def _client_module(protocol: str):
    if protocol == "http":
        import tritonclient.http as mod
    else:
        import tritonclient.grpc as mod
    return mod


def _client(srv, protocol: str):
    mod = _client_module(protocol)
    if protocol == "http":
        return mod.InferenceServerClient(srv.http_url, concurrency=8, network_timeout=STREAM_TIMEOUT,
                                         connection_timeout=STREAM_TIMEOUT)
    return mod.InferenceServerClient(srv.grpc_url)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_end_to_end_test_functionality(nd_server, refs, protocol):
    """end_to_end_test.py (test_functionality_ifb with --return-log-probs and --test-bls)."""
    mod = _client_module(protocol)
    ref = refs.ete
    L = len(ref.prompt_ids)
    client = _client(nd_server, protocol)
    try:
        # 1. preprocessing
        pre = client.infer("preprocessing", [
            tensor(mod, "QUERY", np.array([[ETE_PROMPT]]).astype(object)),
            tensor(mod, "BAD_WORDS_DICT", np.array([[""]]).astype(object)),
            tensor(mod, "STOP_WORDS_DICT", np.array([[""]]).astype(object)),
            tensor(mod, "REQUEST_OUTPUT_LEN", np.array([[ETE_N]], dtype=np.int32)),
        ], request_id="0")
        input_id = pre.as_numpy("INPUT_ID")
        request_input_len = pre.as_numpy("REQUEST_INPUT_LEN")
        request_output_len = pre.as_numpy("REQUEST_OUTPUT_LEN")
        decoder_input_id = pre.as_numpy("DECODER_INPUT_ID")
        end_id, pad_id = pre.as_numpy("OUT_END_ID"), pre.as_numpy("OUT_PAD_ID")
        assert input_id.dtype == np.int32 and input_id.tolist() == [ref.prompt_ids], input_id
        assert request_input_len.dtype == np.int32 and request_input_len.tolist() == [[L]]
        assert request_output_len.dtype == np.int32 and request_output_len.tolist() == [[ETE_N]]
        assert decoder_input_id.dtype == np.int32 and decoder_input_id.shape == (1, 1), decoder_input_id.shape
        # no END_ID sent: the tokenizer's end id (the contract; NVIDIA's preprocessing does the same)
        assert end_id.dtype == np.int32 and end_id.tolist() == [[refs.eos]], \
            f"OUT_END_ID {end_id.tolist()}, expected the tokenizer's end id [[{refs.eos}]]"
        assert pad_id.dtype == np.int32 and pad_id.shape == (1, 1), pad_id

        # 2. tensorrt_llm, no outputs named (all of them)
        eng = client.infer("tensorrt_llm", [
            tensor(mod, "input_ids", input_id),
            tensor(mod, "decoder_input_ids", decoder_input_id),
            tensor(mod, "input_lengths", request_input_len),
            tensor(mod, "request_output_len", request_output_len),
            tensor(mod, "end_id", end_id),
            tensor(mod, "pad_id", pad_id),
            tensor(mod, "return_log_probs", np.array([[True]], dtype=bool)),
        ], request_id="0")
        output_ids = eng.as_numpy("output_ids").astype(np.int32)
        sequence_length = eng.as_numpy("sequence_length")
        cum_log_probs = eng.as_numpy("cum_log_probs").astype(np.float32)
        output_log_probs = eng.as_numpy("output_log_probs").astype(np.float32)
        assert output_ids.shape == (1, 1, L + ETE_N) and sequence_length.tolist() == [[L + ETE_N]]
        assert output_ids[0, 0].tolist() == ref.prompt_ids + ref.ids
        assert cum_log_probs.shape == (1, 1) and output_log_probs.shape == (1, 1, ETE_N)
        np.testing.assert_allclose(output_log_probs[0, 0], ref.logprobs, rtol=1e-4, atol=1e-4)

        # 3. postprocessing
        post = client.infer("postprocessing", [
            tensor(mod, "TOKENS_BATCH", output_ids),
            tensor(mod, "SEQUENCE_LENGTH", sequence_length),
        ], request_id="0")
        output0 = post.as_numpy("OUTPUT")
        assert one_text(output0, "OUTPUT") == ref.full_text

        # 4. ensemble, 5. tensorrt_llm_bls (--test-bls): the same inputs and requested outputs
        text_inputs = [
            tensor(mod, "text_input", np.array([[ETE_PROMPT]]).astype(object)),
            tensor(mod, "max_tokens", np.array([[ETE_N]], dtype=np.int32)),
            tensor(mod, "bad_words", np.array([[""]]).astype(object)),
            tensor(mod, "stop_words", np.array([[""]]).astype(object)),
            tensor(mod, "return_log_probs", np.array([[True]], dtype=bool)),
        ]
        for model in (NAMES.ensemble, NAMES.bls):
            outputs = [mod.InferRequestedOutput(n) for n in ("text_output", "cum_log_probs", "output_log_probs")]
            res = client.infer(model, text_inputs, outputs=outputs, request_id="0")
            text_output = res.as_numpy("text_output")
            assert text_output.shape == output0.shape, (model, text_output.shape, output0.shape)
            assert (output0 == text_output).all(), (model, output0, text_output)  # the script's assert
            assert one_text(text_output) == ref.full_text
            ens_cum = res.as_numpy("cum_log_probs")
            ens_olp = res.as_numpy("output_log_probs")
            assert ens_cum.shape == cum_log_probs.shape and (cum_log_probs == ens_cum).all(), \
                (model, cum_log_probs, ens_cum)
            assert ens_olp.shape == output_log_probs.shape and (output_log_probs == ens_olp).all(), \
                (model, output_log_probs, ens_olp)
    finally:
        client.close()


# ---- benchmark_core_model.py -------------------------------------------------------------------

def _bench_requests(refs) -> list[dict]:
    """8 requests: dataset prompts (tokenizer ids, pad/end = the tokenizer's) and, at BENCH_RANDOM,
    the synthetic workload's ids (np.random.randint(0, 2**31 - 1), pad_id 0, end_id 1)."""
    rng = np.random.default_rng(420)
    out, prompts = [], iter(refs.bench)
    for i in range(8):
        if i in BENCH_RANDOM:
            ids = rng.integers(0, 2**31 - 1, size=12 + i, dtype=np.int32)
            out.append(dict(ids=ids, pad=0, end=1, ref=None))
        else:
            ref = next(prompts)
            out.append(dict(ids=np.array(ref.prompt_ids, dtype=np.int32), pad=refs.eos, end=refs.eos, ref=ref))
    return out


def _bench_inputs(mod, req: dict) -> list:
    ids = req["ids"]
    return [tensor(mod, "input_ids", ids[None, :]),
            tensor(mod, "input_lengths", np.array([[len(ids)]], dtype=np.int32)),
            tensor(mod, "request_output_len", np.array([[BENCH_N]], dtype=np.int32)),
            tensor(mod, "pad_id", np.array([[req["pad"]]], dtype=np.int32)),
            tensor(mod, "end_id", np.array([[req["end"]]], dtype=np.int32))]


def _check_bench_success(req: dict, name0: str, shape0: list[int], output_ids: np.ndarray) -> None:
    ref, L = req["ref"], len(req["ids"])
    assert name0 == "output_ids", name0          # extract_print_stats: outputs[0].shape[2]
    assert len(shape0) == 3 and shape0[:2] == [1, 1], shape0
    assert shape0[2] - L == BENCH_N, (shape0, L)
    assert output_ids[0, 0].tolist() == ref.prompt_ids + ref.ids


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_benchmark_core_model(nd_server, refs, protocol):
    mod = _client_module(protocol)
    reqs = _bench_requests(refs)
    client = _client(nd_server, protocol)
    try:
        outcomes: dict[int, tuple[Any, Any]] = {}
        if protocol == "http":
            futures = [client.async_infer("tensorrt_llm", _bench_inputs(mod, r), request_id=str(i))
                       for i, r in enumerate(reqs)]
            for i, f in enumerate(futures):
                try:
                    outcomes[i] = (f.get_result(), None)
                except mod.InferenceServerException as e:  # noqa: PERF203
                    outcomes[i] = (None, e)
        else:
            got: queue.Queue = queue.Queue()
            for i, r in enumerate(reqs):
                client.async_infer("tensorrt_llm", _bench_inputs(mod, r),
                                   callback=partial(lambda i, result, error: got.put((i, result, error)), i),
                                   request_id=str(i))
            for _ in reqs:
                i, result, error = got.get(timeout=STREAM_TIMEOUT)
                outcomes[i] = (result, error)
        assert sorted(outcomes) == list(range(len(reqs)))
        for i, req in enumerate(reqs):
            result, error = outcomes[i]
            if req["ref"] is None:
                assert result is None and error is not None, f"request {i}: random ids were accepted"
                assert "vocabulary" in str(error), f"request {i}: {error}"
                continue
            assert error is None, f"request {i}: {error}"
            if protocol == "http":
                resp = result.get_response()
                assert resp["id"] == str(i), resp.get("id")
                name0, shape0 = resp["outputs"][0]["name"], [int(d) for d in resp["outputs"][0]["shape"]]
            else:
                assert result.get_response().id == str(i)
                resp = result.get_response(as_json=True)
                assert resp["id"] == str(i)
                name0, shape0 = resp["outputs"][0]["name"], [int(d) for d in resp["outputs"][0]["shape"]]
            _check_bench_success(req, name0, shape0, result.as_numpy("output_ids"))
        # the server keeps serving: the warm-up request (request_output_len shortened)
        res = client.infer("tensorrt_llm", _bench_inputs(mod, reqs[0]))
        assert res.as_numpy("output_ids")[0, 0].tolist() == reqs[0]["ref"].prompt_ids + reqs[0]["ref"].ids
    finally:
        client.close()


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
