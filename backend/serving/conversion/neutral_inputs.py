"""NVIDIA inputs Kiln declares but cannot honour: accepted at their neutral value, refused otherwise.

NVIDIA's ``inflight_batcher_llm`` models declare inputs for features Kiln does not have (LoRA, prompt
tables, multimodal and encoder inputs, external draft tokens, lookahead decoding, top-p decay) and beam-search settings that do nothing at one beam. A client of NVIDIA's backend may
send any of them; an undeclared input makes Triton answer "unexpected inference input", which does
not say what to do. So every model declares them (``builder/stages/package.py`` renders the
declarations from this table into the config templates) and the models check them here: absent or
neutral passes, anything else is refused with one line naming the input, the value and why, never
silently ignored.

Pure numpy; no Triton.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np

from backend.serving.conversion.convert import InvalidRequest

__all__ = ["ENGINE", "TEXT", "NeutralInput", "NEUTRAL_INPUTS", "check_neutral", "declarations",
           "ensemble_input_maps", "neutral_names"]

ENGINE, TEXT = "engine", "text"   # tensorrt_llm / ensemble, tensorrt_llm_bls and preprocessing


@dataclasses.dataclass(frozen=True)
class NeutralInput:
    name: str
    triton_type: str          # config.pbtxt data_type
    dims: str                 # config.pbtxt dims, without the batch dimension
    models: tuple[str, ...]   # ENGINE and/or TEXT
    rule: str                 # "empty" | "zero" | "one" | "any" | "absent"
    why: str                  # what Kiln lacks (the error says it)

    def is_neutral(self, value: np.ndarray) -> bool:
        v = np.asarray(value)
        if self.rule == "any":
            return True
        if self.rule == "absent":
            return False
        if self.rule == "empty":
            return v.size == 0 or (v.dtype == object and all(not x for x in v.reshape(-1)))
        if v.dtype == object:   # a string where a number was expected: never neutral
            return False
        target = 1 if self.rule == "one" else 0
        return bool(np.all(v.astype(np.float64) == target))

    @property
    def allowed(self) -> str:
        return {"empty": "absent or empty", "zero": "absent, 0 or false", "one": "absent or 1",
                "absent": "absent", "any": "any"}[self.rule]


_LORA = "Kiln serves no LoRA adapters"
_PROMPT = "Kiln has no prompt tables (p-tuning)"
_MM = "Kiln serves text-only decoder models"
_DRAFT = "Kiln drafts with the bundle's EAGLE-3 head; it takes no external draft tokens"
_LOOKAHEAD = "Kiln has no lookahead decoding (it speculates with EAGLE-3)"
_BEAM = "beam search only: with one beam (Kiln's) it has no effect, as in TensorRT-LLM"
_BOTH = (ENGINE, TEXT)

NEUTRAL_INPUTS: tuple[NeutralInput, ...] = (
    # beam search settings: meaningless at beam width 1, accepted whatever their value
    NeutralInput("len_penalty", "TYPE_FP32", "[ 1 ]", (ENGINE,), "any", _BEAM),
    NeutralInput("length_penalty", "TYPE_FP32", "[ 1 ]", (TEXT,), "any", _BEAM),
    NeutralInput("early_stopping", "TYPE_BOOL", "[ 1 ]", _BOTH, "any", _BEAM),
    NeutralInput("beam_search_diversity_rate", "TYPE_FP32", "[ 1 ]", _BOTH, "any", _BEAM),
    # top-p decay: off at decay 1 (its minimum and reset ids then do nothing)
    NeutralInput("runtime_top_p_decay", "TYPE_FP32", "[ 1 ]", (ENGINE,), "one", "Kiln has no top-p decay"),
    NeutralInput("runtime_top_p_min", "TYPE_FP32", "[ 1 ]", (ENGINE,), "any", "top-p decay only"),
    NeutralInput("runtime_top_p_reset_ids", "TYPE_INT32", "[ 1 ]", (ENGINE,), "any", "top-p decay only"),
    # LoRA
    NeutralInput("lora_task_id", "TYPE_UINT64", "[ 1 ]", _BOTH, "absent", _LORA),
    NeutralInput("lora_weights", "TYPE_FP16", "[ -1, -1 ]", _BOTH, "empty", _LORA),
    NeutralInput("lora_config", "TYPE_INT32", "[ -1, 3 ]", _BOTH, "empty", _LORA),
    # prompt tables
    NeutralInput("prompt_embedding_table", "TYPE_FP16", "[ -1, -1 ]", _BOTH, "empty", _PROMPT),
    NeutralInput("prompt_vocab_size", "TYPE_INT32", "[ 1 ]", _BOTH, "zero", _PROMPT),
    NeutralInput("prompt_table_extra_ids", "TYPE_UINT64", "[ -1 ]", (ENGINE,), "empty", _PROMPT),
    NeutralInput("prompt_table_extra_id", "TYPE_UINT64", "[ 1 ]", (TEXT,), "zero", _PROMPT),
    # multimodal and encoder-decoder
    NeutralInput("image_input", "TYPE_FP16", "[ -1, -1, -1 ]", (TEXT,), "empty", _MM),
    NeutralInput("image_bytes_input", "TYPE_UINT8", "[ -1, -1, -1, -1 ]", (TEXT,), "empty", _MM),
    NeutralInput("image_url_input", "TYPE_STRING", "[ 1 ]", (TEXT,), "empty", _MM),
    NeutralInput("video_bytes_input", "TYPE_UINT8", "[ -1, -1, -1, -1 ]", (TEXT,), "empty", _MM),
    NeutralInput("decoder_text_input", "TYPE_STRING", "[ 1 ]", (TEXT,), "empty", "Kiln serves decoder-only models"),
    NeutralInput("encoder_input_features", "TYPE_FP16", "[ -1, -1 ]", (ENGINE,), "empty", _MM),
    NeutralInput("encoder_output_lengths", "TYPE_INT32", "[ 1 ]", (ENGINE,), "zero", _MM),
    NeutralInput("cross_attention_mask", "TYPE_BOOL", "[ -1, -1 ]", (ENGINE,), "empty", _MM),
    # external drafts (NVIDIA's draft-target model and its bls options)
    NeutralInput("draft_input_ids", "TYPE_INT32", "[ -1 ]", (ENGINE,), "empty", _DRAFT),
    NeutralInput("draft_logits", "TYPE_FP32", "[ -1, -1 ]", (ENGINE,), "empty", _DRAFT),
    NeutralInput("draft_acceptance_threshold", "TYPE_FP32", "[ 1 ]", (ENGINE,), "any", "external drafts only"),
    NeutralInput("num_draft_tokens", "TYPE_INT32", "[ 1 ]", (TEXT,), "zero", _DRAFT),
    NeutralInput("use_draft_logits", "TYPE_BOOL", "[ 1 ]", (TEXT,), "zero", _DRAFT),
    # lookahead decoding
    NeutralInput("lookahead_window_size", "TYPE_INT32", "[ 1 ]", _BOTH, "zero", _LOOKAHEAD),
    NeutralInput("lookahead_ngram_size", "TYPE_INT32", "[ 1 ]", _BOTH, "zero", _LOOKAHEAD),
    NeutralInput("lookahead_verification_set_size", "TYPE_INT32", "[ 1 ]", _BOTH, "zero", _LOOKAHEAD),
    # per-request KV reuse figures
    NeutralInput("return_kv_cache_reuse_stats", "TYPE_BOOL", "[ 1 ]", _BOTH, "zero",
                 "ask return_perf_metrics for kv_cache_reused_blocks"),
)


def _for(model: str) -> tuple[NeutralInput, ...]:
    return tuple(n for n in NEUTRAL_INPUTS if model in n.models)


def neutral_names(model: str) -> tuple[str, ...]:
    """The inputs of this table that ``model`` (ENGINE or TEXT) declares, to read with the others."""
    return tuple(n.name for n in _for(model))


def check_neutral(tensors: Mapping[str, np.ndarray], model: str) -> dict[str, np.ndarray]:
    """Raise InvalidRequest naming the first declared-but-unsupported input with a non-neutral value;
    return the other tensors (what the model reads)."""
    mine = _for(model)
    for n in mine:
        value = tensors.get(n.name)
        if value is not None and not n.is_neutral(value):
            shown = np.asarray(value).reshape(-1)[:4].tolist()
            raise InvalidRequest(f"input '{n.name}': {shown} is not supported ({n.why}); allowed: {n.allowed}")
    names = {n.name for n in mine}
    return {k: v for k, v in tensors.items() if k not in names}


def declarations(model: str) -> str:
    """config.pbtxt input entries for ``model`` (ENGINE or TEXT), one per line, each ending with a
    comma so that a template puts them before its last declared input."""
    return "".join(f'  {{ name: "{n.name}" data_type: {n.triton_type} dims: {n.dims} optional: true }},\n'
                   for n in _for(model))


def ensemble_input_maps() -> str:
    """The ensemble's preprocessing step takes every one of them (preprocessing checks them)."""
    return "".join(f'      input_map {{ key: "{n.name}" value: "{n.name}" }}\n' for n in _for(TEXT))
