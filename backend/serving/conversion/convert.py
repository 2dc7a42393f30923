"""Triton tensors -> validated request fields, with one-line errors that name the Triton input.

Pure numpy; no Triton, no torch. Every model (preprocessing, engine, bls) reads its inputs through
:func:`read_inputs`, driven by the :data:`INPUTS` table, so names, dtypes, defaults and range checks
live in one place. A problem raises :class:`InvalidRequest`, which the models turn into a Triton
error response (the server keeps serving).

Shapes: every model declares ``max_batch_size`` > 0 as NVIDIA's do; the models strip the batch
dimension first (backend/serving/conversion/batching.py), so the tensors read here are one request's: a scalar
input is shape ``[1]``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import numpy as np

from backend.engine.sampling_params import room_problem

__all__ = [
    "InvalidRequest", "InputSpec", "INPUTS", "EngineLimits", "read_inputs", "decode_text",
    "sampling_kwargs", "check_prompt", "to_words_list", "from_words_list",
]


class InvalidRequest(ValueError):
    """A client mistake; the message is one line naming the input and the allowed values."""


@dataclasses.dataclass(frozen=True)
class InputSpec:
    kind: str                      # "bytes" | "int" | "float" | "bool"
    default: Any = None            # None = optional with no value
    many: bool = False             # a list ([-1]) rather than a scalar ([1])
    check: Callable[[Any], str | None] | None = None   # returns the problem, or None
    allowed: str = ""


def _finite(v: float) -> str | None:
    return None if math.isfinite(v) else f"{v} is not finite"


def _ge(lo: float) -> Callable[[Any], str | None]:
    return lambda v: _finite(v) or (None if v >= lo else f"{v} is below {lo}")


def _gt(lo: float) -> Callable[[Any], str | None]:
    return lambda v: _finite(v) or (None if v > lo else f"{v} must be above {lo}")


def _top_p(v: float) -> str | None:
    return None if math.isfinite(v) and 0.0 <= v <= 1.0 else f"{v} is outside [0, 1]"


_GUIDE_TYPES = ("", "json", "json_schema", "regex", "ebnf_grammar", "lark")


def _only(value: int, why: str) -> Callable[[Any], str | None]:
    """An input Kiln accepts only with its neutral value (refused, never silently ignored)."""
    return lambda v: None if v == value else f"{v} is not supported ({why})"


# One table for every model: the ensemble/bls inputs (NVIDIA tensorrtllm_backend names) and the
# engine-only ones. A model reads the subset its config.pbtxt declares.
INPUTS: dict[str, InputSpec] = {
    "text_input": InputSpec("bytes", allowed="a UTF-8 string"),
    "max_tokens": InputSpec("int", 16, check=_gt(0), allowed=">= 1 and within the engine's max_seq_len"),
    "stream": InputSpec("bool", False),
    "temperature": InputSpec("float", 1.0, check=_ge(0.0), allowed=">= 0 (0 = greedy)"),
    "top_k": InputSpec("int", 0, check=_ge(0), allowed=">= 0 (0 = off)"),
    # 0 = top-p off, as in TensorRT-LLM, and its default: with top_k 0 (its default too) a request
    # that names neither is greedy whatever its temperature, as NVIDIA's clients expect
    "top_p": InputSpec("float", 0.0, check=_top_p, allowed="[0, 1] (0 = off; with top_k 0: greedy)"),
    "repetition_penalty": InputSpec("float", 1.0, check=_gt(0.0), allowed="> 0 (1 = off)"),
    "presence_penalty": InputSpec("float", 0.0, check=_finite, allowed="a finite number"),
    "frequency_penalty": InputSpec("float", 0.0, check=_finite, allowed="a finite number"),
    "min_tokens": InputSpec("int", 0, check=_ge(0), allowed=">= 0 and <= max_tokens"),
    "seed": InputSpec("int", None, check=_ge(0), allowed="an unsigned 64-bit integer"),
    # -1 = the model's own (NVIDIA's default), the same as leaving the input out
    "end_id": InputSpec("int", None, check=_ge(-1), allowed="a token id, or -1 for the model's own"),
    "pad_id": InputSpec("int", None, check=_ge(-1), allowed="a token id, or -1 for the model's own"),
    # NVIDIA's: tokenized, matched on the generated token ids, kept in the output
    "stop_words": InputSpec("bytes", (), many=True, allowed="a list of UTF-8 strings"),
    "bad_words": InputSpec("bytes", (), many=True, allowed="a list of UTF-8 strings"),
    "return_log_probs": InputSpec("bool", False),
    # tensorrtllm_backend's switch for per-request figures (here: the speculative-decoding ones)
    "return_perf_metrics": InputSpec("bool", False),
    "exclude_input_in_output": InputSpec("bool", False),
    # Kiln extension (engine; vLLM's name): false keeps special tokens in output_text, the markers of
    # tool calls and reasoning channels that are special tokens in some families (Mistral, gpt-oss)
    "skip_special_tokens": InputSpec("bool", True),
    "apply_chat_template": InputSpec("bool", False),
    "beam_width": InputSpec("int", 1, check=_only(1, "Kiln decodes one beam"), allowed="1"),
    "num_return_sequences": InputSpec("int", 1, check=_only(1, "Kiln returns one sequence per request"),
                                      allowed="1"),
    # the raw fp32 logits at every prompt position / of every generated token (logits_out.py)
    "return_context_logits": InputSpec("bool", False),
    "return_generation_logits": InputSpec("bool", False),
    # NVIDIA's: outputs num_input_tokens (the prompt's) / num_output_tokens (generated, per response)
    "return_num_input_tokens": InputSpec("bool", False),
    "return_num_output_tokens": InputSpec("bool", False),
    # NVIDIA's structured output: the engine masks every token with the grammar (backend/engine/guided.py)
    "guided_decoding_guide_type": InputSpec("bytes", "", check=lambda v: None if v in _GUIDE_TYPES else (
        f"{v!r} is not a guide type"), allowed="json, json_schema, regex, ebnf_grammar or lark (empty: none)"),
    "guided_decoding_guide": InputSpec("bytes", "", allowed="the JSON schema, regex or grammar text"),
    # Kiln extension (engine): the n most likely tokens and their log-probabilities at each step
    "top_logprobs": InputSpec("int", 0, check=lambda v: None if 0 <= v <= 20 else f"{v} is outside 0..20",
                              allowed="0..20 (0 = none)"),
    # NVIDIA's older engine-model name for min_tokens
    "min_length": InputSpec("int", None, check=_ge(0), allowed=">= 0 and <= request_output_len"),
    # NVIDIA's logit bias by word: each word's tokens get its weight added to their logits (checked
    # in preprocess.py: the two lists go together)
    "embedding_bias_words": InputSpec("bytes", (), many=True, allowed="a list of UTF-8 strings"),
    "embedding_bias_weights": InputSpec("float", (), many=True, allowed="one finite number per word"),
    # engine model only
    "runtime_top_k": InputSpec("int", 0, check=_ge(0), allowed=">= 0 (0 = off); NVIDIA's name for top_k"),
    "runtime_top_p": InputSpec("float", 0.0, check=_top_p,
                               allowed="[0, 1] (0 = off; with top_k 0: greedy); NVIDIA's name for top_p"),
    "random_seed": InputSpec("int", None, check=_ge(0), allowed="an unsigned 64-bit integer"),
    # Kiln extension: substrings of the decoded text; the text is cut before the first one found
    "stop_strings": InputSpec("bytes", (), many=True, allowed="a list of UTF-8 strings"),
    "input_ids": InputSpec("int", None, many=True, allowed="a non-empty list of token ids"),
    "input_lengths": InputSpec("int", None, check=_gt(0), allowed="len(input_ids)"),
    "request_output_len": InputSpec("int", 16, check=_gt(0), allowed=">= 1 and within max_seq_len"),
    "streaming": InputSpec("bool", False),
    "stop_words_list": InputSpec("int", None, many=True, allowed="[2, N] NVIDIA words list"),
    "bad_words_list": InputSpec("int", None, many=True, allowed="[2, N] NVIDIA words list"),
    "stop_request": InputSpec("bool", False),
    # NVIDIA's name for stop_request (same rules: backend/serving/engine_model/engine_host.py)
    "stop": InputSpec("bool", False),
    # encoder-decoder inputs NVIDIA's preprocessing always fills; a decoder-only engine ignores them
    "decoder_input_ids": InputSpec("int", None, many=True, allowed="ignored (decoder-only model)"),
    "decoder_input_lengths": InputSpec("int", None, allowed="ignored (decoder-only model)"),
    # NVIDIA's dense [vocab] logit bias (engine); empty = none
    "embedding_bias": InputSpec("float", None, many=True, allowed="one value per vocabulary entry, or none"),
}

_KINDS = {"bytes": "OSU", "int": "iu", "float": "f", "bool": "b"}
_TRITON_TYPE = {"bytes": "BYTES", "int": "INT32/INT64/UINT64", "float": "FP32", "bool": "BOOL"}


def _scalar(name: str, arr: np.ndarray) -> Any:
    if arr.size != 1 or arr.ndim > 2:
        raise InvalidRequest(f"input '{name}': expected one value (shape [1]), got shape {list(arr.shape)}")
    return arr.reshape(-1)[0]


def decode_text(name: str, value: Any) -> str:
    """BYTES element -> str; refuses bytes that are not UTF-8 instead of guessing."""
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"input '{name}': not valid UTF-8 (byte {e.start}: {e.reason})") from None


def _convert(name: str, spec: InputSpec, arr: Any) -> Any:
    if not isinstance(arr, np.ndarray):
        raise InvalidRequest(f"input '{name}': expected a tensor, got {type(arr).__name__}")
    if arr.dtype.kind not in _KINDS[spec.kind]:
        raise InvalidRequest(f"input '{name}': wrong dtype {arr.dtype}; expected {_TRITON_TYPE[spec.kind]}")
    if spec.many:
        if spec.kind == "bytes":
            return tuple(decode_text(name, v) for v in arr.reshape(-1))
        if name.endswith("_words_list"):
            return arr
        if arr.ndim > 2 or (arr.ndim == 2 and arr.shape[0] != 1):
            raise InvalidRequest(f"input '{name}': expected a 1-D list, got shape {list(arr.shape)}")
        cast = float if spec.kind == "float" else int
        return [cast(v) for v in arr.reshape(-1)]
    v = _scalar(name, arr)
    if spec.kind == "bytes":
        return decode_text(name, v)
    if spec.kind == "bool":
        return bool(v)
    if spec.kind == "int":
        return int(v)
    return float(v)


def read_inputs(tensors: Mapping[str, np.ndarray], names: tuple[str, ...] | list[str],
                required: tuple[str, ...] = ()) -> dict[str, Any]:
    """Convert and range-check the named inputs; absent optional ones take the table's default."""
    unknown = [n for n in tensors if n not in names]
    if unknown:
        raise InvalidRequest(f"unknown input '{unknown[0]}'; known: {', '.join(names)}")
    out: dict[str, Any] = {}
    for name in names:
        spec = INPUTS[name]
        if name not in tensors or tensors[name] is None:
            if name in required:
                raise InvalidRequest(f"input '{name}' is required ({spec.allowed or spec.kind})")
            out[name] = spec.default
            continue
        value = _convert(name, spec, tensors[name])
        if spec.check is not None and not spec.many:
            problem = spec.check(value)
            if problem:
                raise InvalidRequest(f"input '{name}': {problem}; allowed: {spec.allowed}")
        out[name] = value
    return out


