"""Llama 2 / 3.x (and SmolLM2, which is Llama-shaped): every layer full attention with one rope,
llama3 rope scaling from ``rope_scaling`` / ``rope_parameters``; ``attention_bias`` puts biases on
q/k/v and o alike, ``mlp_bias`` on the three MLP projections."""
from __future__ import annotations

from backend.arch_spec import ArchSpec
from builder.families.base import HF_ACTIVATIONS, LLAMA_LAYER, Family, HfConfig, attention_pattern, num_layers
from builder.families.rope import ROPE_FIELDS, shared_rope

FIELDS = ROPE_FIELDS | {"hidden_act", "attention_bias", "mlp_bias"}


def to_spec(cfg: HfConfig) -> ArchSpec:
    bias = cfg.flag("attention_bias", False)
    return ArchSpec(
        **attention_pattern(cfg, ["full"] * num_layers(cfg), None, {"full": shared_rope(cfg)}),
        activation=cfg.choice("hidden_act", HF_ACTIVATIONS, "silu"), qkv_bias=bias, o_bias=bias,
        mlp_bias=cfg.flag("mlp_bias", False), tie_word_embeddings=cfg.flag("tie_word_embeddings", False))


FAMILY = Family("llama", ("LlamaForCausalLM",), ("llama",), ("llama",), FIELDS, to_spec, LLAMA_LAYER, runtime=True)
