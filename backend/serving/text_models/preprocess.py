"""Preprocessing: text request -> the engine model's inputs, fully validated against the engine.

Used by the ``preprocessing`` model (ensemble) and in-process by the ``bls`` model. Validating the
whole request here (not only tokenizing) means a bad request fails before it reaches the engine and
the engine step of the ensemble always receives every input with a value.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from backend import bundle
from backend.serving.conversion.batching import stack_rows
from backend.serving.conversion.convert import (EngineLimits, InvalidRequest, check_prompt, read_inputs,
                                    sampling_kwargs, to_words_list)
from backend.serving.engine_model.engine_request import read_guide
from backend.serving.conversion.neutral_inputs import TEXT, check_neutral, neutral_names
from backend.serving.conversion.tokenizer import TextTokenizer, load_tokenizer

__all__ = ["TEXT_INPUT_NAMES", "TEXT_MODEL_INPUTS", "NVIDIA_INPUTS", "PREPROCESSING_INPUTS", "PreparedRequest", "Preprocessor",
           "preprocessing_outputs"]

TEXT_INPUT_NAMES = (
    "text_input", "max_tokens", "stream", "temperature", "top_k", "top_p", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "min_tokens", "seed", "end_id", "pad_id", "stop_words",
    "bad_words", "return_log_probs", "exclude_input_in_output", "apply_chat_template",
    "return_perf_metrics", "beam_width", "num_return_sequences", "return_context_logits",
    "return_generation_logits", "embedding_bias_words", "embedding_bias_weights",
    "return_num_input_tokens", "return_num_output_tokens", "guided_decoding_guide_type", "guided_decoding_guide",
)

# The preprocessing model's inputs under NVIDIA's names -> the text-level names above (the ensemble
# maps its own inputs onto these; the sampling inputs keep their names and are validated here too)
NVIDIA_INPUTS = {
    "QUERY": "text_input", "REQUEST_OUTPUT_LEN": "max_tokens", "BAD_WORDS_DICT": "bad_words",
    "STOP_WORDS_DICT": "stop_words", "END_ID": "end_id", "PAD_ID": "pad_id",
    "EMBEDDING_BIAS_WORDS": "embedding_bias_words", "EMBEDDING_BIAS_WEIGHTS": "embedding_bias_weights",
}
# what the text models (preprocessing, bls) read: the above, and NVIDIA's inputs Kiln cannot honour,
# checked for their neutral value (neutral_inputs.py)
TEXT_MODEL_INPUTS = TEXT_INPUT_NAMES + neutral_names(TEXT)
PREPROCESSING_INPUTS = (tuple(NVIDIA_INPUTS) + tuple(n for n in TEXT_INPUT_NAMES if n not in NVIDIA_INPUTS.values())
                        + neutral_names(TEXT))


@dataclasses.dataclass
class PreparedRequest:
    prompt_ids: list[int]
    values: dict[str, Any]          # converted text-level inputs (defaults filled)
    stop_words_ids: list[list[int]]
    bad_words_ids: list[list[int]]
    end_id: int                     # the request's, else the tokenizer's end token (-1: none known)
    pad_id: int                     # the request's, else the tokenizer's end token (Kiln never pads)
    embedding_bias: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.float32))

    @property
    def stream(self) -> bool:
        return bool(self.values["stream"])

    @property
    def exclude_input(self) -> bool:
        """Whether the output leaves the prompt out. A chat-templated prompt is never echoed: its ids
        spell the template, not what the client sent."""
        return bool(self.values["exclude_input_in_output"] or self.values["apply_chat_template"])

    def engine_tensors(self) -> dict[str, np.ndarray]:
        """The engine model's inputs for one request, without the batch dimension (names of
        model_repository/engine/config.pbtxt.tmpl)."""
        v = self.values
        f32 = lambda x: np.array([x], dtype=np.float32)  # noqa: E731
        i32 = lambda x: np.array([x], dtype=np.int32)  # noqa: E731
        return {
            "input_ids": np.array(self.prompt_ids, dtype=np.int32),
            "input_lengths": i32(len(self.prompt_ids)),
            "request_output_len": i32(v["max_tokens"]),
            "streaming": np.array([self.stream], dtype=bool),
            "temperature": f32(v["temperature"]), "top_k": i32(v["top_k"]), "top_p": f32(v["top_p"]),
            "repetition_penalty": f32(v["repetition_penalty"]),
            "presence_penalty": f32(v["presence_penalty"]),
            "frequency_penalty": f32(v["frequency_penalty"]),
            "min_tokens": i32(v["min_tokens"]),
            # the engine takes INT64 so that "no seed" can travel as -1 through an ensemble
            "seed": np.array([-1 if v["seed"] is None else v["seed"] & 0x7FFFFFFFFFFFFFFF], dtype=np.int64),
            "end_id": i32(self.end_id),
            "return_log_probs": np.array([v["return_log_probs"]], dtype=bool),
            "return_perf_metrics": np.array([v["return_perf_metrics"]], dtype=bool),
            "exclude_input_in_output": np.array([self.exclude_input], dtype=bool),
            "return_context_logits": np.array([v["return_context_logits"]], dtype=bool),
            "return_generation_logits": np.array([v["return_generation_logits"]], dtype=bool),
            "guided_decoding_guide_type": np.array([v["guided_decoding_guide_type"].encode()], dtype=object),
            "guided_decoding_guide": np.array([v["guided_decoding_guide"].encode()], dtype=object),
            "stop_words_list": to_words_list(self.stop_words_ids),
            "bad_words_list": to_words_list(self.bad_words_ids),
            "embedding_bias": self.embedding_bias,
        }


# engine input -> the preprocessing model's output name: NVIDIA's for the ones its preprocessing has,
# "out_" + the engine's name for the sampling values Kiln validates here (a model's outputs may not
# reuse its input names)
OUTPUT_NAMES = {
    "input_ids": "INPUT_ID", "input_lengths": "REQUEST_INPUT_LEN", "request_output_len": "REQUEST_OUTPUT_LEN",
    "stop_words_list": "STOP_WORDS_IDS", "bad_words_list": "BAD_WORDS_IDS", "end_id": "OUT_END_ID",
    "embedding_bias": "EMBEDDING_BIAS",
    "streaming": "streaming",
}


def _row_outputs(prep: PreparedRequest) -> dict[str, np.ndarray]:
    out = {OUTPUT_NAMES.get(k, "out_" + k): v for k, v in prep.engine_tensors().items()}
    out["OUT_PAD_ID"] = np.array([prep.pad_id], np.int32)
    # NVIDIA's encoder-decoder outputs, filled as its preprocessing fills them for a decoder-only model
    out["DECODER_INPUT_ID"] = np.array([max(prep.pad_id, 0)], np.int32)
    out["REQUEST_DECODER_INPUT_LEN"] = np.array([1], np.int32)
    # The ensemble always asks the engine for the acceptance figures: a decoupled ensemble sends a
    # response only once every output the client asked for exists, and a client that names no
    # outputs asks for all of them, so an output that appeared only on request would stall it.
    out["out_return_perf_metrics"] = np.array([True])
    return out


def preprocessing_outputs(*preps: PreparedRequest) -> dict[str, np.ndarray]:
    """Outputs of the ``preprocessing`` model for a request's rows, batch dimension first
    (model_repository/preprocessing/config.pbtxt.tmpl). Rows of different lengths are padded as
    NVIDIA's preprocessing pads them: prompts with the pad id (``REQUEST_INPUT_LEN`` says where each
    ends), word lists with -1 (the end of the offsets)."""
    pad = {"INPUT_ID": max(preps[0].pad_id, 0), "STOP_WORDS_IDS": -1, "BAD_WORDS_IDS": -1}
    return stack_rows([_row_outputs(p) for p in preps], pad)


class Preprocessor:
    def __init__(self, engine_dir: str | Path, tokenizer: TextTokenizer | None = None):
        # The checked manifest (format, fields); the engine model checks the files' hashes.
        manifest = bundle.read(engine_dir)
        self.limits = EngineLimits.from_engine(manifest.engine)
        self.vocab_size = manifest.model.vocab_size  # EMBEDDING_BIAS has one value per entry
        self.tokenizer = tokenizer or load_tokenizer(engine_dir)

    def prepare(self, tensors: Mapping[str, np.ndarray]) -> PreparedRequest:
        tensors = check_neutral(tensors, TEXT)
        v = read_inputs(tensors, TEXT_INPUT_NAMES, required=("text_input",))
        try:
            prompt_ids = self.tokenizer.encode(v["text_input"], chat=v["apply_chat_template"])
        except ValueError as e:
            raise InvalidRequest(f"input 'apply_chat_template': {e}") from None
        check_prompt(prompt_ids, self.limits)
        sampling_kwargs(v, len(prompt_ids), self.limits)  # range checks now, not in the engine
        read_guide(v)  # a guide without its type (or the reverse); the engine compiles it
        bias = self._embedding_bias(v["embedding_bias_words"], v["embedding_bias_weights"])
        # not given: the tokenizer's end token, as NVIDIA's preprocessing fills OUT_END_ID / OUT_PAD_ID
        # (the engine stops on the model's own end tokens as well; Kiln never pads, pad_id only travels)
        eos = self.tokenizer.eos_id
        end_id = v["end_id"] if v["end_id"] is not None and v["end_id"] >= 0 else eos
        pad_id = v["pad_id"] if v["pad_id"] is not None and v["pad_id"] >= 0 else eos
        return PreparedRequest(prompt_ids, v, self.tokenizer.words(v["stop_words"]),
                               self.tokenizer.words(v["bad_words"]), end_id, pad_id, bias)

    def _embedding_bias(self, words: tuple[str, ...], weights: list[float]) -> np.ndarray:
        """NVIDIA's EMBEDDING_BIAS: a dense [vocab] FP32 vector, each word's weight added at each of
        its tokens (tokenized as a continuation, like stop words); empty when no word is given
        (NVIDIA's clients send [""] for none)."""
        if not any(words):  # no word (NVIDIA's clients send [""] with or without a weight)
            return np.zeros(0, np.float32)
        if len(words) != len(weights):
            raise InvalidRequest(f"inputs 'embedding_bias_words' ({len(words)}) and 'embedding_bias_weights' "
                                 f"({len(weights)}): send one weight per word")
        if any(not math.isfinite(x) for x in weights):
            raise InvalidRequest("input 'embedding_bias_weights': values must be finite")
        bias = np.zeros(self.vocab_size, np.float32)
        for word, weight in zip(words, weights):
            for tok in (self.tokenizer.words([word])[0] if word else []):
                bias[tok] += weight
        return bias

    def prepare_nvidia(self, tensors: Mapping[str, np.ndarray]) -> PreparedRequest:
        """The preprocessing model's inputs: NVIDIA's names (QUERY, REQUEST_OUTPUT_LEN, ...) and the
        sampling inputs, without the batch dimension."""
        return self.prepare({NVIDIA_INPUTS.get(k, k): v for k, v in tensors.items()})