@dataclasses.dataclass(frozen=True)
class EngineLimits:
    """The limits a request is checked against: the bundle's ``engine`` section (backend.bundle)."""
    max_input_len: int
    max_seq_len: int

    @classmethod
    def from_engine(cls, engine: Any) -> "EngineLimits":
        """From a ``backend.bundle.EngineSettings`` (typed, defaults resolved)."""
        return cls(max_input_len=engine.max_input_len, max_seq_len=engine.max_seq_len)


def check_prompt(prompt_ids: list[int], limits: EngineLimits, vocab_size: int | None = None) -> None:
    if not prompt_ids:
        raise InvalidRequest("the prompt is empty (0 tokens); send a non-empty text_input / input_ids")
    if len(prompt_ids) > limits.max_input_len:
        raise InvalidRequest(f"the prompt has {len(prompt_ids)} tokens, more than the engine's "
                             f"max_input_len={limits.max_input_len}; shorten it or rebuild with a larger "
                             "engine.max_input_len")
    if vocab_size is not None:
        bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequest(f"input 'input_ids': token id {bad[0]} is outside the vocabulary "
                                 f"[0, {vocab_size})")


def sampling_kwargs(values: Mapping[str, Any], prompt_len: int, limits: EngineLimits,
                    max_tokens_name: str = "max_tokens") -> dict[str, Any]:
    """Request fields -> ``SamplingParams`` keyword arguments (contract section 4).

    ``max_tokens`` is checked against the room the prompt leaves in ``max_seq_len`` so a request that
    could never finish is refused up front instead of being cut short silently.
    """
    max_tokens = values[max_tokens_name]
    problem = room_problem(max_tokens, limits.max_seq_len - prompt_len)
    if problem is not None:
        raise InvalidRequest(f"input '{max_tokens_name}': {max_tokens}: {problem}")
    if values["min_tokens"] > max_tokens:
        raise InvalidRequest(f"input 'min_tokens': {values['min_tokens']} exceeds {max_tokens_name}="
                             f"{max_tokens}; allowed: 0..{max_tokens}")
    temperature, top_k, top_p = values["temperature"], values["top_k"], values["top_p"]
    if top_p == 0.0:  # TensorRT-LLM: top_p 0 turns top-p off; with top_k 0 too, decoding is greedy
        top_p = 1.0
        if top_k == 0:
            temperature = 0.0
    kw: dict[str, Any] = dict(
        max_tokens=max_tokens, min_tokens=values["min_tokens"], temperature=temperature,
        top_k=top_k, top_p=top_p, repetition_penalty=values["repetition_penalty"],
        presence_penalty=values["presence_penalty"], frequency_penalty=values["frequency_penalty"],
        seed=values["seed"], logprobs=1 if values["return_log_probs"] else 0,
    )
    if values.get("end_id") is not None and values["end_id"] >= 0:  # -1: the model's own
        kw["stop_token_ids"] = (values["end_id"],)
    return kw


