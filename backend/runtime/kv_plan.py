"""KV cache planning shared by every runner of a bundle: which dtype the cache holds and stores, how
many blocks fit, and the pool tensors themselves."""
from __future__ import annotations

import math
import mmap

import torch

from backend.runtime.kv_capacity import kv_bytes_per_token, kv_capacity_blocks
from backend.runtime.spec import EngineError, EngineSpec

# engine.kv_cache_dtype values -> torch dtype ("auto"/None = the model dtype).
KV_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "float8_e4m3fn": torch.float8_e4m3fn,
             "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# On CPU the KV pool comes from RAM shared with everything else; a tenth is plenty for serving.
CPU_RAM_FRACTION = 0.1


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
    (``ModelRunner``, ``backend.runtime.layerwise``), so they cache the same numbers."""
    kv_name = spec.kv_cache_dtype
    if kv_name not in KV_DTYPES:
        raise EngineError(f"engine.kv_cache_dtype: {kv_name!r}; allowed: {', '.join(KV_DTYPES)}")
    kv_dtype = KV_DTYPES[kv_name] if kv_name != spec.model.dtype else dtype
    # What the cache tensors hold: kv_dtype, except an fp8 cache on CPU with the torch backend,
    # which stores the fp8 values already scaled, in the compute dtype (same numbers: see
    # TorchAttentionBackend.fp8_as_float). PyTorch has no fast fp8 conversion on CPU, and a step
    # converted every sequence's whole context in every layer (0.7 s of a 1.4 s step at 64
    # sequences, SmolLM2); RAM, not bandwidth, is what a CPU has plenty of.
    if kv_dtype == torch.float8_e4m3fn and device.type == "cpu" and attention.holds_fp8_as_float:
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


def window_layers(windows) -> tuple[int, list[int]] | None:
    """(the window, the sliding layers) of a model whose layers mix sliding-window and full attention,
    or None: every layer full, or every layer sliding (then one pool's blocks are released behind the
    window already, backend/engine/kv_cache.py). Layers with smaller windows than the largest read a
    part of what it keeps."""
    sliding = [i for i, w in enumerate(windows) if w is not None]
    if not sliding or len(sliding) == len(windows):
        return None
    return max(windows[i] for i in sliding), sliding


def window_pool_blocks(spec: EngineSpec, window: int) -> int:
    """Blocks of the sliding layers' own pool (backend/engine/kv_groups.py): enough for every running
    sequence's window and one step's tokens at once. A sequence that computes ``c`` tokens in a step
    holds at most ceil((c + window - 1) / block) + 1 blocks of it, one more while the scheduler's
    decode fast path has not asked for a release, and a step computes at most max_num_tokens."""
    eng = spec.engine
    bs, seqs = eng.kv_block_size, eng.max_batch_size
    return -(-(eng.max_num_tokens + seqs * (window - 1)) // bs) + 3 * seqs


def full_pool_blocks(one_pool_blocks: int, window_blocks: int, full_layers: int, sliding_layers: int,
                     fixed_tokens: bool, max_useful_blocks: int | None) -> int:
    """Blocks of the full layers' pool once the sliding layers have ``window_blocks`` of their own: the
    memory one pool of ``one_pool_blocks`` would take, less the sliding pool's, for the full layers
    (at most ``max_useful_blocks``, never fewer than one pool had); or, where ``engine.max_kv_tokens``
    fixed the tokens, those."""
    if fixed_tokens:
        return one_pool_blocks
    spare = (one_pool_blocks * (full_layers + sliding_layers) - window_blocks * sliding_layers) // full_layers
    return spare if max_useful_blocks is None else max(min(spare, max_useful_blocks), one_pool_blocks)
