"""Model runner: the weights, the KV cache tensors and one forward pass per step.

The runner is the only part of the executor that touches tensors of the model's size. It knows
nothing about requests: the executor gives it ``input_ids``, the step's ``AttentionMetadata`` and
which token rows need logits, and gets logits (and captured hidden states) back.
"""
from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from backend.ops.attention import get_backend, resolve_backend_name
from backend.bundle import Bundle, BundleError, EngineSettings, Manifest, as_dict, load_bundle
from backend.engine.kv_capacity import kv_bytes_per_token, kv_capacity_blocks
from backend.logs import get_logger
from backend.model import cpu_dtype, layer_probe
from backend.model.config import ModelConfig
from backend.model.llama import LlamaModel

_LOG = get_logger("model.runner")

# engine.kv_cache_dtype values -> torch dtype ("auto"/None = the model dtype).
KV_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "float8_e4m3fn": torch.float8_e4m3fn,
             "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Model architectures this runtime builds, by engine.json model.architecture.
MODEL_CLASSES = {"llama": LlamaModel, "mistral": LlamaModel, "qwen2": LlamaModel, "qwen3": LlamaModel,
                 "phi3": LlamaModel}
# On CPU the KV pool comes from RAM shared with everything else; a tenth is plenty for serving.
CPU_RAM_FRACTION = 0.1


class EngineError(ValueError):
    """The engine bundle or an engine override is unusable: one line saying what to fix."""


@dataclass
class EngineSpec:
    """What the runtime reads from a bundle: its checked manifest (engine overrides applied) and path."""
    path: Path
    manifest: Manifest

    @property
    def model(self) -> ModelConfig:
        return self.manifest.model

    @property
    def engine(self) -> EngineSettings:
        return self.manifest.engine

    @property
    def quant_format(self) -> str:
        return self.manifest.quantization.format

    @property
    def kv_cache_dtype(self) -> str:
        return self.engine.kv_cache_dtype


def load_engine_spec(path: str | os.PathLike | Bundle, overrides: dict[str, Any] | None = None,
                     verify_hashes: bool = False) -> EngineSpec:
    """Read ``<path>/engine.json`` through ``backend.bundle`` (format version, fields, files present,
    optionally their sha256) and apply ``engine.*`` overrides by key. A ``Bundle`` already read is
    used as it is (its caller checked it)."""
    try:
        bundle = path if isinstance(path, Bundle) else load_bundle(path, verify_hashes=verify_hashes)
        manifest = bundle.manifest
        if overrides:
            manifest = manifest.replace(engine=manifest.engine.override(**overrides))
    except BundleError as exc:
        raise EngineError(str(exc)) from exc
    return EngineSpec(path=bundle.path, manifest=manifest)


