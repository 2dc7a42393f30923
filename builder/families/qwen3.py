"""Qwen3 (dense): Qwen2's attention pattern with a per-head RMS norm on q and k before rope, an explicit
``head_dim`` and ``attention_bias`` for q/k/v and o (off in every released checkpoint)."""
from __future__ import annotations

from backend.arch_spec import ArchSpec
from builder.families.base import HF_ACTIVATIONS, LLAMA_LAYER, Family, HfConfig
from builder.families.qwen2 import FIELDS as QWEN2_FIELDS, qwen_layers

FIELDS = QWEN2_FIELDS | {"attention_bias"}
LAYER = {**LLAMA_LAYER, "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}


def to_spec(cfg: HfConfig) -> ArchSpec:
    bias = cfg.flag("attention_bias", False)
    return ArchSpec(**qwen_layers(cfg), activation=cfg.choice("hidden_act", HF_ACTIVATIONS, "silu"), qk_norm=True,
                    qkv_bias=bias, o_bias=bias, tie_word_embeddings=cfg.flag("tie_word_embeddings", False))


FAMILY = Family("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), ("qwen3",), FIELDS, to_spec, LAYER, runtime=True)
