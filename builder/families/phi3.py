"""Phi-3 / Phi-4 (model_type phi3): q/k/v stored as one ``qkv_proj`` (q rows, then k, then v) and gate/up
as one ``gate_up_proj`` (gate rows first); LongRoPE with short/long factors and the pretraining length
in the top-level ``original_max_position_embeddings``; ``partial_rotary_factor`` (Phi-4-mini: 0.75);
``sliding_window`` (Phi-3-mini: 2047) on every layer when set."""
from __future__ import annotations

from backend.arch_spec import ArchSpec
from builder.families.base import HF_ACTIVATIONS, Family, HfConfig, attention_pattern, num_layers
from builder.families.rope import ROPE_FIELDS, shared_rope

FIELDS = ROPE_FIELDS | {"hidden_act", "original_max_position_embeddings", "sliding_window"}
LAYER = {"attn_norm": "input_layernorm", "qkv_proj": "self_attn.qkv_proj", "o_proj": "self_attn.o_proj",
         "mlp_norm": "post_attention_layernorm", "gate_up_proj": "mlp.gate_up_proj", "down_proj": "mlp.down_proj"}


def to_spec(cfg: HfConfig) -> ArchSpec:
    cfg.positive_int("original_max_position_embeddings")
    window = cfg.positive_int("sliding_window")
    kind = "sliding" if window else "full"
    return ArchSpec(
        **attention_pattern(cfg, [kind] * num_layers(cfg), window, {kind: shared_rope(cfg)}),
        activation=cfg.choice("hidden_act", HF_ACTIVATIONS, "silu"), qkv="fused", gate_up="fused",
        tie_word_embeddings=cfg.flag("tie_word_embeddings", False))


FAMILY = Family("phi3", ("Phi3ForCausalLM",), ("phi3",), ("phi3",), FIELDS, to_spec, LAYER, runtime=True)