def load_weights(path: Path, device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of the bundle, whole: its weights.safetensors, or a tensor-parallel bundle's rank
    files put back together (``tp_shard.load_unsharded``) for a run on one device (the verify stage,
    an ``engine.tp_size=1`` override); each rank of a tensor-parallel run reads only its own file."""
    from safetensors.torch import load_file
    dev = str(device) if device.type != "cuda" else f"cuda:{device.index or 0}"
    f = path / "weights.safetensors"
    if not f.is_file() and (path / "rank0.safetensors").is_file():
        from backend.bundle import BundleError, read
        from backend.model.tp_shard import load_unsharded
        try:
            manifest = read(path)
            return load_unsharded([path / w for w in manifest.weights], manifest.model, device=dev)
        except (BundleError, KeyError) as exc:
            raise EngineError(str(exc)) from exc
    if not f.is_file():
        raise EngineError(f"{f}: not found; rebuild with: make build CONFIG=...")
    return load_file(str(f), device=dev)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled KV pool tensor. On CPU an anonymous memory mapping: the kernel's zero pages, given
    real memory only as the cache fills. ``torch.zeros`` writes the whole pool at load (SmolLM2's default
    32k-token float32 pool is 1.5 GB: 1.2 s of every engine start on one thread) and keeps it resident
    whether sequences ever use it or not. Zeros, not garbage: attention in tiles weighs masked keys 0,
    and 0 times a stale NaN would still be NaN."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)


def kv_pool_bytes(kv_caches) -> int:
    """Bytes of a runner's KV pool (every layer's K and V tensors): what every runtime reports."""
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv_caches)


FP8_KV_NEEDS_SCALES = ("engine.json: kv_cache_dtype fp8 needs layers.{i}.attn.k_scale/v_scale in "
                       "weights.safetensors; rebuild with quantization.kv_cache=fp8")


def kv_cache_dtypes(spec: EngineSpec, dtype: torch.dtype, device: torch.device,
                    attention) -> tuple[torch.dtype, torch.dtype]:
    """(what the KV cache holds, what its tensors store) for a model computing in ``dtype``; sets
    ``attention.fp8_as_float`` when the two differ. One function for every runner of a bundle
    (``ModelRunner``, ``backend.model.layerwise``), so they cache the same numbers."""
    kv_name = spec.kv_cache_dtype
    if kv_name not in KV_DTYPES:
        raise EngineError(f"engine.kv_cache_dtype: {kv_name!r}; allowed: {', '.join(KV_DTYPES)}")
    kv_dtype = KV_DTYPES[kv_name] if kv_name != spec.model.dtype else dtype
    # What the cache tensors hold: kv_dtype, except an fp8 cache on CPU with the torch backend,
    # which stores the fp8 values already scaled, in the compute dtype (same numbers: see
    # TorchAttentionBackend.fp8_as_float). PyTorch has no fast fp8 conversion on CPU, and a step
    # converted every sequence's whole context in every layer (0.7 s of a 1.4 s step at 64
    # sequences, SmolLM2); RAM, not bandwidth, is what a CPU has plenty of.
    if kv_dtype == torch.float8_e4m3fn and device.type == "cpu" and attention.name == "torch":
        attention.fp8_as_float = True
        return kv_dtype, dtype
    return kv_dtype, kv_dtype


def plan_kv_blocks(spec: EngineSpec, storage_dtype: torch.dtype, kv_heads: int, free_device_bytes: int | None,
                   cpu_ram_fraction: float = CPU_RAM_FRACTION) -> int:
    """KV blocks for ``kv_heads`` heads per layer (a tensor-parallel rank holds its share) within the
    engine's limits: the device's free memory on a GPU, ``cpu_ram_fraction`` of RAM on a CPU."""
    cfg, eng = spec.model, spec.engine
    per_tok = kv_bytes_per_token(cfg.num_layers, kv_heads, cfg.head_dim, torch.empty((), dtype=storage_dtype).element_size())
    try:
        return kv_capacity_blocks(
            eng.kv_block_size, per_tok, max_kv_tokens=eng.max_kv_tokens, free_device_bytes=free_device_bytes,
            free_mem_fraction=float(eng.kv_cache_free_mem_fraction), cpu_ram_fraction=cpu_ram_fraction,
            max_useful_tokens=eng.max_batch_size * eng.max_seq_len, min_tokens=min(eng.max_seq_len, eng.kv_block_size))
    except ValueError as exc:
        raise EngineError(str(exc)) from exc


class ModelRunner:
    """Owns the model, the KV cache tensors and ``execute`` for one step."""

    def __init__(self, spec: EngineSpec, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None, weights: dict[str, torch.Tensor] | None = None) -> None:
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
        window = cfg.sliding_window
        max_seq = spec.engine.max_seq_len
        if window and max_seq > window:
            # Below the window, sliding-window attention IS full attention; above it we would be wrong.
            raise EngineError(f"engine.max_seq_len: {max_seq} exceeds the model's sliding_window ({window}), "
                              f"which this runtime does not implement; allowed: at most {window}")
        cls = MODEL_CLASSES[cfg.architecture]
        weights = weights if weights is not None else load_weights(spec.path, self.device)
        # what the model computes in, why, and the timings behind it (generate --json, /metrics)
        self.dtype_choice = self._choose_dtype(dtype, weights, backend_name)
        self.dtype = self.dtype_choice.dtype
        self.model = cls(cfg, weights, spec.quant_format, self.attention, self.device, self.dtype)
        del weights

        self.kv_dtype, self.kv_storage_dtype = kv_cache_dtypes(spec, self.dtype, self.device, self.attention)
        if self.kv_dtype == torch.float8_e4m3fn and any(k is None for k, _ in self.model.kv_cache_scales):
            raise EngineError(FP8_KV_NEEDS_SCALES)
        self.block_size = spec.engine.kv_block_size
        self.num_blocks = self._plan_kv_blocks()
        shape = (self.num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [(zeroed(shape, self.kv_storage_dtype, self.device),
                           zeroed(shape, self.kv_storage_dtype, self.device))
                          for _ in range(cfg.num_layers)]
        self.graphs = decode_graphs(spec, self.model, self.kv_caches, backend_name, self.device)

    def _choose_dtype(self, dtype: torch.dtype | None, weights: dict[str, torch.Tensor],
                      backend_name: str) -> cpu_dtype.DtypeChoice:
        """The caller's ``dtype`` when given (tests pin float32 for parity), else engine.cpu_dtype:
        on a CPU, ``auto`` times one layer of this model in each candidate (backend/model/cpu_dtype.py)."""
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
    if device.type == "cuda" and spec.manifest.kernels and hasattr(attention, "load_aot"):
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
