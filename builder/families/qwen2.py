"""Qwen2 / Qwen2.5: the Llama layer with q/k/v biases (always: the config has no switch for them) and
no o bias; a window only with ``use_sliding_window``, on the layers from ``max_window_layers`` on
(or as ``layer_types`` says), as transformers' Qwen2Config derives them."""
from __future__ import annotations

from typing import Callable

from backend.arch_spec import ArchSpec
from builder.families.base import (HF_ACTIVATIONS, LLAMA_LAYER, Family, HfConfig, attention_pattern,
                                   hf_layer_types, num_layers)
from builder.families.rope import ROPE_FIELDS, shared_rope

FIELDS = ROPE_FIELDS | {"hidden_act", "use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}


def _from_max_window_layers(i: int, max_window_layers: int) -> bool:
    return i >= max_window_layers


def qwen_layers(cfg: HfConfig, slides: Callable[[int, int], bool] = _from_max_window_layers) -> dict:
    """The attention pattern the Qwen families share; ``sliding_window`` counts only with use_sliding_window.
    Without ``layer_types``, layer i slides when ``slides(i, max_window_layers)`` (the config class's rule)."""
    window = cfg.positive_int("sliding_window", 4096) if cfg.flag("use_sliding_window", False) else None
    mwl = cfg.positive_int("max_window_layers", 28) if window else None
    default = ["sliding_attention" if window and slides(i, mwl) else "full_attention" for i in range(num_layers(cfg))]
    kinds = hf_layer_types(cfg, default)
    rope = shared_rope(cfg)
    return attention_pattern(cfg, kinds, window, {"full": rope, "sliding": rope}, "use_sliding_window")


def to_spec(cfg: HfConfig) -> ArchSpec:
    return ArchSpec(**qwen_layers(cfg), activation=cfg.choice("hidden_act", HF_ACTIVATIONS, "silu"), qkv_bias=True,
                    tie_word_embeddings=cfg.flag("tie_word_embeddings", False))


FAMILY = Family("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), ("qwen2",), FIELDS, to_spec, LLAMA_LAYER, runtime=True)
