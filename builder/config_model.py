"""Config checks that need the checkpoint's shape (docs/contracts.md section 1).

The import stage calls :func:`check_against_model` once the checkpoint's config is known: tp_size
against heads, KV heads, intermediate size and vocab (the runtime's ``tp_rules``), max_seq_len against
the model's context, group sizes and NVFP4 blocks against in-features, EAGLE aux layers against depth.
"""
from __future__ import annotations

from typing import Any

from backend.runtime.tp_rules import allowed_tp_sizes, group_problem, tp_problem
from builder.config import GROUPED_FORMATS, BuildConfig
from builder.schema import ConfigError

# what an expert model (model.arch.experts) builds with today: key -> (its value in the config, the one
# value allowed). The rest has no expert path yet and is refused, never run as a wrong graph: ModelOpt's
# quantizers and the bundle's quantized linears (and its FP8 KV calibration) know no packed experts,
# tensor parallelism does not split them, and the EAGLE draft and the ONNX/TensorRT decoder graph have no
# expert layer. Every attention backend runs them (the fused Triton layer with the fused expert kernel).
EXPERT_LIMITS = {
    "quantization.format": (lambda c: c.quantization.format, "none"),
    "quantization.kv_cache": (lambda c: c.quantization.kv_cache, "none"),
    "engine.tp_size": (lambda c: c.engine.tp_size, 1),
    "speculative.method": (lambda c: c.speculative.method, "none"),
    "tensorrt.enabled": (lambda c: c.tensorrt.enabled, False),
}


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def check_experts(cfg: BuildConfig, model: dict[str, Any]) -> None:
    """Refuse, naming the key, what an expert model cannot be built with yet (``EXPERT_LIMITS``)."""
    experts = (model.get("arch") or {}).get("experts")
    if not experts:
        return
    for key, (value_of, allowed) in EXPERT_LIMITS.items():
        value = value_of(cfg)
        if value != allowed:
            raise ConfigError(cfg.file, key, f"{_show(value)} is not supported for a mixture-of-experts model "
                              f"({model.get('architecture')}, {experts['num_experts']} experts) yet",
                              _show(allowed))


def check_against_model(cfg: BuildConfig, model: dict[str, Any]) -> None:
    """Checks that need the checkpoint's shape; ``model`` holds engine.json "model" keys.

    Raises ConfigError in the same one-line style as construction, naming the config key to change.
    """
    f, e, q = cfg.file, cfg.engine, cfg.quantization
    check_experts(cfg, model)
    heads = model["num_heads"]
    problem = tp_problem(model, e.tp_size)   # backend's rules: refused here exactly when the runtime would
    if problem:
        raise ConfigError(f, "engine.tp_size", problem, " | ".join(map(str, allowed_tp_sizes(
            model, quant_format=q.format, group_size=q.group_size))))
    mpe = model.get("max_position_embeddings")
    if mpe and e.max_seq_len > mpe:
        raise ConfigError(f, "engine.max_seq_len", f"{e.max_seq_len} exceeds the model's context of "
                          f"{mpe} tokens", f"2..{mpe}")
    in_features = {"hidden_size (qkv, gate_up)": model["hidden_size"],
                   "num_heads*head_dim (o)": heads * model["head_dim"],
                   "intermediate_size (down)": model["intermediate_size"]}
    if q.format in GROUPED_FORMATS:
        for what, n in in_features.items():
            if n % q.group_size:
                ok = [g for g in (16, 32, 64, 128, 256) if all(v % g == 0 for v in in_features.values())]
                raise ConfigError(f, "quantization.group_size", f"{q.group_size} does not divide the model's "
                                  f"{what} = {n}", " | ".join(map(str, ok)) or "none fits this model")
    if q.format == "nvfp4":
        for what, n in in_features.items():
            if n % 16:
                raise ConfigError(f, "quantization.format", f"nvfp4 needs in-features divisible by 16, "
                                  f"the model's {what} = {n}", "fp8 | int8_sq | none")
    # after the group checks: a group_size that does not fit the whole model is its own mistake, not tp's
    problem = group_problem(model, e.tp_size, q.format, q.group_size)
    if problem:
        raise ConfigError(f, "engine.tp_size", problem, " | ".join(map(str, allowed_tp_sizes(
            model, quant_format=q.format, group_size=q.group_size))))
    aux = cfg.speculative.aux_layers
    if cfg.speculative.method != "none" and aux is not None:
        bad = [a for a in aux if not 0 <= a < model["num_layers"]]
        if bad:
            raise ConfigError(f, "speculative.aux_layers", f"layer {bad[0]} does not exist",
                              f"0..{model['num_layers'] - 1}")
