"""Gemma 3 text (model_type gemma3_text, Gemma3ForCausalLM; GGUF architecture gemma3).

Four norms a layer, each ``x * (1 + w)``, plus the same norm per head on q and k; a GELU-tanh gated MLP;
embeddings times sqrt(hidden_size); scores scaled by ``query_pre_attn_scalar ** -0.5``; layers sliding
(window ``sliding_window``) except every ``sliding_window_pattern``-th, which is full; the sliding layers
rotate with ``rope_local_base_freq`` (10k) and the full ones with ``rope_theta`` (1M) and any scaling.
Defaults are transformers' Gemma3TextConfig's. Softcaps (Gemma 2) are refused, not ignored.
"""
from __future__ import annotations

from backend.arch_spec import ArchSpec, Rope
from builder.families.base import (HF_ACTIVATIONS, Family, HfConfig, attention_pattern, hf_layer_types,
                                   num_layers)
from builder.families.rope import flat_rope_parameters, object_field, to_rope

PER_TYPE = {"full_attention": "full", "sliding_attention": "sliding"}
FIELDS = frozenset({"hidden_activation", "attention_bias", "query_pre_attn_scalar", "sliding_window", "layer_types",
                    "sliding_window_pattern", "_sliding_window_pattern", "rope_parameters", "rope_scaling",
                    "rope_theta", "rope_local_base_freq", "final_logit_softcapping", "attn_logit_softcapping",
                    "use_bidirectional_attention"})
LAYER = {"attn_norm": "input_layernorm", "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj",
         "v_proj": "self_attn.v_proj", "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",
         "o_proj": "self_attn.o_proj", "attn_post_norm": "post_attention_layernorm",
         "mlp_norm": "pre_feedforward_layernorm", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
         "down_proj": "mlp.down_proj", "mlp_post_norm": "post_feedforward_layernorm"}


def _ropes(cfg: HfConfig) -> dict[str, Rope]:
    params = cfg.data.get("rope_parameters")
    if isinstance(params, dict) and set(params) & set(PER_TYPE):
        # transformers 5 writes a dict per layer type; beside them it leaves rope_type default / rope_theta null
        for key, value in params.items():
            if key not in PER_TYPE and (key, value) not in (("rope_type", "default"), ("rope_theta", None)):
                raise cfg.refuse(f"rope_parameters.{key}", f"{value!r:.60} beside the per-layer-type entries",
                                 " | ".join(PER_TYPE))
        full = dict(params.get("full_attention") or {})
        sliding = dict(params.get("sliding_attention") or {})
        full.update(object_field(cfg, "rope_scaling"))
        full.setdefault("rope_theta", cfg.get("rope_theta", 1e6))
        where = "rope_parameters.full_attention"
    else:   # the older form: rope_theta (+ rope_scaling) for full layers, rope_local_base_freq for sliding
        where, full = flat_rope_parameters(cfg, 1e6)
        sliding = {}
    sliding.setdefault("rope_theta", cfg.get("rope_local_base_freq", 1e4))
    return {"full": to_rope(cfg, full, where), "sliding": to_rope(cfg, sliding, "rope_parameters.sliding_attention")}


def to_spec(cfg: HfConfig) -> ArchSpec:
    cfg.require("final_logit_softcapping", (None,), "logit softcapping is not supported")
    cfg.require("attn_logit_softcapping", (None,), "attention softcapping is not supported")
    cfg.require("use_bidirectional_attention", (None, False), "bidirectional (encoder) attention is not supported")
    pattern = cfg.positive_int("sliding_window_pattern", cfg.positive_int("_sliding_window_pattern", 6))
    default = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers(cfg))]
    bias = cfg.flag("attention_bias", False)
    return ArchSpec(
        **attention_pattern(cfg, hf_layer_types(cfg, default), cfg.positive_int("sliding_window", 4096), _ropes(cfg)),
        norm="rms_one_plus", norm_placement="pre_post", qk_norm=True,
        activation=cfg.choice("hidden_activation", HF_ACTIVATIONS, "gelu_pytorch_tanh"), qkv_bias=bias, o_bias=bias,
        tie_word_embeddings=cfg.flag("tie_word_embeddings", True), embedding_scale="sqrt_hidden",
        query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", 256))


# Gemma 3's turns: <start_of_turn>user|model, text, <end_of_turn>; no system role, so a system message
# opens the first user turn; one <bos> first. Rendered by backend/serving/conversion/tokenizer.py
# (trim_blocks, lstrip_blocks); content as a string or as OpenAI text parts.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' else none %}"
    "{% for m in messages if m['role'] != 'system' %}"
    "{% set text = m['content'] if m['content'] is string"
    " else m['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if loop.first and system is not none %}{{ system | trim }}\n\n{% endif %}"
    "{{ text | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

FAMILY = Family("gemma3", ("Gemma3ForCausalLM",), ("gemma3_text",), ("gemma3",), FIELDS, to_spec, LAYER,
                runtime=True, chat_template=CHAT_TEMPLATE)
