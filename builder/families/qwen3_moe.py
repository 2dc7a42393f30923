"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention (per-head q/k norms) and, on layer i when i is not in
``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``, ``num_experts`` gated experts of width
``moe_intermediate_size``, ``num_experts_per_tok`` per token by a softmax router, renormalised only with
``norm_topk_prob``; the other layers keep a dense MLP of width ``intermediate_size``. No shared expert.
transformers 5 saves the expert count as ``num_local_experts``; published checkpoints say ``num_experts``."""
from __future__ import annotations

from backend.arch_spec import ArchSpec
from builder.families.base import HF_ACTIVATIONS, LLAMA_LAYER, Family, HfConfig
from builder.families.experts import TRAINING_ONLY, experts, qwen_sparse_layers
from builder.families.qwen2 import qwen_layers
from builder.families.qwen3 import FIELDS as QWEN3_FIELDS

FIELDS = QWEN3_FIELDS | TRAINING_ONLY | {"num_experts", "num_local_experts", "num_experts_per_tok",
                                         "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
                                         "mlp_only_layers"}
# Qwen3MoeConfig's values, for a config.json that leaves one out
DEFAULTS = {"num_experts": 128, "num_local_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768}
LAYER = {**LLAMA_LAYER, "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm", "router": "mlp.gate"}


def to_spec(cfg: HfConfig) -> ArchSpec:
    count = "num_experts" if cfg.get("num_experts") is not None else "num_local_experts"
    bias = cfg.flag("attention_bias", False)
    return ArchSpec(**qwen_layers(cfg), activation=cfg.choice("hidden_act", HF_ACTIVATIONS, "silu"), qk_norm=True,
                    qkv_bias=bias, o_bias=bias, tie_word_embeddings=cfg.flag("tie_word_embeddings", False),
                    experts=experts(cfg, count, "moe_intermediate_size", qwen_sparse_layers(cfg),
                                    renormalize=cfg.flag("norm_topk_prob", False), defaults=DEFAULTS))


FAMILY = Family("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), (), FIELDS, to_spec, LAYER, runtime=True)
