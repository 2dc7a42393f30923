"""The recipe table: Kiln's quantization names -> NVIDIA ModelOpt quantization configs.

One row per weight format and one per KV-cache format; everything else (group size, exclusions)
is applied to a deep copy of ModelOpt's own config, so a ModelOpt upgrade that retunes a recipe is
picked up unchanged. ModelOpt is imported only inside `modelopt_config`, so this table (and the
validation helpers) can be read without it.
"""

from __future__ import annotations

import copy
import fnmatch
from dataclasses import dataclass
from typing import Any, Iterable, Mapping


class QuantConfigError(ValueError):
    """A user mistake in the `quantization` section (one line: key, bad value, allowed values)."""


@dataclass(frozen=True)
class Recipe:
    name: str
    modelopt_cfg: str | None  # attribute of modelopt.torch.quantization; None = nothing to quantize
    export_algo: str | None  # `quant_algo` ModelOpt writes into hf_quant_config.json
    grouped: bool  # int4 weights in blocks of `group_size` along the input features
    fixed_block: int | None  # block size fixed by the format itself (NVFP4: 16)
    # Calibrated by ModelOpt's `max` algorithm (quantizers only observe during the forward loop), so
    # layer-by-layer calibration gives the whole-model ranges (quant/stream.py). AWQ and SmoothQuant
    # search over quantized forwards and rescale weights: whole-model only.
    streamable: bool
    summary: str


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("none", None, None, False, None, True, "weights stay in the model dtype"),
        Recipe("fp8", "FP8_DEFAULT_CFG", "FP8", False, None, True,
               "fp8 e4m3 weights (per-tensor scale) and activations (static per-tensor scale)"),
        Recipe("nvfp4", "NVFP4_DEFAULT_CFG", "NVFP4", False, 16, True,
               "e2m1 weights and activations, fp8 scale per 16 elements + fp32 global scale"),
        Recipe("int4_awq", "INT4_AWQ_CFG", "W4A16_AWQ", True, None, False,
               "int4 weights per group of `group_size` inputs, AWQ-lite smoothing, 16-bit activations"),
        Recipe("int8_sq", "INT8_SMOOTHQUANT_CFG", "W8A8_SQ_PER_CHANNEL", False, None, False,
               "int8 per-channel weights and per-tensor activations after SmoothQuant"),
        Recipe("w4a8_awq", "W4A8_AWQ_BETA_CFG", "W4A8_AWQ", True, None, False,
               "int4 AWQ weights per group with fp8 activations"),
    )
}

# KV cache: name -> (attribute of mtq holding the quantizer entries, engine.json kv_cache_dtype)
KV_RECIPES: dict[str, str | None] = {"none": None, "fp8": "FP8_KV_CFG"}


def allowed(table: Mapping[str, Any]) -> str:
    return " | ".join(table)


def get_recipe(fmt: str) -> Recipe:
    try:
        return RECIPES[fmt]
    except (KeyError, TypeError):
        raise QuantConfigError(f"quantization.format: unknown format {fmt!r}; allowed: {allowed(RECIPES)}") from None


def check_kv_cache(kv: str) -> str:
    if kv not in KV_RECIPES:
        raise QuantConfigError(f"quantization.kv_cache: unknown KV cache format {kv!r}; allowed: {allowed(KV_RECIPES)}")
    return kv


