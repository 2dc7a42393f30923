"""Engine model inputs -> (prompt ids, SamplingParams kwargs, streaming, stop words).

The engine checks everything again even though preprocessing already did: clients may call the
engine model directly with token ids (NVIDIA-style ``input_ids``/``request_output_len``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np

from backend.serving.conversion.batching import rows
from backend.serving.conversion.convert import (EngineLimits, InvalidRequest, check_prompt, from_words_list,
                                    read_inputs, sampling_kwargs)
from backend.serving.conversion.detok import Decoder
from backend.serving.conversion.neutral_inputs import ENGINE, check_neutral, neutral_names

__all__ = ["ENGINE_INPUT_NAMES", "ENGINE_READ_NAMES", "EngineRequest", "is_stop_request", "parse_engine_request",
           "request_rows"]

ENGINE_INPUT_NAMES = (
    "input_ids", "input_lengths", "request_output_len", "streaming", "temperature", "top_k", "top_p",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens", "seed", "end_id",
    "return_log_probs", "stop_strings", "stop_words_list", "bad_words_list",
    "stop_request", "stop", "return_perf_metrics", "pad_id", "runtime_top_k", "runtime_top_p", "random_seed",
    "beam_width", "num_return_sequences", "exclude_input_in_output", "return_context_logits",
    "return_generation_logits", "decoder_input_ids", "decoder_input_lengths", "embedding_bias",
    "return_num_input_tokens", "return_num_output_tokens", "min_length",
    "guided_decoding_guide_type", "guided_decoding_guide", "top_logprobs", "skip_special_tokens",
)

# what the engine model reads: the above and NVIDIA's inputs Kiln cannot honour (neutral_inputs.py)
ENGINE_READ_NAMES = ENGINE_INPUT_NAMES + neutral_names(ENGINE)

# NVIDIA's engine-model name -> Kiln's (both accepted; giving both with different values is refused)
ALIASES = {"runtime_top_k": "top_k", "runtime_top_p": "top_p", "random_seed": "seed", "min_length": "min_tokens"}


@dataclasses.dataclass
class EngineRequest:
    prompt_ids: list[int]
    sampling: dict[str, Any]         # SamplingParams keyword arguments
    streaming: bool
    stop_strings: tuple[str, ...]    # Kiln's stop_strings: matched on the decoded text, cut
    return_log_probs: bool
    return_perf_metrics: bool = False  # add the acceptance figures to every response
    stop_ids: tuple[tuple[int, ...], ...] = ()  # NVIDIA's stop_words_list: token sequences, kept
    # NVIDIA's: a non-streamed output_ids holds the prompt's ids before the generated ones unless true
    exclude_input_in_output: bool = False
    return_context_logits: bool = False     # context_logits [1, prompt, vocab] on the first response
    return_generation_logits: bool = False  # generation_logits [1, 1, tokens, vocab] per response
    return_num_input_tokens: bool = False   # num_input_tokens [1, 1]: the prompt's tokens
    return_num_output_tokens: bool = False  # num_output_tokens [1, 1]: generated, in this response
    top_logprobs: int = 0  # output_top_ids / output_top_logprobs [1, 1, n, top_logprobs] per response
    skip_special_tokens: bool = True  # false: output_text keeps special tokens (not the end tokens)


def _optional_id(v: int | None) -> int | None:
    return None if v is None or v < 0 else v  # -1 = "not given" (INT64 through the ensemble)


def read_guide(v: Mapping[str, Any]) -> tuple[str, str] | None:
    """NVIDIA's guided_decoding_guide_type / guided_decoding_guide -> SamplingParams.guide."""
    kind, text = v["guided_decoding_guide_type"], v["guided_decoding_guide"]
    if not kind:
        if text:
            raise InvalidRequest("input 'guided_decoding_guide': given without 'guided_decoding_guide_type'; "
                                 "send the type too (json_schema, regex, ebnf_grammar, lark, or json)")
        return None
    if kind != "json" and not text:
        raise InvalidRequest(f"input 'guided_decoding_guide': empty; a '{kind}' guide needs its text")
    return kind, text


