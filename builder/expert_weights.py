"""An expert layer's HF tensors -> the runtime's packed ones (docs/contracts.md section 3):

``layers.{i}.router.weight [E, H]``, ``layers.{i}.experts.gate_up.weight [E, 2I, H]`` (each expert's gate rows,
then its up rows, as the dense ``gate_up``) and ``layers.{i}.experts.down.weight [E, H, I]``: one tensor per
projection, so a grouped kernel reads expert ``e`` at a fixed stride. A shared expert (Qwen2-MoE) is one
dense gated MLP, ``layers.{i}.shared_expert.gate_up.weight [2Is, H]`` and ``.down.weight [H, Is]``, with
its gate ``layers.{i}.shared_expert_gate.weight [1, H]``.

Checkpoints store experts in one of the layouts below (found by the names present, not by family: a Mixtral
and a Qwen3-MoE differ only in names). Plain weights only: the build refuses quantized formats for expert
models (builder/config_model.py), and a quantized expert tensor here is refused, never packed as plain.
"""
from __future__ import annotations

from typing import Iterator

import torch

from builder.stages.base import StageError

# per-expert modules, ``{e}`` the expert: (router, gate, up, down). Mixtral's published names (and what
# transformers 5 writes for it) are w1 = gate, w3 = up, w2 = down; Qwen's MoE names its experts as MLPs
PER_EXPERT = (
    ("block_sparse_moe.gate", "block_sparse_moe.experts.{e}.w1", "block_sparse_moe.experts.{e}.w3",
     "block_sparse_moe.experts.{e}.w2"),
    ("mlp.gate", "mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj"),
)
# transformers 5's own module layout, already packed: gate_up_proj [E, 2I, H] (gate rows first), down_proj
# [E, H, I]; with or without a ``.weight`` suffix, under mlp. (Mixtral's module is mlp there too)
PACKED = (("mlp.gate", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"),)


def expert_tensors(ckpt, base: str, i: int, num_experts: int, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Layer ``i``'s router and packed experts from the checkpoint's tensors under ``base`` (model.layers.{i})."""
    def has(name: str) -> bool:
        return f"{base}.{name}" in ckpt

    def get(name: str) -> torch.Tensor:
        return ckpt.get(f"{base}.{name}").to(dtype)

    for router, gate_up, down in PACKED:
        for suffix in ("", ".weight"):
            if has(gate_up + suffix) and has(down + suffix) and has(router + ".weight"):
                yield f"layers.{i}.router.weight", get(router + ".weight")
                yield f"layers.{i}.experts.gate_up.weight", get(gate_up + suffix)
                yield f"layers.{i}.experts.down.weight", get(down + suffix)
                return
    for router, gate, up, down in PER_EXPERT:
        if not has(gate.format(e=0) + ".weight"):
            continue
        for e in range(num_experts):
            for name in (gate, up, down):
                if not has(name.format(e=e) + ".weight"):
                    raise StageError(f"{ckpt.path}: tensor {base}.{name.format(e=e)}.weight is missing; the "
                                     f"checkpoint is incomplete (model.arch.experts.num_experts = {num_experts})")
                if has(name.format(e=e) + ".weight_scale"):
                    raise StageError(f"{ckpt.path}: {base}.{name.format(e=e)} is quantized; allowed: an "
                                     f"unquantized checkpoint (quantization.format=none) for an expert model")
        if not has(router + ".weight"):
            raise StageError(f"{ckpt.path}: tensor {base}.{router}.weight (the router) is missing")
        yield f"layers.{i}.router.weight", get(router + ".weight")
        yield f"layers.{i}.experts.gate_up.weight", torch.stack(
            [torch.cat([get(gate.format(e=e) + ".weight"), get(up.format(e=e) + ".weight")]) for e in range(num_experts)])
        yield f"layers.{i}.experts.down.weight", torch.stack(
            [get(down.format(e=e) + ".weight") for e in range(num_experts)])
        return
    known = [p[1].format(e=0) for p in PER_EXPERT] + [p[1] for p in PACKED]
    raise StageError(f"{ckpt.path}: layer {i} is an expert layer (model.arch.experts.layers) but has none of the "
                     f"expert tensors Kiln reads; allowed: {base}.<" + " | ".join(known) + ">")


# Qwen2-MoE's shared expert: (gate, up, down) and the gate of its output
SHARED = (("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj"),
          "mlp.shared_expert_gate")


def shared_expert_tensors(ckpt, base: str, i: int, gated: bool, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Layer ``i``'s shared expert (gate rows, then up rows) and, when ``gated``, its output gate."""
    (gate, up, down), gate_of_output = SHARED
    names = [gate, up, down] + ([gate_of_output] if gated else [])
    for name in names:
        if f"{base}.{name}.weight" not in ckpt:
            raise StageError(f"{ckpt.path}: tensor {base}.{name}.weight is missing; the checkpoint is incomplete "
                             f"(model.arch.experts.shared_intermediate_size is set)")
        if f"{base}.{name}.weight_scale" in ckpt:
            raise StageError(f"{ckpt.path}: {base}.{name} is quantized; allowed: an unquantized checkpoint "
                             f"(quantization.format=none) for an expert model")

    def get(name: str) -> torch.Tensor:
        return ckpt.get(f"{base}.{name}.weight").to(dtype)

    yield f"layers.{i}.shared_expert.gate_up.weight", torch.cat([get(gate), get(up)])
    yield f"layers.{i}.shared_expert.down.weight", get(down)
    if gated:
        yield f"layers.{i}.shared_expert_gate.weight", get(gate_of_output)
