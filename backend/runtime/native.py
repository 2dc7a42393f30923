"""The native runner: Kiln's own model with its weights, the KV cache tensors and one forward pass
per step.

The runner is the only part of the executor that touches tensors of the model's size. It knows
nothing about requests: the executor gives it ``input_ids``, the step's ``AttentionMetadata`` and
which token rows need logits, and gets logits (and captured hidden states) back.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from backend.ops.attention import get_backend, resolve_backend_name
from backend.bundle import as_dict
from backend.logs import get_logger
from backend.model import spec_layer
from backend.model.llama import LlamaModel
from backend.runtime import cpu_dtype, layer_probe
from backend.runtime.kv_plan import (FP8_KV_NEEDS_SCALES, KV_DTYPES, full_pool_blocks, kv_cache_dtypes,
                                     kv_pool_bytes, plan_kv_blocks, window_layers, window_pool_blocks, zeroed)
from backend.runtime.spec import EngineError, EngineSpec
from backend.runtime.runtimes import StepRunner, every_layer_window

_LOG = get_logger("model.runner")

# Model architectures this runtime builds, by engine.json model.architecture.
MODEL_CLASSES = {"llama": LlamaModel, "mistral": LlamaModel, "qwen2": LlamaModel, "qwen3": LlamaModel,
                 "phi3": LlamaModel, "gemma3": LlamaModel, "mixtral": LlamaModel,
                 "qwen3_moe": LlamaModel, "qwen2_moe": LlamaModel}


def load_weights(path: Path, device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of the bundle, whole: its weights.safetensors, or a tensor-parallel bundle's rank
    files put back together (``tp_shard.load_unsharded``) for a run on one device (the verify stage,
    an ``engine.tp_size=1`` override); each rank of a tensor-parallel run reads only its own file."""
    from safetensors.torch import load_file
    dev = str(device) if device.type != "cuda" else f"cuda:{device.index or 0}"
    f = path / "weights.safetensors"
    if not f.is_file() and (path / "rank0.safetensors").is_file():
        from backend.bundle import BundleError, read
        from backend.runtime.tp_shard import load_unsharded
        try:
            manifest = read(path)
            return load_unsharded([path / w for w in manifest.weights], manifest.model, device=dev)
        except (BundleError, KeyError) as exc:
            raise EngineError(str(exc)) from exc
    if not f.is_file():
        raise EngineError(f"{f}: not found; rebuild with: make build CONFIG=...")
    return load_file(str(f), device=dev)


