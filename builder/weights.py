"""HF checkpoint (plain or ModelOpt unified) -> runtime weight layout (docs/contracts.md section 3).

Names: ``model.layers.{i}.self_attn.{q,k,v}_proj`` fuse into ``layers.{i}.qkv``, ``mlp.{gate,up}_proj``
into ``layers.{i}.gate_up``, norms are renamed (``self_attn.{q,k}_norm`` to ``layers.{i}.{q,k}_norm`` when
the architecture spec has ``qk_norm``), ``attn.k_scale``/``attn.v_scale`` come from ModelOpt's
KV-cache scales. Unquantized linears are concatenated here; quantized ones go through
``quant.pack.pack_linear(fmt, parts)``, which knows each format's scale rules.
Tensors are yielded one at a time so the caller can stream them to disk.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from builder.expert_weights import expert_tensors, shared_expert_tensors
from builder.sources import read_json_object
from builder.stages.base import StageError

FUSED = {  # runtime name -> HF module names in fusion order
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}
NORMS = {"input_layernorm": "input_norm", "post_attention_layernorm": "post_attn_norm"}
# a checkpoint that stores them fused already (model.arch.qkv / gate_up "fused": Phi-3) holds the runtime's
# row order: q|k|v and gate|up
FUSED_IN_CHECKPOINT = {"qkv": ("self_attn.qkv_proj",), "gate_up": ("mlp.gate_up_proj",)}
# per-head norms on q and k before rope (model.arch.qk_norm: Qwen3), weights [head_dim]
QK_NORMS = {"self_attn.q_norm": "q_norm", "self_attn.k_norm": "k_norm"}
# model.arch.norm_placement pre_post (Gemma 3): the MLP's own norms; post_attn_norm then follows attention
FF_NORMS = {"pre_feedforward_layernorm": "pre_ff_norm", "post_feedforward_layernorm": "post_ff_norm"}
# ModelOpt has written the KV scales under both names across versions
KV_SCALE_NAMES = {"k_scale": ("self_attn.k_proj.k_scale", "self_attn.k_scale"),
                  "v_scale": ("self_attn.v_proj.v_scale", "self_attn.v_scale")}
MODELOPT_ALGOS = {"FP8": "fp8", "NVFP4": "nvfp4", "W4A16_AWQ": "int4_awq", "W4A8_AWQ": "w4a8_awq",
                  "W8A8_SQ_PER_CHANNEL": "int8_sq", None: "none"}


class Checkpoint:
    """Lazy tensor access across the shards of an HF safetensors checkpoint."""

    def __init__(self, path: Path):
        self.path = path
        self._where: dict[str, Path] = {}
        for shard in sorted(path.glob("*.safetensors")):
            with safe_open(str(shard), "pt") as f:
                for name in f.keys():
                    self._where[name] = shard

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return list(self._where)

    def get(self, name: str) -> torch.Tensor:
        # Open per tensor: a handle kept open keeps every page read through its memory map resident,
        # so packing grew by the whole checkpoint's size (docs/perf/build-memory.json)
        with safe_open(str(self._where[name]), "pt") as f:
            return f.get_tensor(name)

    def quant_format(self) -> tuple[str, str | None, int | None]:
        """(weight format, kv cache algo, group size) from hf_quant_config.json, if any."""
        path = self.path / "hf_quant_config.json"
        if not path.is_file():
            return "none", None, None
        q = read_json_object(path).get("quantization", {})
        algo = q.get("quant_algo") if isinstance(q, dict) else q
        if not isinstance(algo, (str, type(None))) or algo not in MODELOPT_ALGOS:  # a list is unhashable
            raise StageError(f"{path}: quant_algo: unsupported '{algo}'; allowed: "
                             f"{', '.join(a for a in MODELOPT_ALGOS if a)}")
        return MODELOPT_ALGOS[algo], q.get("kv_cache_quant_algo"), q.get("group_size")


def _module(ckpt: Checkpoint, prefix: str) -> dict[str, torch.Tensor]:
    dot = prefix + "."
    return {n[len(dot):]: ckpt.get(n) for n in ckpt.names() if n.startswith(dot) and "." not in n[len(dot):]}


def _pack(name: str, parts: list[dict[str, torch.Tensor]], fmt: str, dtype: torch.dtype,
          unquantized: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    biases = [p.pop("bias", None) for p in parts]
    for p in parts:  # KV scales ride on k_proj/v_proj in ModelOpt's export; emitted separately
        p.pop("k_scale", None), p.pop("v_scale", None)
    quantized = ["weight_scale" in p for p in parts]
    assert all(quantized) or not any(quantized), f"{name}: fused parts mix quantized and plain weights"
    if any(quantized):
        from quant.pack import PackError, pack_linear  # noqa: PLC0415 (only quantized bundles need quant/)
        try:
            packed = pack_linear(fmt, parts, dtype)
        except (PackError, ValueError) as e:
            raise StageError(f"{name}: cannot pack the exported {fmt} tensors: {e}") from None
        for suffix, t in packed.items():
            yield f"{name}.{suffix}", t
    else:
        unquantized.append(name)
        yield f"{name}.weight", torch.cat([p["weight"].to(dtype) for p in parts], dim=0)
    if any(b is not None for b in biases):
        assert all(b is not None for b in biases), f"{name}: only some fused parts have a bias"
        yield f"{name}.bias", torch.cat([b.to(dtype) for b in biases], dim=0)


def runtime_tensors(ckpt: Checkpoint, model: dict, dtype: torch.dtype, fmt: str,
                    unquantized: list[str], advance=lambda n=1: None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (runtime name, tensor) for the whole model; ``unquantized`` collects plain linears."""
    def need(name: str) -> torch.Tensor:
        if name not in ckpt:
            raise StageError(f"{ckpt.path}: tensor {name} is missing; the checkpoint is incomplete")
        return ckpt.get(name)

    yield "embed_tokens.weight", need("model.embed_tokens.weight").to(dtype)
    yield "norm.weight", need("model.norm.weight").to(dtype)
    if not model["tie_word_embeddings"]:
        head = _module(ckpt, "lm_head")
        if "weight" not in head:
            raise StageError(f"{ckpt.path}: tensor lm_head.weight is missing and the model does not tie embeddings")
        yield from _pack("lm_head", [head], fmt, dtype, unquantized)
    arch = model.get("arch") or {}
    norms = {**NORMS, **(QK_NORMS if arch.get("qk_norm") else {}),
             **(FF_NORMS if arch.get("norm_placement") == "pre_post" else {})}
    fused = {ours: FUSED_IN_CHECKPOINT[ours] if arch.get(ours) == "fused" else parts for ours, parts in FUSED.items()}
    experts = arch.get("experts") or {}
    # an expert layer's MLP is its router and packed experts (builder/expert_weights.py), not gate_up/down
    attention_only = {ours: parts for ours, parts in fused.items() if ours in ("qkv", "o")}
    for i in range(model["num_layers"]):
        base = f"model.layers.{i}"
        sparse = i in experts.get("layers", ())
        for hf, ours in norms.items():
            yield f"layers.{i}.{ours}.weight", need(f"{base}.{hf}.weight").to(dtype)
        if sparse:
            yield from expert_tensors(ckpt, base, i, experts["num_experts"], dtype)
            if experts.get("shared_intermediate_size"):
                yield from shared_expert_tensors(ckpt, base, i, experts["shared_gate"], dtype)
        for ours, hf_parts in (attention_only if sparse else fused).items():
            parts = [_module(ckpt, f"{base}.{p}") for p in hf_parts]
            for p, part in zip(hf_parts, parts):
                if "weight" not in part:
                    raise StageError(f"{ckpt.path}: tensor {base}.{p}.weight is missing; the checkpoint is incomplete")
            yield from _pack(f"layers.{i}.{ours}", parts, fmt, dtype, unquantized)
        for ours, candidates in KV_SCALE_NAMES.items():
            found = next((c for c in candidates if f"{base}.{c}" in ckpt), None)
            if found is not None:
                scale = ckpt.get(f"{base}.{found}").to(torch.float32).reshape(())
                if not torch.isfinite(scale) or scale <= 0:
                    raise StageError(f"{ckpt.path}: {base}.{found} = {float(scale)} is not a positive finite "
                                     f"KV-cache scale; re-run the quantize stage (--force)")
                yield f"layers.{i}.attn.{ours}", scale
        advance(1)
