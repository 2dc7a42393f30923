"""Preprocessing: text request -> the engine model's inputs, fully validated against the engine.

Used by the ``preprocessing`` model (ensemble) and in-process by the ``bls`` model. Validating the
whole request here (not only tokenizing) means a bad request fails before it reaches the engine and
the engine step of the ensemble always receives every input with a value.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from backend import bundle
from backend.serving.convert import (EngineLimits, InvalidRequest, check_prompt, read_inputs,
                                    sampling_kwargs, to_words_list)
from backend.serving.tokenizer import TextTokenizer, load_tokenizer

__all__ = ["TEXT_INPUT_NAMES", "PreparedRequest", "Preprocessor", "preprocessing_outputs"]

TEXT_INPUT_NAMES = (
    "text_input", "max_tokens", "stream", "temperature", "top_k", "top_p", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "min_tokens", "seed", "end_id", "pad_id", "stop_words",
    "bad_words", "return_log_probs", "exclude_input_in_output", "apply_chat_template",
    "return_perf_metrics", "beam_width", "num_return_sequences",
)


@dataclasses.dataclass
class PreparedRequest:
    prompt_ids: list[int]
    values: dict[str, Any]          # converted text-level inputs (defaults filled)
    stop_words_ids: list[list[int]]
    bad_words_ids: list[list[int]]
    echo_text: str                  # prepended to the output (non-streaming, input not excluded)

    @property
    def stream(self) -> bool:
        return bool(self.values["stream"])

    def engine_tensors(self) -> dict[str, np.ndarray]:
        """The engine model's inputs (names of model_repository/engine/config.pbtxt.tmpl)."""
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
            # the engine takes INT64 so that "no seed"/"no end id" can travel as -1 through an ensemble
            "seed": np.array([-1 if v["seed"] is None else v["seed"] & 0x7FFFFFFFFFFFFFFF], dtype=np.int64),
            "end_id": i32(-1 if v["end_id"] is None else v["end_id"]),
            "return_log_probs": np.array([v["return_log_probs"]], dtype=bool),
            "return_perf_metrics": np.array([v["return_perf_metrics"]], dtype=bool),
            "stop_words_list": to_words_list(self.stop_words_ids),
            "bad_words_list": to_words_list(self.bad_words_ids),
        }


# engine input -> the preprocessing model's output name (a model's outputs may not reuse input names)
RENAMED_OUTPUTS = {k: "out_" + k for k in (
    "temperature", "top_k", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "min_tokens", "seed", "end_id", "return_log_probs", "return_perf_metrics")}


def preprocessing_outputs(prep: PreparedRequest) -> dict[str, np.ndarray]:
    """Outputs of the ``preprocessing`` model (model_repository/preprocessing/config.pbtxt.tmpl)."""
    out = {RENAMED_OUTPUTS.get(k, k): v for k, v in prep.engine_tensors().items()}
    out["echo_text"] = np.array([prep.echo_text.encode("utf-8")], dtype=object)
    # The ensemble always asks the engine for the acceptance figures: a decoupled ensemble sends a
    # response only once every output the client asked for exists, and a client that names no
    # outputs asks for all of them, so an output that appeared only on request would stall it.
    out["out_return_perf_metrics"] = np.array([True])
    return out


class Preprocessor:
    def __init__(self, engine_dir: str | Path, tokenizer: TextTokenizer | None = None):
        # The checked manifest (format, fields); the engine model checks the files' hashes.
        self.limits = EngineLimits.from_engine(bundle.read(engine_dir).engine)
        self.tokenizer = tokenizer or load_tokenizer(engine_dir)

    def prepare(self, tensors: Mapping[str, np.ndarray]) -> PreparedRequest:
        v = read_inputs(tensors, TEXT_INPUT_NAMES, required=("text_input",))
        try:
            prompt_ids = self.tokenizer.encode(v["text_input"], chat=v["apply_chat_template"])
        except ValueError as e:
            raise InvalidRequest(f"input 'apply_chat_template': {e}") from None
        check_prompt(prompt_ids, self.limits)
        sampling_kwargs(v, len(prompt_ids), self.limits)  # range checks now, not in the engine
        echo = "" if v["stream"] or v["exclude_input_in_output"] else v["text_input"]
        return PreparedRequest(prompt_ids, v, self.tokenizer.words(v["stop_words"]),
                               self.tokenizer.words(v["bad_words"]), echo)