class ModelRunner(StepRunner):
    """Owns the model, the KV cache tensors and ``execute`` for one step."""

    def __init__(self, spec: EngineSpec, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None, weights: dict[str, torch.Tensor] | None = None,
                 window_pool: bool = True) -> None:
        """``window_pool=False``: one KV pool for every layer even where the sliding layers could have
        their own (a one-shot teacher-forced pass, as the verify stage's, prefills whole prompts)."""
        self.spec = spec
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise EngineError("device 'cuda' requested but no CUDA GPU is visible; allowed here: cpu")
        cfg = spec.model
        try:
            cpu_dtype.check(spec.engine.cpu_dtype)   # refused on every device, before any weight is read
        except cpu_dtype.CpuDtypeError as exc:
            raise EngineError(str(exc)) from exc
        backend_name, self.attention = attention_backend(spec, self.device)
        max_seq = spec.engine.max_seq_len
        # Below a window, sliding-window attention IS full attention; above it a backend without
        # windows would be wrong: refused before any weight is read.
        windows = [w for w in spec_layer.plan_of(cfg.arch_spec, cfg).windows
                   if w is not None and w < max_seq]
        if windows and not self.attention.sliding_window:
            raise EngineError(f"engine.max_seq_len: {max_seq} exceeds the model's sliding_window ({min(windows)}), "
                              f"which the {backend_name} attention backend does not implement yet; allowed: at most "
                              f"{min(windows)}, or engine.attention_backend=torch")
        cls = MODEL_CLASSES[cfg.architecture]
        weights = weights if weights is not None else load_weights(spec.path, self.device)
        # what the model computes in, why, and the timings behind it (generate --json, /metrics)
        self.dtype_choice = self._choose_dtype(dtype, weights, backend_name)
        self.dtype = self.dtype_choice.dtype
        self.model = cls(cfg, weights, spec.quant_format, self.attention, self.device, self.dtype)
        del weights
        self.model.bound_windows(max_seq)   # windows no sequence reaches past run as full attention
        self.kv_window = every_layer_window(self.model.windows)

        self.kv_dtype, self.kv_storage_dtype = kv_cache_dtypes(spec, self.dtype, self.device, self.attention)
        if self.kv_dtype == torch.float8_e4m3fn and any(k is None for k, _ in self.model.kv_cache_scales):
            raise EngineError(FP8_KV_NEEDS_SCALES)
        self.block_size = spec.engine.kv_block_size
        self.num_blocks = self._plan_kv_blocks()
        sliding = self._plan_window_pool() if window_pool else set()
        self.kv_caches = []
        for i in range(cfg.num_layers):
            blocks = self.window_kv[1] if i in sliding else self.num_blocks
            shape = (blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
            self.kv_caches.append((zeroed(shape, self.kv_storage_dtype, self.device),
                                   zeroed(shape, self.kv_storage_dtype, self.device)))
        self.graphs = decode_graphs(spec, self.model, self.kv_caches, backend_name, self.device)

    def _choose_dtype(self, dtype: torch.dtype | None, weights: dict[str, torch.Tensor],
                      backend_name: str) -> cpu_dtype.DtypeChoice:
        """The caller's ``dtype`` when given (tests pin float32 for parity), else engine.cpu_dtype:
        on a CPU, ``auto`` times one layer of this model in each candidate (backend/runtime/cpu_dtype.py)."""
        if dtype is not None:
            return cpu_dtype.DtypeChoice(dtype, "dtype=", "the caller's dtype argument")
        kv_fp8 = KV_DTYPES.get(self.spec.kv_cache_dtype) == torch.float8_e4m3fn

        def probe(dtypes):
            return layer_probe.time_layers(self.spec, weights, dtypes, kv_fp8=kv_fp8)
        # the probe runs the torch attention backend's ops: it says nothing of another backend's
        choice = cpu_dtype.choose(self.spec.engine.cpu_dtype, self.spec.model.torch_dtype, self.device,
                                  probe if backend_name == "torch" else None)
        _LOG.info("compute dtype %s (engine.cpu_dtype %s): %s%s", choice.dtype, choice.asked, choice.reason,
                  f"; decode-step estimates, ms: {choice.timings_ms}" if choice.timings_ms else "")
        return choice

    def _plan_kv_blocks(self) -> int:
        free_dev = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else None
        return plan_kv_blocks(self.spec, self.kv_storage_dtype, self.spec.model.num_kv_heads, free_dev)

    def _plan_window_pool(self) -> set[int]:
        """Give the sliding layers a pool of their own where some layers slide and some do not (sets
        ``window_kv`` and the full layers' ``num_blocks``); the layers that use it. Only where it is the
        smaller pool, and with an attention backend that reads a block table per layer group."""
        group = window_layers(self.model.windows)
        if group is None or not self.attention.window_tables:
            return set()
        window, sliding = group
        blocks = window_pool_blocks(self.spec, window)
        if blocks >= self.num_blocks:
            return set()
        eng = self.spec.engine
        full = self.spec.model.num_layers - len(sliding)
        # a CPU's pool stops at what the running batch can fill (kv_plan.plan_kv_blocks); a GPU's keeps
        # every block it can hold for the prefix cache
        useful = -(-eng.max_batch_size * eng.max_seq_len // self.block_size) if self.device.type == "cpu" else None
        self.num_blocks = full_pool_blocks(self.num_blocks, blocks, full, len(sliding),
                                           eng.max_kv_tokens is not None, useful)
        self.window_kv = (window, blocks)
        _LOG.info("KV: %d sliding layers (window %d) in a pool of %d blocks, %d full layers in %d blocks",
                  len(sliding), window, blocks, full, self.num_blocks)
        return set(sliding)

    @property
    def kv_cache_bytes(self) -> int:
        return kv_pool_bytes(self.kv_caches)

    @torch.inference_mode()
    def execute(self, input_ids: torch.Tensor, meta, logits_indices: torch.Tensor,
                capture_hidden_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run one step. ``logits_indices [N]`` picks the token rows whose next-token logits are
        needed (the last token of each sequence that samples this step); returns fp32 ``[N, V]``."""
        hidden, captured = step_hidden(self.graphs, self.model, self.kv_caches, input_ids, meta,
                                       capture_hidden_layers)
        logits = self.model.compute_logits(hidden.index_select(0, logits_indices))
        return logits, captured


def attention_backend(spec: EngineSpec, device: torch.device) -> tuple[str, Any]:
    """engine.attention_backend resolved for ``device`` (auto: triton on a GPU, torch on a CPU) and
    its backend, with the bundle's AOT kernels loaded on a GPU. Every runner of a bundle (``ModelRunner``,
    each tensor-parallel rank's ``TPRunner``) picks it here, so they run the same kernels."""
    name = resolve_backend_name(spec.engine.attention_backend, str(device))
    attention = get_backend(name, str(device))
    if device.type == "cuda" and spec.manifest.kernels:
        # The build compiled these cubins for the bundle's target SMs: launching them skips JIT at
        # start. Any problem with them must cost speed, never the engine, so fall back to JIT.
        try:
            attention.load_aot(spec.path, as_dict(spec.manifest.kernels), device)
        except Exception as exc:  # noqa: BLE001
            _LOG.warning("AOT kernels of %s not usable here (%s); using Triton JIT", spec.path, exc)
    return name, attention


def decode_graphs(spec: EngineSpec, model, kv_caches, backend_name: str, device: torch.device, agree=None):
    """engine.cuda_graphs: "auto" (default) = on for a CUDA device with the triton attention backend;
    true on CPU runs the same padded static-buffer path eagerly (tests); false = never. ``agree``: see
    ``DecodeGraphs`` (a tensor-parallel rank's capture outcome, agreed over its group)."""
    want = spec.engine.cuda_graphs
    if want not in ("auto", True, False):
        raise EngineError(f"engine.cuda_graphs: {want!r}; allowed: auto, true, false")
    if want is False or (want == "auto" and device.type != "cuda"):
        return None
    if backend_name != "triton":
        if want is True:
            raise EngineError(f"engine.cuda_graphs: true needs engine.attention_backend triton "
                              f"(got {backend_name}); allowed: auto, false")
        return None
    from backend.ops.cuda_graphs import DecodeGraphs
    block_size = spec.engine.kv_block_size
    max_seq = spec.engine.max_seq_len
    max_blocks = -(-(max_seq + 64) // block_size)   # the executor's block-table width
    return DecodeGraphs(model, kv_caches, spec.engine.max_batch_size, max_blocks, max_seq, device,
                        capture=device.type == "cuda", agree=agree)


def step_hidden(graphs, model, kv_caches, input_ids: torch.Tensor, meta,
                capture_hidden_layers: tuple[int, ...]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """One step's final hidden rows and captured layers: through ``graphs`` when they take the step,
    else the model's eager forward (the runner computes logits from them)."""
    if graphs is not None and graphs.usable(input_ids, meta, capture_hidden_layers):
        # the graph's output buffers are overwritten by the next replay: the runner's logits are
        # computed from them before that (the captured layers are views: the speculator copies the
        # rows it needs first)
        return graphs.run(input_ids, meta, capture_hidden_layers)
    return model.forward(input_ids, meta, kv_caches, capture_hidden_layers)


def prefill_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """All-position next-token logits of one prompt (one prefill step into blocks 0.. of an otherwise
    unused runner): the teacher-forced comparisons of the verify stage and the GPU checks."""
    t, bs = len(ids), runner.block_size
    nblk = -(-t // bs)
    if nblk > runner.num_blocks:
        raise EngineError(f"prefill_logits: {t} tokens need {nblk} KV blocks; the pool has {runner.num_blocks}")
    dev = runner.device
    meta = prefill_meta(t, bs, dev)
    if runner.window_kv is not None:   # the sliding layers' own pool: blocks 0.. of it too, same tables
        if nblk > runner.window_kv[1]:
            raise EngineError(f"prefill_logits: {t} tokens need {nblk} KV blocks; the sliding layers' pool has "
                              f"{runner.window_kv[1]} (raise engine.max_num_tokens, which sizes it)")
        meta.window = meta
    logits, _ = runner.execute(torch.tensor(ids, device=dev), meta, torch.arange(t, device=dev))
    return logits.float().cpu()


def prefill_meta(t: int, block_size: int, device: torch.device):
    """The ``AttentionMetadata`` of one sequence's whole prefill of ``t`` tokens into blocks 0.. ."""
    from backend.ops.attention.metadata import AttentionMetadata
    i32 = torch.int32
    nblk = -(-t // block_size)
    return AttentionMetadata(
        positions=torch.arange(t, device=device), slot_mapping=torch.arange(t, device=device),
        block_tables=torch.arange(nblk, dtype=i32, device=device).view(1, -1),
        seq_lens=torch.tensor([t], dtype=i32, device=device),
        query_start_loc=torch.tensor([0, t], dtype=i32, device=device),
        context_lens=torch.zeros(1, dtype=i32, device=device), num_prefills=1, num_prefill_tokens=t,
        num_decode_tokens=0, max_query_len=t, max_seq_len=t)