def parse_engine_request(tensors: Mapping[str, np.ndarray], limits: EngineLimits, vocab_size: int,
                         tok: Decoder) -> EngineRequest:
    t = check_neutral(tensors, ENGINE)
    # -1 sentinels are legal at this level; hide them from the table's range checks
    for name in ("seed", "end_id"):
        if name in t and t[name] is not None and np.asarray(t[name]).size == 1 and int(np.asarray(t[name]).reshape(-1)[0]) < 0:
            t.pop(name)
    v = read_inputs(t, ENGINE_INPUT_NAMES, required=("input_ids",))
    for nv_name, name in ALIASES.items():
        if t.get(nv_name) is None:
            continue
        value = v[nv_name] & 0x7FFFFFFFFFFFFFFF if nv_name == "random_seed" else v[nv_name]
        if t.get(name) is not None and v[name] is not None and v[name] != value:
            raise InvalidRequest(f"input '{nv_name}': {v[nv_name]} differs from '{name}'={v[name]}; "
                                 f"send one of them ('{nv_name}' is NVIDIA's name for '{name}')")
        v[name] = value
    prompt = v["input_ids"]
    if v["input_lengths"] is not None:
        if v["input_lengths"] > len(prompt):
            raise InvalidRequest(f"input 'input_lengths': {v['input_lengths']} exceeds the {len(prompt)} "
                                 "ids in input_ids")
        prompt = prompt[: v["input_lengths"]]
    check_prompt(prompt, limits, vocab_size)
    v["seed"], v["end_id"] = _optional_id(v["seed"]), _optional_id(v["end_id"])
    kw = sampling_kwargs(v, len(prompt), limits, max_tokens_name="request_output_len")
    bad = from_words_list("bad_words_list", v["bad_words_list"], vocab_size)
    if bad:
        kw["bad_token_ids"] = tuple(tuple(w) for w in bad)
    stop_ids = from_words_list("stop_words_list", v["stop_words_list"], vocab_size)
    bias = v["embedding_bias"] or []
    if bias and len(bias) != vocab_size:
        raise InvalidRequest(f"input 'embedding_bias': {len(bias)} values; NVIDIA's dense logit bias has one "
                             f"per vocabulary entry ({vocab_size}), or none (an empty tensor)")
    if any(not math.isfinite(x) for x in bias):
        raise InvalidRequest("input 'embedding_bias': values must be finite")
    if any(bias):  # added to the logits before sampling, as TensorRT-LLM adds it
        kw["logit_bias"] = tuple((i, x) for i, x in enumerate(bias) if x != 0.0)
    guide = read_guide(v)
    if guide is not None:
        kw["guide"] = guide
    if v["top_logprobs"]:  # the sampler returns the chosen token's and the top-n alternatives
        kw["logprobs"] = max(kw.get("logprobs", 0), v["top_logprobs"])
    ctx, gen = bool(v["return_context_logits"]), bool(v["return_generation_logits"])
    kw.update(return_context_logits=ctx, return_generation_logits=gen)
    return EngineRequest(prompt, kw, bool(v["streaming"]), tuple(dict.fromkeys(s for s in v["stop_strings"] if s)),
                         bool(v["return_log_probs"]), bool(v["return_perf_metrics"]),
                         tuple(dict.fromkeys(tuple(w) for w in stop_ids)), bool(v["exclude_input_in_output"]),
                         ctx, gen, bool(v["return_num_input_tokens"]), bool(v["return_num_output_tokens"]),
                         v["top_logprobs"], bool(v["skip_special_tokens"]))


def request_rows(pb: Any, request: Any, model_name: str, decoupled: bool) -> list[dict[str, np.ndarray]]:
    """A Triton request's inputs, one dict per row (NVIDIA's clients send B rows with --batch-inputs)."""
    out = {}
    for name in ENGINE_READ_NAMES:
        t = pb.get_input_tensor_by_name(request, name)
        if t is not None:
            out[name] = t.as_numpy()
    per_row = rows(out, model_name)
    if len(per_row) > 1 and not decoupled:
        raise InvalidRequest(f"model '{model_name}': batch size {len(per_row)} needs a decoupled model "
                             "(one response per row; this repository was built with serving.decoupled="
                             "false): send the rows as separate requests, or rebuild with "
                             "serving.decoupled=true")
    return per_row


def is_stop_request(pb: Any, request: Any) -> bool:
    """A control request: ``stop_request`` or NVIDIA's ``stop`` true (its other inputs are dummies)."""
    for name in ("stop_request", "stop"):
        t = pb.get_input_tensor_by_name(request, name)
        if t is not None and t.as_numpy().size and bool(t.as_numpy().reshape(-1)[0]):
            return True
    return False
