"""Peak-memory estimate of `quantize_checkpoint` for a checkpoint, before anything is loaded.

    quantize_memory(hf_dir, qcfg, path="auto", cuda=False) -> QuantMemory

Read from config.json and the safetensors headers only. Bytes per parameter of each path:
* whole, CPU: the fp32 model (4), the bf16 pages read while loading (2) and ModelOpt's exported
  state dict plus our bf16 rewrite of it (2); plus one calibration batch's activations and logits.
* whole, GPU: host holds the bf16 load (2); the GPU the bf16 model (2) and the activations.
* streamed: one decoder layer (its mapped bf16 pages, the fp32 copy, ModelOpt's and the export's
  copies: 10), the calibration activations twice (a layer's inputs and outputs), one batch's MLP
  activations; or, when larger, the embedding (mapped pages + the copy read out: 4), read to embed
  the calibration rows and again to write it.
* streamed, GPU: the GPU holds one layer in bf16 with ModelOpt's and the export's copies (4 x 2),
  the activations twice in bf16 and one batch's MLP activations; the host the layer's mapped pages
  and its export read back (2 + 2), or the embedding phase.
Constants checked against docs/perf/build-memory.json (peak RSS measured per stage).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# RSS with torch, transformers and ModelOpt imported, before any weights (docs/perf/build-memory.json)
BASE_BYTES = int(0.9 * (1 << 30))
# CUDA's libraries and context mapped into a process that uses the GPU: the H100's streamed quantize
# of the 8B shape peaked at 2.38 GiB of host RSS where the CPU base gave 1.71 (docs/perf/quant-gpu-h100.json)
CUDA_HOST_BYTES = int(0.7 * (1 << 30))


@dataclass(frozen=True)
class QuantMemory:
    path: str            # whole | streamed
    host_bytes: int
    gpu_bytes: int
    detail: str


def quantize_memory(hf_dir: str | Path, qcfg: Any, path: str = "auto", cuda: bool = False) -> QuantMemory:
    from quant.calibration import token_upper_bound  # noqa: PLC0415
    from quant.quantize import QuantSettings, choose_path  # noqa: PLC0415
    from quant.stream import LAYER_PREFIX, Shards  # noqa: PLC0415

    hf_dir = Path(hf_dir)
    settings = QuantSettings.from_config(qcfg)
    chosen = choose_path(settings.format, hf_dir, path)
    cfg = json.loads((hf_dir / "config.json").read_text())
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    shards = Shards(hf_dir)
    params = shards.numel()
    layer = shards.numel(f"{LAYER_PREFIX}0.")
    tokens = token_upper_bound(settings.dataset, settings.num_samples, settings.max_seq_len)
    batch = min(tokens, settings.max_batch_tokens)
    if chosen == "whole" and cuda:
        act = batch * (vocab + 4 * inter + 8 * hidden) * 2
        return QuantMemory(chosen, BASE_BYTES + CUDA_HOST_BYTES + 2 * params, 2 * params + act,
                           f"whole model: {params / 1e9:.2f} B parameters in bf16 on the GPU")
    if chosen == "whole":
        act = batch * (vocab + 4 * inter + 8 * hidden) * 4
        return QuantMemory(chosen, BASE_BYTES + 8 * params + act, 0,
                           f"whole model: {params / 1e9:.2f} B parameters in fp32 + export")
    embed_phase = 4 * vocab * hidden
    if cuda:
        gpu = 8 * layer + 2 * tokens * hidden * 2 + batch * (4 * inter + 8 * hidden) * 2
        return QuantMemory(chosen, BASE_BYTES + CUDA_HOST_BYTES + max(4 * layer, embed_phase), gpu,
                           f"streamed on the GPU: one layer of {layer / 1e6:.0f} M parameters in bf16, "
                           f"{tokens} calibration tokens")
    acts = 2 * tokens * hidden * 4
    layer_phase = 10 * layer + batch * (4 * inter + 8 * hidden) * 4
    # the embedding (the largest non-layer tensor): its mapped shard pages plus the copy read out
    return QuantMemory(chosen, BASE_BYTES + acts + max(layer_phase, embed_phase), 0,
                       f"streamed: one layer of {layer / 1e6:.0f} M parameters in fp32, "
                       f"{tokens} calibration tokens")
