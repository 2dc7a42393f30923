"""Reference: write new K/V into the paged cache through a slot mapping."""
from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn value


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x (any float shape) -> float8_e4m3fn of x / scale, saturated to +-448 (torch rounds to nearest even)."""
    s = scale if isinstance(scale, float) else scale.float()
    return (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
    """Store token t's keys/values at flat slot slot_mapping[t]; slot -1 means padding (skipped).

    k, v: [T, Hkv, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D] (model dtype or float8_e4m3fn,
    then stored value = x / scale); slot_mapping: [T] int64 (block_id * block_size + offset).
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    for src, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        flat = cache.view(-1, cache.shape[2], cache.shape[3])
        rows = src[keep]
        if cache.dtype == torch.float8_e4m3fn:
            assert scale is not None, "fp8 cache needs a scale"
            flat[slots] = quantize_fp8(rows, scale)
        else:
            flat[slots] = rows.to(cache.dtype)
