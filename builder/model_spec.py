"""The engine.json ``model`` section, read from an HF ``config.json`` (+ generation_config.json).

Its ``arch`` is the architecture spec (backend/arch_spec.py) the checkpoint's family maps the config to
(builder/families/); the other keys are the shapes and token ids, as before the spec existed.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from builder import families
from builder.sources import read_json_object
from builder.stages.base import StageError

# a ModelOpt checkpoint repeats hf_quant_config.json in config.json; the import and compile stages read it
MODELOPT_FIELDS = frozenset({"quantization_config"})


def _eos_ids(*values: Any) -> list[int]:
    for v in values:
        if v is None:
            continue
        return [int(x) for x in (v if isinstance(v, list) else [v])]
    return []


def model_spec(checkpoint: Path, dtype: str) -> dict[str, Any]:
    """Shapes and token ids the runtime needs; raises StageError naming a missing config field."""
    path = checkpoint / "config.json"
    hf = read_json_object(path)  # a JSON list here was an AttributeError traceback
    gen_path = checkpoint / "generation_config.json"
    gen = read_json_object(gen_path) if gen_path.is_file() else {}

    def need(key: str) -> Any:
        if hf.get(key) is None:
            raise StageError(f"{path}: {key}: missing; a {hf.get('model_type', '?')} config must give it")
        return hf[key]

    family = families.family_of(hf, path)
    if not family.runtime:
        raise families.not_yet(family, f"{path}: architectures")
    arch = family.name
    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    rope_params = hf.get("rope_parameters") or {}  # transformers 5 moved rope_theta/scaling here
    rope_theta = hf.get("rope_theta") or rope_params.get("rope_theta") or 10000.0
    rope_scaling = hf.get("rope_scaling")
    if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
        rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
    eos = _eos_ids(gen.get("eos_token_id"), hf.get("eos_token_id"))
    pad = gen.get("pad_token_id", hf.get("pad_token_id"))
    modelopt = MODELOPT_FIELDS if (checkpoint / "hf_quant_config.json").is_file() else frozenset()
    spec = family.spec(hf, path, modelopt)
    return {
        "architecture": arch,
        "hidden_size": hidden,
        "intermediate_size": int(need("intermediate_size")),
        "num_layers": int(need("num_hidden_layers")),
        "num_heads": heads,
        "num_kv_heads": int(hf.get("num_key_value_heads") or heads),
        "head_dim": int(hf.get("head_dim") or hidden // heads),
        "vocab_size": int(need("vocab_size")),
        "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(rope_theta),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(need("max_position_embeddings")),
        "tie_word_embeddings": spec.tie_word_embeddings,   # the family's default when config.json is silent
        # Qwen2 has q/k/v biases without saying so in config.json
        "attention_bias": bool(hf.get("attention_bias", arch == "qwen2")),
        "mlp_bias": bool(hf.get("mlp_bias", False)),
        # the sliding layers' window (the narrowest, should kinds differ); the spec holds it per layer kind
        # (None: no sliding layer; the family read use_sliding_window and the like into the spec)
        "sliding_window": min((a.window for a in spec.attention if a.window), default=None),
        "bos_token_id": gen.get("bos_token_id", hf.get("bos_token_id")),
        "eos_token_ids": eos,
        "pad_token_id": pad if pad is not None else (eos[0] if eos else None),
        "dtype": dtype,
        "arch": spec.to_dict(),
    }
