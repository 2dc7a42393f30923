"""What a family file is made of: ``Family`` (its names, the config fields it reads, its tensor table and
the function that maps config.json to an ``ArchSpec``) and ``HfConfig``, the reader those functions use,
which refuses a value it cannot map in one line naming the file, the field and the value.

A config.json field is either read by the family (``Family.fields``), read by ``builder/model_spec.py``
for the shapes and token ids (``SHAPE_FIELDS``), or known to change nothing computed (``HARMLESS``);
anything else is refused: a field Kiln does not understand may change the model (a softcap, a new norm),
so guessing would build an engine that generates garbage.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Mapping

from backend.arch_spec import ArchSpec, Attention, Rope
from builder.stages.base import StageError

# Metadata, training-only settings and the transformers PretrainedConfig defaults saved with every model
HARMLESS = frozenset({
    "transformers_version", "architectures", "model_type", "_name_or_path", "torch_dtype", "dtype",
    "initializer_range", "use_cache", "attention_dropout", "hidden_dropout", "embd_pdrop", "resid_pdrop",
    "output_hidden_states", "output_attentions", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder",
    "id2label", "label2id", "problem_type", "tokenizer_class", "auto_map", "cache_implementation",
    "pretraining_tp",   # tensor-parallel slicing during pretraining: the same matmuls, split
})
# read by builder/model_spec.py into the model section's own keys
SHAPE_FIELDS = frozenset({
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
    "bos_token_id", "eos_token_id", "pad_token_id",
})
# HF layer_types names -> the spec's attention kinds
HF_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}
HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}

# the tensors outside the layers, named as every family here stores them (lm_head absent when tied)
GLOBAL_TENSORS = {"embed": "model.embed_tokens", "final_norm": "model.norm", "lm_head": "lm_head"}
LAYER_PREFIX = "model.layers.{i}."


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class HfConfig:
    """A config.json's fields as one family reads them; ``default`` is the transformers class's own, used
    when the file leaves a field out (transformers' ``save_pretrained`` writes them, hand-made files may not)."""

    def __init__(self, data: Mapping[str, Any], path: Path | str, family: str) -> None:
        self.data, self.path, self.family = dict(data), path, family

    def refuse(self, field: str, problem: str, allowed: str) -> StageError:
        return StageError(f"{self.path}: {field}: {problem}; allowed: {allowed}")

    def get(self, field: str, default: Any = None) -> Any:
        value = self.data.get(field)
        return default if value is None else value

    def choice(self, field: str, table: Mapping[Any, Any], default: Any) -> Any:
        """The spec value the table maps this field's value to."""
        value = self.get(field, default)
        if not isinstance(value, (str, int, float, bool)) or value not in table:
            raise self.refuse(field, f"{_show(value)} is not supported by the {self.family} family",
                              " | ".join(map(str, table)))
        return table[value]

    def flag(self, field: str, default: bool) -> bool:
        value = self.get(field, default)
        if not isinstance(value, bool):
            raise self.refuse(field, f"{_show(value)} is not a boolean", "true | false")
        return value

    def positive_int(self, field: str, default: int | None = None) -> int | None:
        value = self.get(field, default)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise self.refuse(field, f"{_show(value)} is not a positive integer", "a positive integer")
        return value

    def require(self, field: str, allowed: tuple, why: str) -> None:
        """A field Kiln understands only at these values (a softcap it cannot apply, say)."""
        value = self.data.get(field)
        if value not in allowed:
            raise self.refuse(field, f"{_show(value)}: {why}", " | ".join(map(_json_name, allowed)))

    def check_fields(self, understood: frozenset[str]) -> None:
        for field, value in self.data.items():
            if field not in understood and field not in HARMLESS and field not in SHAPE_FIELDS:
                raise self.refuse(field, f"{_show(value)} is a field the {self.family} family does not "
                                  f"understand (refused, not ignored: it may change what the model computes)",
                                  f"the shape fields, metadata such as transformers_version, and "
                                  f"{', '.join(sorted(understood))}")


def _json_name(value: Any) -> str:
    return json.dumps(value) if value is None or isinstance(value, bool) else str(value)


@dataclasses.dataclass(frozen=True)
class Family:
    """One family: how transformers names it, what its config.json holds, where its tensors are."""
    name: str                               # model.architecture in engine.json
    architectures: tuple[str, ...]          # config.json "architectures" class names
    model_types: tuple[str, ...]            # config.json "model_type"
    gguf_architectures: tuple[str, ...]     # GGUF general.architecture
    fields: frozenset[str]                  # the config.json fields ``to_spec`` reads
    to_spec: Callable[[HfConfig], ArchSpec]
    # role -> module name under model.layers.{i}. (``.weight`` / ``.bias`` appended by the reader)
    layer_tensors: Mapping[str, str]
    runtime: bool                           # the runtime runs it today (else the build refuses it)
    # the family's chat turns as a Jinja template, for a checkpoint that carries none (a base model's
    # GGUF): chat requests are then written as the family's instruction-tuned models were trained
    chat_template: str | None = None

    def spec(self, hf: Mapping[str, Any], path: Path | str, also_understood: frozenset[str] = frozenset()) -> ArchSpec:
        cfg = HfConfig(hf, path, self.name)
        cfg.check_fields(self.fields | also_understood)
        return self.to_spec(cfg)

    def layer_tensor_names(self, i: int) -> dict[str, str]:
        """Layer ``i``'s module names by role, e.g. {"q_proj": "model.layers.3.self_attn.q_proj", ...}."""
        prefix = LAYER_PREFIX.format(i=i)
        return {role: prefix + name for role, name in self.layer_tensors.items()}


# the Llama layer, which Mistral, Qwen2 and Qwen3 share. Llama's post_attention_layernorm is the norm
# *before* the MLP; Gemma 3 names its four norms differently (see gemma3.py)
LLAMA_LAYER = {
    "attn_norm": "input_layernorm", "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj", "o_proj": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm",
    "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj",
}


def num_layers(cfg: HfConfig) -> int:
    n = cfg.positive_int("num_hidden_layers")
    if n is None:
        raise cfg.refuse("num_hidden_layers", "missing", "a positive integer")
    return n


def hf_layer_types(cfg: HfConfig, default: list[str]) -> list[str]:
    """The spec's attention kind of each layer: config.json's ``layer_types`` or the family's rule."""
    n, given = num_layers(cfg), cfg.data.get("layer_types")
    if given is None:
        return [HF_LAYER_TYPES[t] for t in default]
    if not isinstance(given, list) or len(given) != n:
        raise cfg.refuse("layer_types", f"{_show(given)} is not a list of {n} layer types",
                         f"a list of num_hidden_layers ({n}) names from " + " | ".join(HF_LAYER_TYPES))
    for i, t in enumerate(given):
        if t not in HF_LAYER_TYPES:
            raise cfg.refuse(f"layer_types[{i}]", f"{_show(t)} is not supported", " | ".join(HF_LAYER_TYPES))
    return [HF_LAYER_TYPES[t] for t in given]


def attention_pattern(cfg: HfConfig, kinds: list[str], window: int | None, ropes: Mapping[str, Rope],
                      window_field: str = "sliding_window") -> dict[str, Any]:
    """ArchSpec's ``layer_types`` and ``attention`` for these per-layer kinds (only the kinds used)."""
    if "sliding" in kinds and window is None:
        raise cfg.refuse(window_field, f"{_show(cfg.data.get(window_field))} gives no window, but layer_types has "
                         f"sliding layers", "a window for the sliding layers, or only full_attention layers")
    used = dict.fromkeys(kinds)
    return {"layer_types": tuple(kinds),
            "attention": tuple(Attention(k, ropes[k], window if k == "sliding" else None) for k in used)}
