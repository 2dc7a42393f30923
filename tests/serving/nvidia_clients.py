"""Shared by the tests that replay NVIDIA's tensorrtllm_backend client scripts
(tests/serving/test_nvidia_*.py): the prompts, the in-process engine's expected answers, and the
request building and stream reading those scripts do. Written from the public scripts' requests
(tensor names, datatypes, shapes, call kinds), not copied from them.
"""
from __future__ import annotations

import dataclasses
import json
import queue
from pathlib import Path
from typing import Any

import numpy as np

from harness.model_names import DEFAULT as NAMES

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


def make_refs(dec_build: Path) -> Refs:
    """The in-process engine's greedy answers to every prompt the tests send (and the stop word)."""
    from backend.engine.executor import Executor
    from backend.engine.sampling_params import SamplingParams
    from backend.serving.conversion.tokenizer import load_tokenizer
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
                      embedding_bias: tuple[list[str], list[float]] | None = None,
                      return_context_logits: bool = False,
                      return_generation_logits: bool = False) -> dict[str, np.ndarray]:
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
    if return_context_logits:   # --return-context-logits
        arrays["return_context_logits"] = np.array([[True]], dtype=bool)
    if return_generation_logits:  # --return-generation-logits
        arrays["return_generation_logits"] = np.array([[True]], dtype=bool)
    if embedding_bias is not None:  # --embedding-bias-words W... --embedding-bias-weights X...
        arrays["embedding_bias_words"] = np.array([embedding_bias[0]], dtype=object)
        arrays["embedding_bias_weights"] = np.array([embedding_bias[1]], dtype=np.float32)
    arrays["exclude_input_in_output"] = np.array([[False]], dtype=bool)
    return arrays


def e2e_client_inputs(prompt: str, n: int, stream: bool, **flags) -> list:
    import tritonclient.grpc as grpcclient
    return [tensor(grpcclient, k, v) for k, v in e2e_client_arrays(prompt, n, stream, **flags).items()]


def e2e_client_outputs(return_log_probs: bool = False, return_context_logits: bool = False,
                       return_generation_logits: bool = False) -> list:
    """The outputs the script names: text, then those of the flags it was given."""
    import tritonclient.grpc as grpcclient
    names = (["text_output"] + (["cum_log_probs", "output_log_probs"] if return_log_probs else [])
             + (["context_logits"] if return_context_logits else [])
             + (["generation_logits"] if return_generation_logits else []))
    return [grpcclient.InferRequestedOutput(n) for n in names]


_OUTPUT_FLAGS = ("return_log_probs", "return_context_logits", "return_generation_logits")


def e2e_client(url: str, model: str, prompt: str, n: int, stream: bool, request_id: str = "1",
               **flags) -> list[Any]:
    """One prompt the way end_to_end_grpc_client.py sends it (a stream even when not streaming);
    fails on an error response. Returns the results in arrival order."""
    results = run_stream(url, [(model, e2e_client_inputs(prompt, n, stream, **flags),
                                dict(outputs=e2e_client_outputs(**{k: v for k, v in flags.items() if k in _OUTPUT_FLAGS}),
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


# ---- end_to_end_test.py ------------------------------------------------------------------------

def client_module(protocol: str):
    if protocol == "http":
        import tritonclient.http as mod
    else:
        import tritonclient.grpc as mod
    return mod


def protocol_client(srv, protocol: str):
    mod = client_module(protocol)
    if protocol == "http":
        return mod.InferenceServerClient(srv.http_url, concurrency=8, network_timeout=STREAM_TIMEOUT,
                                         connection_timeout=STREAM_TIMEOUT)
    return mod.InferenceServerClient(srv.grpc_url)
