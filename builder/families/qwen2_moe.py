"""Qwen2-MoE (Qwen2MoeForCausalLM, Qwen1.5-MoE): Qwen2's attention (q/k/v biases with ``qkv_bias``, on by
default; no o bias) and, on the layers ``decoder_sparse_step`` and ``mlp_only_layers`` pick (as Qwen3-MoE),
``num_experts`` gated experts of width ``moe_intermediate_size``, ``num_experts_per_tok`` per token by a
softmax router, renormalised only with ``norm_topk_prob``, plus a shared expert of width
``shared_expert_intermediate_size`` that every token runs, its output times ``sigmoid(shared_expert_gate(x))``
(Qwen2MoeSparseMoeBlock). The other layers keep a dense MLP of width ``intermediate_size``; ``num_experts``
0 makes every layer dense, as transformers builds it."""
from __future__ import annotations

from backend.arch_spec import ArchSpec
from builder.families.base import HF_ACTIVATIONS, LLAMA_LAYER, Family, HfConfig
from builder.families.experts import TRAINING_ONLY, experts, qwen_sparse_layers
from builder.families.qwen2 import FIELDS as QWEN2_FIELDS, qwen_layers

FIELDS = QWEN2_FIELDS | TRAINING_ONLY | {"qkv_bias", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                         "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
                                         "mlp_only_layers"}
# Qwen2MoeConfig's values, for a config.json that leaves one out
DEFAULTS = {"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
            "shared_expert_intermediate_size": 5632}
LAYER = {**LLAMA_LAYER, "router": "mlp.gate"}


def _slides(i: int, max_window_layers: int) -> bool:
    # Qwen2MoeConfig's own default (not Qwen2's): the even-indexed layers below max_window_layers
    return i % 2 == 0 and i < max_window_layers


def to_spec(cfg: HfConfig) -> ArchSpec:
    dense = cfg.get("num_experts") == 0
    return ArchSpec(**qwen_layers(cfg, _slides), activation=cfg.choice("hidden_act", HF_ACTIVATIONS, "silu"),
                    qkv_bias=cfg.flag("qkv_bias", True), tie_word_embeddings=cfg.flag("tie_word_embeddings", False),
                    experts=None if dense else experts(
                        cfg, "num_experts", "moe_intermediate_size", qwen_sparse_layers(cfg),
                        renormalize=cfg.flag("norm_topk_prob", False), defaults=DEFAULTS,
                        shared_field="shared_expert_intermediate_size", shared_gate=True))


FAMILY = Family("qwen2_moe", ("Qwen2MoeForCausalLM",), ("qwen2_moe",), (), FIELDS, to_spec, LAYER, runtime=True)
