"""Mistral: the Llama layer without biases; ``sliding_window`` (transformers' default 4096 when the file
leaves it out, null for none) makes every layer attend to the last that many positions."""
from __future__ import annotations

from backend.arch_spec import ArchSpec
from builder.families.base import HF_ACTIVATIONS, LLAMA_LAYER, Family, HfConfig, attention_pattern, num_layers
from builder.families.rope import ROPE_FIELDS, shared_rope

FIELDS = ROPE_FIELDS | {"hidden_act", "sliding_window"}


def to_spec(cfg: HfConfig) -> ArchSpec:
    window = cfg.positive_int("sliding_window") if "sliding_window" in cfg.data else 4096
    kind = "sliding" if window else "full"
    return ArchSpec(
        **attention_pattern(cfg, [kind] * num_layers(cfg), window, {kind: shared_rope(cfg)}),
        activation=cfg.choice("hidden_act", HF_ACTIVATIONS, "silu"),
        tie_word_embeddings=cfg.flag("tie_word_embeddings", False))


FAMILY = Family("mistral", ("MistralForCausalLM",), ("mistral",), ("mistral",), FIELDS, to_spec, LLAMA_LAYER,
                runtime=True)
