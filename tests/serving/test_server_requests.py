"""The answers of the rendered repository on a real Triton server (one per module, free ports, real
SmolLM2): greedy text over HTTP, SSE and gRPC streams matches the in-process executor, multibyte
characters stream intact, stop words end the text, and NVIDIA's request parameters (neutral values,
beams, the engine model's tensorrt_llm input names) are honoured or refused by name.

Concurrency, cancellation, invalid requests, metrics and model unload/reload: test_server.py.
"""
from __future__ import annotations

import numpy as np
import pytest

from harness.model_names import DEFAULT as NAMES
from harness.serving_client import GenerateError, http_generate, http_stream
from tests.serving.conftest import PROMPTS
from tests.serving.server_helpers import MODELS, _streams, run

pytestmark = [pytest.mark.slow, pytest.mark.server]

# under 16 tokens (one KV block) so no request reuses a cached prefix: every greedy run then does
# exactly the same arithmetic as the in-process reference
EMOJI_PROMPT = "List of fruit emoji: 🍎 🍌 🍇"


@pytest.mark.parametrize("model", MODELS)
def test_greedy_http_and_grpc_stream_match_the_executor(reference, triton_server, model):
    for key, (text, n) in PROMPTS.items():
        body = http_generate(triton_server.http_url, model, text, max_tokens=n, temperature=0.0,
                             exclude_input_in_output=True)
        assert body["text_output"] == reference[key]
        res = run(_streams(triton_server.grpc_url, [(model, text, dict(max_tokens=n, temperature=0.0))]))[0]
        assert res.error is None and len(res.pieces) > 1  # really streamed, piece by piece
        assert res.text == reference[key]
    # the default echoes the prompt in a non-streamed answer (tensorrtllm_backend behaviour)
    text, n = PROMPTS["paris"]
    assert http_generate(triton_server.http_url, model, text, max_tokens=n, temperature=0.0)["text_output"] \
        == text + reference["paris"]
    sse = "".join(e["text_output"] for e in http_stream(triton_server.http_url, model, text, max_tokens=n,
                                                         temperature=0.0))
    assert sse == reference["paris"]


@pytest.mark.parametrize("model", MODELS)
def test_multibyte_characters_stream_intact(triton_server, model):
    kw = dict(max_tokens=24, temperature=0.0)
    whole = http_generate(triton_server.http_url, model, EMOJI_PROMPT, exclude_input_in_output=True, **kw)
    res = run(_streams(triton_server.grpc_url, [(model, EMOJI_PROMPT, kw)]))[0]
    assert any(ord(c) > 0xFFFF for c in res.text), "the model produced no 4-byte character to test with"
    assert all("\ufffd" not in p for p in res.pieces)
    assert res.text == whole["text_output"]


@pytest.mark.parametrize("model", MODELS)
def test_stop_words_end_the_text_and_stay_in_it(reference, text_tokenizer, triton_server, model):
    # NVIDIA's semantics: the stop word is matched on token ids and kept in the output
    text, n = PROMPTS["paris"]
    cut = reference["paris"].index(".") + 1
    assert 0 < cut < len(reference["paris"])
    body = http_generate(triton_server.http_url, model, text, max_tokens=n, temperature=0.0,
                         exclude_input_in_output=True, stop_words=["."])
    assert body["text_output"] == reference["paris"][:cut]
    res = run(_streams(triton_server.grpc_url, [(model, text, dict(max_tokens=n, temperature=0.0,
                                                                    stop_words=["."]))]))[0]
    assert res.text == reference["paris"][:cut]