def check_group_size(fmt: str, group_size: int | None, in_features: Mapping[str, int]) -> int | None:
    """The group size recorded for `fmt` (None when the format has no user-chosen block).

    `in_features` maps a linear's module name to its input-feature count. INT4 packing exports whole
    blocks only, so the group must divide every quantized linear's input size: SmolLM2's hidden size
    576 = 2^6 * 9 is not a multiple of ModelOpt's default 128, hence the config default of 64.
    """
    recipe = get_recipe(fmt)
    if recipe.fixed_block is not None:
        bad = {n: k for n, k in in_features.items() if k % recipe.fixed_block}
        if bad:
            name, k = next(iter(bad.items()))
            raise QuantConfigError(f"quantization.format: {fmt} needs input features divisible by "
                                   f"{recipe.fixed_block}, but {name} has {k}; allowed: fp8 | int8_sq | none")
        return recipe.fixed_block
    if not recipe.grouped:
        return None
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0:
        raise QuantConfigError(f"quantization.group_size: {group_size!r} is not a positive integer; "
                               f"allowed: 16 | 32 | 64 | 128 | 256")
    bad = {n: k for n, k in in_features.items() if k % group_size}
    if bad:
        sizes = sorted(set(in_features.values()))
        fits = [g for g in (16, 32, 64, 128, 256) if all(k % g == 0 for k in sizes)]
        name, k = next(iter(bad.items()))
        raise QuantConfigError(
            f"quantization.group_size: {group_size} does not divide the input features of {name} ({k}); "
            f"int4 blocks must tile every linear's inputs {sizes}; allowed: {' | '.join(map(str, fits)) or 'none'}")
    return group_size


def check_exclude(patterns: Iterable[str], module_names: Iterable[str]) -> tuple[str, ...]:
    """Every pattern must match at least one module name (fnmatch): a pattern that matches nothing
    is almost always a typo that would silently quantize a layer meant to stay in full precision."""
    names = list(module_names)
    out = []
    for p in patterns:
        if not isinstance(p, str) or not p:
            raise QuantConfigError(f"quantization.exclude: {p!r} is not a module-name pattern; allowed: "
                                   f"fnmatch patterns such as 'lm_head' or 'model.layers.0.*'")
        if not any(fnmatch.fnmatchcase(n, p) for n in names):
            examples = ", ".join(n for n in names if n.count(".") <= 3)[:160]
            raise QuantConfigError(f"quantization.exclude: pattern {p!r} matches no module of the model; "
                                   f"module names look like: {examples} ...")
        out.append(p)
    return tuple(out)


def _set_block_size(cfg: dict, group_size: int) -> None:
    """Replace the static int4 block size along the last axis in every weight-quantizer entry
    (W4A8 has a list of two quantizer configs: the int4 block one and the fp8 per-tensor one)."""
    for entry in cfg["quant_cfg"]:
        if entry.get("quantizer_name") != "*weight_quantizer" or "cfg" not in entry:
            continue
        attrs = entry["cfg"] if isinstance(entry["cfg"], list) else [entry["cfg"]]
        for a in attrs:
            blocks = a.get("block_sizes")
            if blocks and blocks.get("type") == "static" and -1 in blocks:
                blocks[-1] = group_size


def modelopt_config(fmt: str, kv_cache: str, group_size: int | None = None,
                    exclude: Iterable[str] = ("lm_head",)) -> dict:
    """A fresh ModelOpt `mtq.quantize` config for the format, KV-cache format and exclusions.

    `exclude` holds fnmatch patterns of MODULE names; ModelOpt matches QUANTIZER names
    (`<module>.weight_quantizer`, `<module>.k_bmm_quantizer`, ...), so each pattern becomes
    `<pattern>.*` disabled, appended last because later entries win.
    """
    import modelopt.torch.quantization as mtq  # noqa: PLC0415 (heavy; only the quantize stage needs it)

    recipe = get_recipe(fmt)
    check_kv_cache(kv_cache)
    if recipe.modelopt_cfg is None:
        # KV-only quantization: every linear quantizer off, the attention KV quantizers added below.
        cfg: dict = {"quant_cfg": [{"quantizer_name": "*", "enable": False}], "algorithm": "max"}
    else:
        cfg = copy.deepcopy(getattr(mtq, recipe.modelopt_cfg))
    if recipe.grouped:
        assert group_size is not None, "validated by check_group_size"
        _set_block_size(cfg, group_size)
    if KV_RECIPES[kv_cache] is not None:
        cfg = mtq.update_quant_cfg_with_kv_cache_quant(cfg, getattr(mtq, KV_RECIPES[kv_cache])["quant_cfg"])
    for p in exclude:
        cfg["quant_cfg"].append({"quantizer_name": f"{p}.*", "enable": False})
    return cfg
