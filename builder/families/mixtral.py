"""Mixtral (MixtralForCausalLM): Mistral's attention (a window on every layer only when ``sliding_window``
is set; transformers' MixtralConfig defaults it to none) and, on every layer, ``num_local_experts`` gated
experts of width ``intermediate_size``, ``num_experts_per_tok`` chosen per token by a softmax router whose
top-k probabilities are renormalised to sum to one (MixtralTopKRouter)."""
from __future__ import annotations

from backend.arch_spec import ArchSpec
from builder.families.base import HF_ACTIVATIONS, Family, HfConfig, attention_pattern, num_layers
from builder.families.experts import TRAINING_ONLY, experts
from builder.families.rope import ROPE_FIELDS, shared_rope

FIELDS = ROPE_FIELDS | TRAINING_ONLY | {"hidden_act", "sliding_window", "num_local_experts", "num_experts_per_tok"}
# the published checkpoints' names (transformers 5 writes them too): the router is block_sparse_moe.gate,
# the experts' w1/w3/w2 are gate/up/down (builder/expert_weights.py reads them)
LAYER = {"attn_norm": "input_layernorm", "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj",
         "v_proj": "self_attn.v_proj", "o_proj": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm",
         "router": "block_sparse_moe.gate"}


def to_spec(cfg: HfConfig) -> ArchSpec:
    window = cfg.positive_int("sliding_window")
    kind = "sliding" if window else "full"
    n = num_layers(cfg)
    return ArchSpec(
        **attention_pattern(cfg, [kind] * n, window, {kind: shared_rope(cfg)}),
        activation=cfg.choice("hidden_act", HF_ACTIVATIONS, "silu"),
        tie_word_embeddings=cfg.flag("tie_word_embeddings", False),
        experts=experts(cfg, "num_local_experts", "intermediate_size", list(range(n)), renormalize=True,
                        defaults={"num_local_experts": 8, "num_experts_per_tok": 2}))


FAMILY = Family("mixtral", ("MixtralForCausalLM",), ("mixtral",), (), FIELDS, to_spec, LAYER, runtime=True)