@pytest.mark.parametrize("model", MODELS)
def test_nvidia_neutral_values_give_the_greedy_text(reference, triton_server, model):
    text, n = PROMPTS["paris"]
    kw = dict(max_tokens=n, exclude_input_in_output=True)
    # end_id/pad_id -1 = the model's own; top_p 0 with top_k 1 (NVIDIA's samples) and with top_k 0 = greedy;
    # beam_width / num_return_sequences 1 accepted
    for extra in (dict(temperature=0.0, end_id=-1, pad_id=-1), dict(top_k=1, top_p=0.0),
                  dict(top_k=0, top_p=0.0), dict(temperature=0.0, beam_width=1, num_return_sequences=1)):
        body = http_generate(triton_server.http_url, model, text, **kw, **extra)
        assert body["text_output"] == reference["paris"], extra
    res = run(_streams(triton_server.grpc_url, [(model, text, dict(max_tokens=n, top_k=1, top_p=0.0, end_id=-1))]))[0]
    assert res.error is None and res.text == reference["paris"]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("name, message", [
    ("beam_width", "input 'beam_width': 2 is not supported (Kiln decodes one beam); allowed: 1"),
    ("num_return_sequences", "input 'num_return_sequences': 2 is not supported (Kiln returns one sequence "
                             "per request); allowed: 1"),
])
def test_beam_width_and_num_return_sequences_above_one_are_refused(triton_server, model, name, message):
    with pytest.raises(GenerateError) as e:
        http_generate(triton_server.http_url, model, "Hello", max_tokens=4, **{name: 2})
    assert message in str(e.value)


def _engine_stream(url, ids, **extra):
    """One streaming request to the engine model with NVIDIA's tensor names; (ids, last text_trim, error)."""
    import tritonclient.grpc as g
    import tritonclient.grpc.aio as aio
    types = {np.dtype(bool): "BOOL", np.dtype(np.int32): "INT32", np.dtype(np.float32): "FP32",
             np.dtype(np.uint64): "UINT64", np.dtype(object): "BYTES"}
    inputs = []
    for name, arr in dict(input_ids=np.array(ids, np.int32), streaming=np.array([True]), **extra).items():
        arr = arr[None]  # the batch dimension (max_batch_size > 0, as NVIDIA's models)
        inp = g.InferInput(name, list(arr.shape), types[arr.dtype])
        inp.set_data_from_numpy(arr)
        inputs.append(inp)

    async def go():
        client = aio.InferenceServerClient(url)

        async def reqs():
            yield {"model_name": NAMES.engine, "inputs": inputs}
        out, trim, err = [], 0, None
        try:
            async for result, error in client.stream_infer(reqs()):
                if error is not None:
                    err = str(error)
                    break
                if result.as_numpy("output_ids") is not None:
                    out += result.as_numpy("output_ids").reshape(-1).tolist()
                    trim = int(result.as_numpy("text_trim").reshape(-1)[0])
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
        finally:
            await client.close()
        return out, trim, err
    return run(go())


def test_engine_model_takes_nvidia_names_and_stop_semantics(reference, text_tokenizer, triton_server):
    from backend.serving.conversion.convert import to_words_list
    text, n = PROMPTS["paris"]
    ids = text_tokenizer.encode(text)
    i32 = lambda v: np.array([v], np.int32)  # noqa: E731
    base = dict(request_output_len=i32(n))
    # NVIDIA's tensorrt_llm names and neutral values: greedy (runtime_top_k 1, runtime_top_p 0)
    out, _, err = _engine_stream(triton_server.grpc_url, ids, **base, runtime_top_k=i32(1),
                                 runtime_top_p=np.array([0.0], np.float32),
                                 random_seed=np.array([2**64 - 1], np.uint64), end_id=i32(-1), pad_id=i32(-1),
                                 beam_width=i32(1), num_return_sequences=i32(1))
    assert err is None and text_tokenizer.decode(out).rstrip("\ufffd") == reference["paris"]
    cut = reference["paris"].index(".") + 1
    # stop_words_list: token ids, the stop word kept
    out, trim, err = _engine_stream(triton_server.grpc_url, ids, **base, runtime_top_k=i32(1), runtime_top_p=np.array([0.0], np.float32),
                                    stop_words_list=to_words_list(text_tokenizer.words(["."])))
    assert err is None and trim == 0 and text_tokenizer.decode(out) == reference["paris"][:cut]
    # Kiln's stop_strings: substrings of the text, cut before the match
    out, trim, err = _engine_stream(triton_server.grpc_url, ids, **base, temperature=np.array([0.0], np.float32),
                                    stop_strings=np.array([b"."], dtype=object))
    full = text_tokenizer.decode(out)
    assert err is None and full[: len(full) - trim] == reference["paris"][:cut - 1]
    _, _, err = _engine_stream(triton_server.grpc_url, ids, **base, beam_width=i32(2))
    assert err is not None and "input 'beam_width': 2 is not supported (Kiln decodes one beam); allowed: 1" in err
