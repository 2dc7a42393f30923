"""tensorrtllm_backend's custom metric families (``nv_trt_llm_*``), fed from ``Executor.stats()``.

NVIDIA's in-flight batching backend reports five gauge families, each labelled with the model
name, its version and one category label; dashboards written for it select on exactly those.
Kiln exports the ones it can fill with real values, beside its own ``kiln_*`` families, from the
same refresh (``ServingMetrics.update``, under ``metrics._LOCK``):

* ``nv_trt_llm_request_metrics{request_type}``: ``active`` requests admitted to the batch (running,
  prefilling or generating), ``max`` the most the batch may hold (``engine.max_batch_size``),
  ``scheduled`` / ``context`` requests the last iteration ran / ran a prompt (chunk) for,
  ``waiting`` requests queued for admission.
* ``nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type}``: ``max`` / ``free`` / ``used`` blocks,
  ``tokens_per`` block, ``fraction`` = used / max; ``alloc_new`` / ``reused`` / ``alloc_total``
  blocks taken from the pool / reused from the prefix cache / both, since the model loaded.
* ``nv_trt_llm_inflight_batcher_metrics{inflight_batcher_specific_metric}``:
  ``total_context_tokens`` prompt tokens computed and ``generation_requests`` decoding requests in the
  last iteration, ``paused_requests`` requests it preempted, ``micro_batch_id`` always 0 (Kiln runs
  one micro batch: no pipeline parallelism).
* ``nv_trt_llm_general_metrics{general_type}``: ``iteration_counter`` iterations run since the model
  loaded, ``timestamp`` the last iteration's wall-clock time in microseconds since the epoch (the
  unit of NVIDIA's latest reporter; 0 before the first iteration).

The per-iteration figures read 0 once no request is left (the loop stops iterating then).
Not exported, because Kiln has no real value for them (see docs/contracts.md):
``nv_trt_llm_runtime_memory_metrics`` (TensorRT-LLM runtime's own cpu/gpu/pinned allocations),
``nv_trt_llm_disaggregated_serving_metrics`` (no disaggregated serving) and the V1 batcher's
``nv_trt_llm_v1_metrics`` (Kiln only batches in flight).

``nv_values`` is the pure mapping (tested without a server); ``NvMetrics`` publishes it.
"""
from __future__ import annotations

from typing import Any, Mapping

__all__ = ["NV_FAMILIES", "NV_NOT_EXPORTED", "NvMetrics", "nv_values"]

# family -> (description, category label key, category label values in publishing order)
NV_FAMILIES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "nv_trt_llm_request_metrics": ("TRT LLM request metrics", "request_type",
                                   ("active", "max", "scheduled", "context", "waiting")),
    "nv_trt_llm_kv_cache_block_metrics": ("TRT LLM KV cache block metrics", "kv_cache_block_type",
                                          ("max", "free", "used", "tokens_per", "fraction", "alloc_total",
                                           "alloc_new", "reused")),
    "nv_trt_llm_inflight_batcher_metrics": ("TRT LLM inflight_batcher-specific metrics",
                                            "inflight_batcher_specific_metric",
                                            ("total_context_tokens", "generation_requests", "micro_batch_id",
                                             "paused_requests")),
    "nv_trt_llm_general_metrics": ("General TRT LLM metrics", "general_type",
                                   ("iteration_counter", "timestamp")),
}

# NVIDIA families Kiln leaves out, and why (the docs list the same)
NV_NOT_EXPORTED: dict[str, str] = {
    "nv_trt_llm_runtime_memory_metrics": "TensorRT-LLM runtime allocations; Kiln has no such runtime",
    "nv_trt_llm_disaggregated_serving_metrics": "Kiln has no disaggregated (context/generation split) serving",
    "nv_trt_llm_v1_metrics": "the V1 (static) batcher; Kiln only batches in flight",
}


def _num(stats: Mapping[str, Any], key: str) -> float | None:
    v = stats.get(key)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    return None


def nv_values(stats: Mapping[str, Any]) -> dict[tuple[str, str], float]:
    """``Executor.stats()`` -> {(family, category label value): value}. A value whose source is
    missing from ``stats`` is left out (an executor that does not report it), never made up."""
    g = lambda k: _num(stats, k)  # noqa: E731
    out: dict[tuple[str, str], float | None] = {}
    req = "nv_trt_llm_request_metrics"
    out[(req, "active")] = g("running")
    out[(req, "max")] = g("max_batch_size")
    out[(req, "scheduled")] = g("iter_scheduled")
    out[(req, "context")] = g("iter_context_requests")
    out[(req, "waiting")] = g("waiting")
    kv = "nv_trt_llm_kv_cache_block_metrics"
    total, free, used = g("kv_blocks_total"), g("kv_blocks_free"), g("kv_blocks_used")
    if used is None and total is not None and free is not None:
        used = total - free
    out[(kv, "max")] = total
    out[(kv, "free")] = free
    out[(kv, "used")] = used
    out[(kv, "tokens_per")] = g("kv_block_size")
    out[(kv, "fraction")] = used / total if used is not None and total else None
    new, reused = g("kv_alloc_new_blocks"), g("kv_reused_blocks")
    out[(kv, "alloc_new")] = new
    out[(kv, "reused")] = reused
    out[(kv, "alloc_total")] = new + reused if new is not None and reused is not None else None
    ifb = "nv_trt_llm_inflight_batcher_metrics"
    out[(ifb, "total_context_tokens")] = g("iter_context_tokens")
    out[(ifb, "generation_requests")] = g("iter_generation_requests")
    out[(ifb, "paused_requests")] = g("iter_paused")
    # one micro batch (no pipeline parallelism): its id is 0 whenever the engine reports iterations
    out[(ifb, "micro_batch_id")] = 0.0 if g("steps") is not None else None
    gen = "nv_trt_llm_general_metrics"
    out[(gen, "iteration_counter")] = g("steps")
    when = g("iter_time")
    out[(gen, "timestamp")] = float(int(when * 1e6)) if when is not None else None
    return {k: v for k, v in out.items() if v is not None}


class NvMetrics:
    """The ``nv_trt_llm_*`` gauges of one engine model instance.

    Labels are NVIDIA's: ``model``, ``version`` and the family's category label. ``instance`` is
    added only when given (a model with several engine instances, each with its own executor:
    without it their series would be one and overwrite each other). Not locked itself: the caller
    (``ServingMetrics``) holds ``metrics._LOCK`` around every call, as every metric operation must.
    """

    def __init__(self, pb: Any, model: str, version: str, instance: str | None = None):
        mf = pb.MetricFamily
        base = {"model": model, "version": version}
        if instance:
            base["instance"] = instance
        self._families: list[Any] = []  # kept referenced: a metric dies with its family
        self._series: dict[tuple[str, str], Any] = {}
        for name, (desc, key, values) in NV_FAMILIES.items():
            fam = mf(name=name, description=desc, kind=mf.GAUGE)
            self._families.append(fam)
            for v in values:
                self._series[(name, v)] = fam.Metric(labels={**base, key: v})

    def update(self, stats: Mapping[str, Any]) -> None:
        for key, value in nv_values(stats).items():
            metric = self._series.get(key)
            if metric is not None:
                metric.set(value)

    def close(self) -> None:
        self._series = {}
        self._families = []
