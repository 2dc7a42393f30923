"""The one forward-pass seam: ``engine.runtime`` picks what runs a step, the executor sees one interface.

Every runtime implements ``StepRunner``: it owns the KV pool tensors that the executor's block manager
hands out by block id, and runs one step from the same ``(input_ids, AttentionMetadata,
logits_indices)`` the scheduler produced, returning fp32 logits for the requested rows (and the hidden
states of ``capture_hidden_layers``, for an EAGLE-3 draft). The scheduler, block manager, sampler and
serving glue never know which runtime ran the step.

- ``native``: Kiln's own model (backend/runtime/native.py; ``engine.tp_size`` > 1: the TP driver).
- ``onnx-reference``: the bundle's ``decoder.onnx`` run by onnx's ReferenceEvaluator on the CPU, the
  Kiln custom nodes backed by the kernels' PyTorch references (backend/runtime/onnx_runner.py): what a
  TensorRT plan would compute, checked without TensorRT.
- ``tensorrt``: the bundle's ``engine/tensorrt/engine.plan`` (backend/runtime/trt_runner.py; needs a
  host with TensorRT and a GPU).
Each graph runtime module is imported only when selected (onnx and tensorrt are not runtime
dependencies of the native path).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from backend.runtime.cpu_dtype import DtypeChoice

# engine.runtime -> "module:class"; the class is built as cls(spec, device=..., dtype=..., weights=...)
RUNTIMES: dict[str, str] = {
    "native": "backend.runtime.native:ModelRunner",
    "onnx-reference": "backend.runtime.onnx_runner:OnnxReferenceRunner",
    "tensorrt": "backend.runtime.trt_runner:TensorRTRunner",
}


class StepRunner(Protocol):
    """What the executor calls on a runner. Every runner subclasses it, so the members with a default
    (``dtype_choice``, ``graphs``, ``health``, ``shutdown``) are there to read: no caller probes."""
    device: "torch.device"
    dtype: "torch.dtype"
    block_size: int
    num_blocks: int
    kv_caches: list[tuple["torch.Tensor", "torch.Tensor"]]
    # what the runner computes in and why (generate --json, /metrics); None: it does not say
    dtype_choice: "DtypeChoice | None" = None
    # the decode CUDA graphs (``backend.ops.cuda_graphs.DecodeGraphs``) a speculator's chain draft
    # shares its capture with; None where the runner replays none
    graphs: Any = None
    # the most trailing tokens any layer attends to when EVERY layer slides (their windows' largest);
    # None when some layer attends to the whole context. KV blocks wholly before that many tokens are
    # never read again, so the block manager frees them (kv_cache.py, "Sliding windows")
    kv_window: int | None = None
    # (window, blocks) of the sliding layers' own KV pool when some layers slide and some do not
    # (Gemma 3): those layers' cache tensors hold that many blocks, the others ``num_blocks``, and the
    # executor gives each group its block manager (backend/engine/kv_groups.py); None: one pool
    window_kv: tuple[int, int] | None = None

    @property
    def kv_cache_bytes(self) -> int: ...

    def execute(self, input_ids: "torch.Tensor", meta, logits_indices: "torch.Tensor",
                capture_hidden_layers: tuple[int, ...] = ()) -> tuple["torch.Tensor", dict[int, "torch.Tensor"]]: ...

    def health(self) -> str | None:
        """None while the runner can serve, else why not (a tensor-parallel worker that exited)."""
        return None

    def shutdown(self) -> None:
        """Release what the runner started besides its tensors (tensor parallelism: the workers)."""
        return None


def every_layer_window(windows) -> int | None:
    """``StepRunner.kv_window`` from a model's per-layer windows (None: full attention)."""
    windows = list(windows)
    return max(windows) if windows and None not in windows else None


def runner_class(runtime: str):
    """The class that implements ``engine.runtime`` (its module imported now, not before)."""
    if runtime not in RUNTIMES:
        raise ValueError(f"engine.runtime: {runtime!r}; allowed: {', '.join(RUNTIMES)}")
    module, _, name = RUNTIMES[runtime].partition(":")
    return getattr(importlib.import_module(module), name)