def to_words_list(words: list[list[int]]) -> np.ndarray:
    """Token sequences -> NVIDIA's ``[2, N]`` INT32 words list (ids; end offsets padded with -1)."""
    words = [list(w) for w in words if len(w)]
    flat = [int(t) for w in words for t in w]
    out = np.full((2, max(len(flat), 1)), -1, dtype=np.int32)
    out[0, :len(flat)] = flat
    out[1, :len(words)] = np.cumsum([len(w) for w in words], dtype=np.int64)
    return out


def from_words_list(name: str, arr: np.ndarray | None, vocab_size: int | None = None) -> list[list[int]]:
    """The inverse of :func:`to_words_list`, with shape checks (``[1, 2, N]`` from batched clients too).

    Every id inside a word must be a token id: >= 0, and below ``vocab_size`` when given (ids past the
    last offset are padding and are not read)."""
    if arr is None:
        return []
    a = np.asarray(arr)
    if a.ndim == 3 and a.shape[0] == 1:
        a = a[0]
    if a.ndim != 2 or a.shape[0] != 2:
        raise InvalidRequest(f"input '{name}': expected shape [2, N] (ids; end offsets), got {list(a.shape)}")
    ids, ends = a[0].tolist(), [int(e) for e in a[1].tolist() if e >= 0]
    words, start = [], 0
    for end in ends:
        if end < start or end > len(ids):
            raise InvalidRequest(f"input '{name}': offset {end} is out of order or beyond {len(ids)} ids")
        if end > start:
            words.append([int(t) for t in ids[start:end]])
        start = end
    for word in words:
        bad = [t for t in word if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if bad:
            vocab = f"[0, {vocab_size})" if vocab_size is not None else "(ids are >= 0)"
            raise InvalidRequest(f"input '{name}': token id {bad[0]} is outside the vocabulary {vocab}")
    return words
