"""Per-request perf figures as Triton tensors (tensorrtllm_backend's ``return_perf_metrics`` names).

With ``return_perf_metrics`` set, the engine model adds to EVERY response of the request, beside the
speculative-decoding figures of ``acceptance.py``:

* ``kv_cache_alloc_new_blocks`` (INT32 [1]): KV blocks taken from the pool for the request,
* ``kv_cache_reused_blocks`` (INT32 [1]): prefix-cache blocks it reused instead of computing them,
* ``kv_cache_alloc_total_blocks`` (INT32 [1]): the sum of both,
  counted over the request's life (a request preempted and re-admitted counts its blocks again,
  as TensorRT-LLM does; blocks reserved for rejected draft tokens count too);
* ``arrival_time_ns``, ``first_scheduled_time_ns``, ``first_token_time_ns``, ``last_token_time_ns``
  (INT64 [1]): the executor's monotonic clock in nanoseconds (like TensorRT-LLM's steady clock:
  compare them with each other, not with the wall clock), 0 for an event that has not happened yet
  (e.g. a request cancelled while it waited).

Cumulative, so the final response holds the request's figures. Pure numpy: no Triton, no torch.
Read the request only on the executor's thread (the event callback), which owns it.
"""
from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["PERF_OUTPUTS", "perf_tensors"]

PERF_OUTPUTS = ("kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks",
                "arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")


def _ns(t: float | None) -> int:
    return int(round(t * 1e9)) if t is not None else 0


def perf_tensors(request: Any | None) -> dict[str, np.ndarray]:
    """The seven tensors for an executor ``Request`` (all zeros for None: no engine request exists,
    e.g. a request refused before it was queued)."""
    new = int(getattr(request, "num_new_blocks", 0) or 0)
    reused = int(getattr(request, "num_reused_blocks", 0) or 0)
    times = [getattr(request, a, None) for a in ("arrival_time", "first_scheduled_time", "first_token_time",
                                                 "last_token_time")]
    out = {"kv_cache_alloc_new_blocks": np.array([new], np.int32),
           "kv_cache_reused_blocks": np.array([reused], np.int32),
           "kv_cache_alloc_total_blocks": np.array([new + reused], np.int32)}
    for name, t in zip(PERF_OUTPUTS[3:], times):
        out[name] = np.array([_ns(t)], np.int64)
    return out
