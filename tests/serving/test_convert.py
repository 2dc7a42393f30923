"""Pure conversion: Triton tensors -> validated requests, with one-line errors (no server needed)."""
from __future__ import annotations

import numpy as np
import pytest

from backend import bundle
from backend.engine.sampling_params import SamplingParams
from backend.bundle_schema import ModelConfig
from backend.serving.conversion.convert import EngineLimits, InvalidRequest, from_words_list, to_words_list
from backend.serving.engine_model.engine_request import parse_engine_request
from backend.serving.text_models.postprocess import postprocess_tensors
from backend.serving.text_models.preprocess import Preprocessor, preprocessing_outputs

LIMITS = EngineLimits(max_input_len=32, max_seq_len=64)
# a SmolLM2-shaped manifest: the preprocessor reads the engine limits from it (through backend.bundle)
MANIFEST = bundle.Manifest(
    model=ModelConfig(architecture="llama", hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64, vocab_size=49152, rms_norm_eps=1e-5, rope_theta=100000.0,
                      max_position_embeddings=8192),
    quantization=bundle.Quantization("none"), engine=bundle.EngineSettings(max_input_len=64, max_seq_len=128))


@pytest.fixture(scope="module")
def pre(tokenizer_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("engine")
    bundle.write(d, MANIFEST)
    (d / "tokenizer").symlink_to(tokenizer_dir)
    return Preprocessor(d)


def text(s: str | bytes) -> np.ndarray:
    return np.array([s.encode() if isinstance(s, str) else s], dtype=object)


def f32(v):
    return np.array([v], dtype=np.float32)


def i32(v):
    return np.array([v], dtype=np.int32)


def test_defaults_and_engine_tensors(pre):
    prep = pre.prepare({"text_input": text("Hello there"), "stop_words": np.array([b"\n\n", b"END"], dtype=object)})
    assert prep.prompt_ids == pre.tokenizer.encode("Hello there")
    assert prep.values["max_tokens"] == 16 and prep.values["temperature"] == 1.0
    assert not prep.exclude_input  # non-streaming, input not excluded: NVIDIA's default
    out = preprocessing_outputs(prep)  # NVIDIA's names, batch dimension first
    assert out["INPUT_ID"].tolist() == [prep.prompt_ids] and out["REQUEST_INPUT_LEN"].tolist() == [[len(prep.prompt_ids)]]
    assert out["REQUEST_OUTPUT_LEN"].tolist() == [[16]] and out["EMBEDDING_BIAS"].shape == (1, 0)
    eos = pre.tokenizer.eos_id
    assert eos >= 0 and out["out_seed"].tolist() == [[-1]] and out["OUT_END_ID"].tolist() == [[eos]]
    assert out["OUT_PAD_ID"].tolist() == [[eos]] and out["out_exclude_input_in_output"].tolist() == [[False]]
    assert from_words_list("stop_words_list", out["STOP_WORDS_IDS"][0]) == pre.tokenizer.words(["\n\n", "END"])


def test_nvidia_preprocessing_names_and_empty_word_lists(pre):
    prep = pre.prepare_nvidia({"QUERY": text("Hi"), "REQUEST_OUTPUT_LEN": i32(5), "END_ID": i32(7),
                               "BAD_WORDS_DICT": text(""), "STOP_WORDS_DICT": text(""),
                               "EMBEDDING_BIAS_WORDS": text(""), "EMBEDDING_BIAS_WEIGHTS": f32(0.0)[:0]})
    assert prep.values["text_input"] == "Hi" and prep.values["max_tokens"] == 5 and prep.end_id == 7
    assert prep.stop_words_ids == [] and prep.bad_words_ids == []  # NVIDIA's [[""]] = no words
    assert prep.embedding_bias.shape == (0,)  # no word: no bias (NVIDIA's [B, 0])


def test_embedding_bias_words_become_nvidias_dense_bias_and_the_engines_logit_bias(pre, text_tokenizer):
    prep = pre.prepare_nvidia({"QUERY": text("Hi"), "EMBEDDING_BIAS_WORDS": np.array([b" Paris", b"cat"], dtype=object),
                               "EMBEDDING_BIAS_WEIGHTS": np.array([-5.0, 2.5], np.float32)})
    bias = preprocessing_outputs(prep)["EMBEDDING_BIAS"]
    assert bias.shape == (1, pre.vocab_size)
    paris, cat = pre.tokenizer.words([" Paris"])[0], pre.tokenizer.words(["cat"])[0]
    assert all(bias[0, t] == -5.0 for t in paris) and all(bias[0, t] == 2.5 for t in cat)
    assert np.count_nonzero(bias) == len(set(paris) | set(cat))
    req = parse_engine_request(prep.engine_tensors(), EngineLimits(64, 128), pre.vocab_size, text_tokenizer)
    assert dict(req.sampling["logit_bias"]) == {int(t): float(bias[0, t]) for t in np.nonzero(bias[0])[0]}
    for words, weights, message in (([b"cat"], [], "send one weight per word"),
                                    ([b"cat"], [float("inf")], "must be finite")):
        with pytest.raises(InvalidRequest, match=message):
            pre.prepare_nvidia({"QUERY": text("Hi"), "EMBEDDING_BIAS_WORDS": np.array(words, dtype=object),
                                "EMBEDDING_BIAS_WEIGHTS": np.array(weights, np.float32)})


def test_chat_or_exclude_leaves_the_prompt_out(pre):
    assert pre.prepare({"text_input": text("Hi"), "exclude_input_in_output": np.array([True])}).exclude_input
    assert pre.prepare({"text_input": text("Hi"), "apply_chat_template": np.array([True])}).exclude_input


@pytest.mark.parametrize("tensors, message", [
    ({}, "input 'text_input' is required"),
    ({"text_input": text(b"caf\xc3")}, "input 'text_input': not valid UTF-8"),
    ({"text_input": text(b"\xff\xfe")}, "not valid UTF-8"),
    ({"text_input": text("x"), "max_tokens": i32(0)}, "input 'max_tokens': 0 must be above 0"),
    ({"text_input": text("x"), "max_tokens": i32(-3)}, "input 'max_tokens'"),
    ({"text_input": text("x"), "max_tokens": i32(128)}, "input 'max_tokens': 128: more than the"),
    ({"text_input": text("word " * 80)}, "more than the engine's max_input_len=64"),
    ({"text_input": text("")}, "the prompt is empty"),
    ({"text_input": text("x"), "temperature": f32(-0.5)}, "input 'temperature': -0.5 is below 0"),
    ({"text_input": text("x"), "temperature": f32(np.nan)}, "is not finite"),
    ({"text_input": text("x"), "top_p": f32(-0.5)}, "input 'top_p': -0.5 is outside [0, 1]"),
    ({"text_input": text("x"), "top_p": f32(1.5)}, "input 'top_p': 1.5 is outside [0, 1]"),
    ({"text_input": text("x"), "end_id": i32(-2)}, "input 'end_id': -2 is below -1"),
    ({"text_input": text("x"), "beam_width": i32(2)},
     "input 'beam_width': 2 is not supported (Kiln decodes one beam); allowed: 1"),
    ({"text_input": text("x"), "num_return_sequences": i32(3)},
     "input 'num_return_sequences': 3 is not supported (Kiln returns one sequence per request); allowed: 1"),
    ({"text_input": text("x"), "top_k": i32(-1)}, "input 'top_k': -1 is below 0"),
    ({"text_input": text("x"), "min_tokens": i32(20)}, "input 'min_tokens': 20 exceeds max_tokens=16"),
    ({"text_input": text("x"), "repetition_penalty": f32(0.0)}, "input 'repetition_penalty'"),
    ({"text_input": text("x"), "max_tokens": f32(4.0)}, "input 'max_tokens': wrong dtype float32"),
    ({"text_input": np.array([1], dtype=np.int32)}, "input 'text_input': wrong dtype int32"),
    ({"text_input": text("x"), "max_tokens": np.array([4, 5], dtype=np.int32)}, "expected one value"),
    ({"text_input": np.array([b"a", b"b"], dtype=object)}, "expected one value (shape [1]), got shape [2]"),
    ({"text_input": text("x"), "stop_words": np.array([b"\xff"], dtype=object)}, "input 'stop_words'"),
    ({"text_input": text("x"), "frobnicate": i32(1)}, "unknown input 'frobnicate'"),
])
def test_invalid_text_requests(pre, tensors, message):
    with pytest.raises(InvalidRequest) as e:
        pre.prepare(tensors)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_chat_template_renders_chatml(pre):
    prep = pre.prepare({"text_input": text("What is 2+2?"), "apply_chat_template": np.array([True])})
    rendered = pre.tokenizer.decode(prep.prompt_ids)
    assert "What is 2+2?" in rendered and rendered != "What is 2+2?"
    assert pre.tokenizer.render_chat("Q").rstrip().endswith("assistant")


def engine_tensors(ids, **kw):
    t = {"input_ids": np.array(ids, dtype=np.int32), "request_output_len": i32(8)}
    t.update(kw)
    return t


def test_engine_request_round_trip(pre, text_tokenizer):
    prep = pre.prepare({"text_input": text("Hello"), "temperature": f32(0.0), "top_k": i32(5),
                        "seed": np.array([7], dtype=np.uint64), "stop_words": np.array([b"END"], dtype=object),
                        "bad_words": np.array([b" spam"], dtype=object), "return_log_probs": np.array([True])})
    req = parse_engine_request(prep.engine_tensors(), LIMITS, 49152, text_tokenizer)
    assert req.prompt_ids == prep.prompt_ids and not req.streaming and req.return_log_probs
    # NVIDIA's stop_words: token sequences (kept in the output), no text stop strings
    assert req.stop_strings == () and req.stop_ids == tuple(tuple(w) for w in text_tokenizer.words(["END"]))
    params = SamplingParams(**req.sampling)
    params.validate(LIMITS.max_seq_len - len(req.prompt_ids), 49152)
    assert (params.temperature, params.top_k, params.seed, params.logprobs) == (0.0, 5, 7, 1)
    assert params.bad_token_ids == (tuple(text_tokenizer.words([" spam"])[0]),)


@pytest.mark.parametrize("tensors, message", [
    (engine_tensors([]), "the prompt is empty"),
    (engine_tensors([1, 2, 49152]), "token id 49152 is outside the vocabulary"),
    (engine_tensors(list(range(40))), "more than the engine's max_input_len=32"),
    (engine_tensors([1, 2], request_output_len=i32(0)), "input 'request_output_len': 0 must be above 0"),
    (engine_tensors([1, 2], request_output_len=i32(63)), "input 'request_output_len': 63: more than the"),
    (engine_tensors([1, 2], input_lengths=i32(3)), "exceeds the 2 ids"),
    (engine_tensors([1, 2], bad_words_list=np.array([1, 2], dtype=np.int32)), "expected shape [2, N]"),
    # out-of-vocabulary ids in the words lists were accepted silently (a stop word that could never match)
    (engine_tensors([1, 2], stop_words_list=to_words_list([[5], [7, 49152]])),
     "input 'stop_words_list': token id 49152 is outside the vocabulary [0, 49152)"),
    (engine_tensors([1, 2], stop_words_list=np.array([[3, -7], [2, -1]], dtype=np.int32)),
     "input 'stop_words_list': token id -7 is outside the vocabulary [0, 49152)"),
    (engine_tensors([1, 2], bad_words_list=to_words_list([[2**31 - 1]])),
     "input 'bad_words_list': token id 2147483647 is outside the vocabulary [0, 49152)"),
    ({"request_output_len": i32(4)}, "input 'input_ids' is required"),
])
def test_invalid_engine_requests(text_tokenizer, tensors, message):
    with pytest.raises(InvalidRequest) as e:
        parse_engine_request(tensors, LIMITS, 49152, text_tokenizer)
    assert message in str(e.value)


def test_words_list_round_trip():
    words = [[5], [7, 8, 9], [], [3, 3]]
    arr = to_words_list(words)
    assert arr.shape == (2, 6) and arr.dtype == np.int32
    assert from_words_list("w", arr) == [[5], [7, 8, 9], [3, 3]]
    assert from_words_list("w", to_words_list([])) == []
    assert from_words_list("w", arr[None]) == [[5], [7, 8, 9], [3, 3]]  # [1, 2, N] from batched clients
    assert from_words_list("w", arr, vocab_size=10) == [[5], [7, 8, 9], [3, 3]]  # -1 padding is not an id


def test_words_list_ids_must_be_in_the_vocabulary():
    with pytest.raises(InvalidRequest, match=r"input 'w': token id 9 is outside the vocabulary \[0, 9\)"):
        from_words_list("w", to_words_list([[1], [2, 9]]), vocab_size=9)
    with pytest.raises(InvalidRequest, match=r"input 'w': token id -3 is outside the vocabulary"):
        from_words_list("w", np.array([[-3], [1]], dtype=np.int64))


def test_postprocess_applies_context_and_trim(text_tokenizer):
    ids = text_tokenizer.encode(" world. STOP here")
    out = postprocess_tensors(text_tokenizer, {
        "TOKENS_BATCH": np.array([[ids]], np.int32), "SEQUENCE_LENGTH": np.array([[len(ids)]], np.int32),
        "context_ids": np.array([text_tokenizer.encode("Hello")], np.int32),
        "text_trim": np.array([[len(" STOP here")]], np.int32)})
    assert out["OUTPUT"].shape == (1,) and out["OUTPUT"][0].decode() == " world."


def test_postprocess_is_nvidias_decode_of_the_first_sequence_length_ids(text_tokenizer):
    ids = text_tokenizer.encode("Hello world, again")
    padded = np.array([[ids + [0, 0, 0]]], np.int32)  # ids past SEQUENCE_LENGTH are not read
    out = postprocess_tensors(text_tokenizer, {"TOKENS_BATCH": padded, "SEQUENCE_LENGTH": np.array([[len(ids)]], np.int32)})
    assert out["OUTPUT"].tolist() == [text_tokenizer.decode(ids).encode()]
    # two rows (NVIDIA's --batch-inputs): OUTPUT is 1-D, row by row
    other = text_tokenizer.encode("Bye")
    two = np.array([[ids], [other + [0] * (len(ids) - len(other))]], np.int32)
    out = postprocess_tensors(text_tokenizer, {"TOKENS_BATCH": two,
                                               "SEQUENCE_LENGTH": np.array([[len(ids)], [len(other)]], np.int32)})
    assert out["OUTPUT"].tolist() == [text_tokenizer.decode(ids).encode(), b"Bye"]
    with pytest.raises(InvalidRequest, match=r"input 'TOKENS_BATCH': expected shape \[batch, beams, tokens\]"):
        postprocess_tensors(text_tokenizer, {"TOKENS_BATCH": np.zeros((2, 3), np.int32)})
    with pytest.raises(InvalidRequest, match=r"input 'SEQUENCE_LENGTH': shape \[1, 1\] does not match"):
        postprocess_tensors(text_tokenizer, {"TOKENS_BATCH": two, "SEQUENCE_LENGTH": np.array([[3]], np.int32)})


def test_preprocessing_pads_rows_as_nvidias(pre):
    a = pre.prepare({"text_input": text("Hello there, how are you"), "stop_words": np.array([b"END"], dtype=object)})
    b = pre.prepare({"text_input": text("Hi"), "end_id": i32(9)})
    out = preprocessing_outputs(a, b)
    la, lb = len(a.prompt_ids), len(b.prompt_ids)
    assert out["INPUT_ID"].shape == (2, la) and out["INPUT_ID"][0].tolist() == a.prompt_ids
    assert out["INPUT_ID"][1, :lb].tolist() == b.prompt_ids and out["REQUEST_INPUT_LEN"].tolist() == [[la], [lb]]
    assert out["OUT_END_ID"].tolist() == [[a.end_id], [9]]
    assert from_words_list("s", out["STOP_WORDS_IDS"][0]) == pre.tokenizer.words(["END"])
    assert from_words_list("s", out["STOP_WORDS_IDS"][1]) == []  # padded with -1: no words


def _params(req):
    params = SamplingParams(**req.sampling)
    params.validate(LIMITS.max_seq_len - len(req.prompt_ids), 49152)
    return params


@pytest.mark.parametrize("top_k, expected", [(0, (0.0, 0, 1.0)), (1, (1.0, 1, 1.0)), (5, (1.0, 5, 1.0))])
def test_top_p_zero_means_top_p_off_and_greedy_without_top_k(pre, text_tokenizer, top_k, expected):
    # TensorRT-LLM: top_p 0 disables top-p; top_k 0 and top_p 0 together = greedy
    prep = pre.prepare({"text_input": text("Hello"), "top_p": f32(0.0), "top_k": i32(top_k)})
    p = _params(parse_engine_request(prep.engine_tensors(), LIMITS, 49152, text_tokenizer))
    assert (p.temperature, p.top_k, p.top_p) == expected


def test_end_id_and_pad_id_minus_one_mean_the_models_own(pre, text_tokenizer):
    base = pre.prepare({"text_input": text("Hello")})
    prep = pre.prepare({"text_input": text("Hello"), "end_id": i32(-1), "pad_id": i32(-1)})
    # preprocessing fills the tokenizer's end token, as NVIDIA's does; the engine stops on it (one
    # of the model's own end tokens) as it would without it
    assert base.end_id == base.pad_id == prep.end_id == text_tokenizer.eos_id
    a = parse_engine_request(base.engine_tensors(), LIMITS, 49152, text_tokenizer)
    b = parse_engine_request(prep.engine_tensors(), LIMITS, 49152, text_tokenizer)
    assert a.sampling == b.sampling and b.sampling["stop_token_ids"] == (text_tokenizer.eos_id,)
    c = parse_engine_request(engine_tensors([1, 2], end_id=i32(-1), pad_id=i32(-1)), LIMITS, 49152, text_tokenizer)
    assert "stop_token_ids" not in c.sampling


def test_engine_accepts_nvidia_names(text_tokenizer):
    req = parse_engine_request(engine_tensors([1, 2], runtime_top_k=i32(3), runtime_top_p=f32(0.5),
                                              random_seed=np.array([2**64 - 1], dtype=np.uint64),
                                              beam_width=i32(1), num_return_sequences=i32(1)),
                               LIMITS, 49152, text_tokenizer)
    p = _params(req)
    assert (p.top_k, p.top_p, p.seed) == (3, 0.5, 2**63 - 1)
    with pytest.raises(InvalidRequest, match="input 'runtime_top_k': 3 differs from 'top_k'=4"):
        parse_engine_request(engine_tensors([1, 2], runtime_top_k=i32(3), top_k=i32(4)), LIMITS, 49152,
                             text_tokenizer)
    with pytest.raises(InvalidRequest, match="input 'beam_width': 2 is not supported.*allowed: 1"):
        parse_engine_request(engine_tensors([1, 2], beam_width=i32(2)), LIMITS, 49152, text_tokenizer)


def test_engine_stop_words_list_and_kiln_stop_strings(text_tokenizer):
    req = parse_engine_request(engine_tensors([1, 2], stop_words_list=to_words_list([[5, 6], [7]]),
                                              stop_strings=np.array([b"END"], dtype=object)),
                               LIMITS, 49152, text_tokenizer)
    assert req.stop_ids == ((5, 6), (7,)) and req.stop_strings == ("END",)


def test_neither_top_k_nor_top_p_is_greedy_as_in_tensorrt_llm(pre, text_tokenizer):
    # NVIDIA's clients send temperature 1.0 and expect greedy text unless they name top_k / top_p
    prep = pre.prepare({"text_input": text("Hello"), "temperature": f32(1.0)})
    assert _params(parse_engine_request(prep.engine_tensors(), LIMITS, 49152, text_tokenizer)).temperature == 0.0
    req = parse_engine_request(engine_tensors([1, 2], temperature=f32(1.0)), LIMITS, 49152, text_tokenizer)
    assert _params(req).temperature == 0.0
    req = parse_engine_request(engine_tensors([1, 2], temperature=f32(0.7), runtime_top_p=f32(0.9)), LIMITS,
                               49152, text_tokenizer)
    assert (_params(req).temperature, _params(req).top_p) == (pytest.approx(0.7), pytest.approx(0.9))


def test_engine_accepts_nvidias_neutral_inputs_and_refuses_the_rest(text_tokenizer):
    req = parse_engine_request(engine_tensors([1, 2], decoder_input_ids=i32(0), decoder_input_lengths=i32(1),
                                              embedding_bias=np.zeros(0, np.float32),
                                              return_context_logits=np.array([False]),
                                              return_generation_logits=np.array([False]),
                                              exclude_input_in_output=np.array([True])),
                               LIMITS, 49152, text_tokenizer)
    assert req.exclude_input_in_output and req.prompt_ids == [1, 2]
    assert not req.return_context_logits and not _params(req).return_generation_logits
    req = parse_engine_request(engine_tensors([1, 2], return_context_logits=np.array([True]),
                                              return_generation_logits=np.array([True])), LIMITS, 49152, text_tokenizer)
    assert req.return_context_logits and req.return_generation_logits
    assert _params(req).return_context_logits and _params(req).return_generation_logits
    for extra, message in ((dict(embedding_bias=np.ones(4, np.float32)), "input 'embedding_bias': 4 values; NVIDIA's dense"),
                           (dict(beam_width=i32(2)), "input 'beam_width'"),
                           (dict(num_return_sequences=i32(3)), "Kiln returns one sequence per request")):
        with pytest.raises(InvalidRequest, match=message):
            parse_engine_request(engine_tensors([1, 2], **extra), LIMITS, 49152, text_tokenizer)


def test_batch_dimension_one_sequence_per_request():
    from backend.serving.conversion.batching import batched, unbatch
    got = unbatch({"input_ids": np.array([[5, 6, 7]], np.int32), "end_id": np.array([[2]], np.int32)}, "m")
    assert got["input_ids"].tolist() == [5, 6, 7] and got["end_id"].tolist() == [2]
    with pytest.raises(InvalidRequest, match=r"input 'text_input' of model 'ensemble': batch size 2 \(shape \[2, 1\]\)"):
        unbatch({"text_input": np.array([[b"a"], [b"b"]], dtype=object)}, "ensemble")
    with pytest.raises(InvalidRequest, match="no batch dimension"):
        unbatch({"x": np.array(3)}, "m")
    assert batched([1, 2], np.int32).shape == (1, 2)


class _NoDecode:
    def decode(self, ids):
        raise AssertionError("postprocessing decoded ids the engine had already decoded")


def test_postprocess_takes_the_engines_text_without_decoding_again():
    # Kiln's ensemble sends the engine's output_text (decoded once there, stop string already cut);
    # the ids still travel as NVIDIA's TOKENS_BATCH but are not decoded a second time
    out = postprocess_tensors(_NoDecode(), {
        "TOKENS_BATCH": np.array([[[5, 6, 7]]], np.int32), "SEQUENCE_LENGTH": np.array([[3]], np.int32),
        "output_text": np.array([["caf\u00e9 ok".encode()]], dtype=object),
        "text_trim": np.array([[4]], np.int32)})
    assert out["OUTPUT"].tolist() == ["caf\u00e9 ok".encode()]
