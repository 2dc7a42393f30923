"""Custom metrics on Triton's /metrics endpoint through the Python backend's ``MetricFamily``.

Names are prefixed ``kiln_`` and labelled with the model name and instance, so several engine
instances stay apart. Gauges are refreshed from ``Executor.stats()`` by the engine host's poller;
counters and histograms are updated from the response path.
"""
from __future__ import annotations

from typing import Any, Mapping

__all__ = ["ServingMetrics", "TTFT_BUCKETS", "TPOT_BUCKETS", "stats_gauges"]

TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0]
TPOT_BUCKETS = [0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0]

# gauge name -> (help, the Executor.stats() keys it may come from, first present wins)
_GAUGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "kiln_requests_running": ("Requests being generated (in the running batch)",
                              ("num_running", "running")),
    "kiln_requests_waiting": ("Requests queued, not yet scheduled", ("num_waiting", "waiting")),
    "kiln_kv_blocks_used": ("KV cache blocks held by requests", ("kv_blocks_used", "num_used_blocks")),
    "kiln_kv_blocks_free": ("KV cache blocks free (including cached ones that can be evicted)",
                            ("kv_blocks_free", "num_free_blocks")),
    "kiln_kv_blocks_cached": ("Free KV cache blocks holding a reusable prefix",
                              ("kv_blocks_cached", "num_cached_blocks")),
    "kiln_kv_blocks_total": ("KV cache blocks in the pool", ("kv_blocks_total", "num_blocks")),
    "kiln_prefix_cache_hit_rate": ("Share of prompt tokens served from the prefix cache",
                                   ("prefix_cache_hit_rate",)),
}


def stats_gauges(stats: Mapping[str, Any]) -> dict[str, float]:
    """Executor stats -> gauge values (flat keys, or nested under ``kv_cache``/``scheduler``)."""
    flat: dict[str, Any] = {}
    for k, v in stats.items():
        if isinstance(v, Mapping):
            flat.update({f"{k}_{kk}": vv for kk, vv in v.items()})
            flat.update({kk: vv for kk, vv in v.items() if kk not in stats})
        else:
            flat[k] = v
    out: dict[str, float] = {}
    for name, (_help, keys) in _GAUGES.items():
        for k in keys:
            if isinstance(flat.get(k), (int, float)):
                out[name] = float(flat[k])
                break
    if "kiln_kv_blocks_used" not in out and {"kiln_kv_blocks_total", "kiln_kv_blocks_free"} <= out.keys():
        out["kiln_kv_blocks_used"] = out["kiln_kv_blocks_total"] - out["kiln_kv_blocks_free"]
    return out


class ServingMetrics:
    def __init__(self, pb: Any, model: str, instance: str):
        labels = {"model": model, "instance": instance}
        mf = pb.MetricFamily
        # families must stay referenced: a metric is dropped when its family is collected
        self._families: list[Any] = []
        self._gauges = {name: self._make(mf, name, h, mf.GAUGE, labels) for name, (h, _k) in _GAUGES.items()}
        self.generated = self._make(mf, "kiln_generated_tokens_total", "Tokens generated", mf.COUNTER, labels)
        self.requests = self._make(mf, "kiln_requests_finished_total", "Requests finished", mf.COUNTER, labels)
        self.ttft = self._make(mf, "kiln_time_to_first_token_seconds", "Time from request arrival to its "
                               "first generated token", mf.HISTOGRAM, labels, TTFT_BUCKETS)
        self.tpot = self._make(mf, "kiln_time_per_output_token_seconds", "Mean time per output token after "
                               "the first, per request", mf.HISTOGRAM, labels, TPOT_BUCKETS)

    def _make(self, mf, name, desc, kind, labels, buckets=None):
        fam = mf(name=name, description=desc, kind=kind)
        self._families.append(fam)
        return fam.Metric(labels=labels, buckets=buckets) if buckets else fam.Metric(labels=labels)

    def update(self, stats: Mapping[str, Any]) -> None:
        for name, value in stats_gauges(stats).items():
            self._gauges[name].set(value)

    def tokens(self, n: int) -> None:
        if n:
            self.generated.increment(n)

    def request_done(self, ttft: float | None, tpot: float | None) -> None:
        self.requests.increment(1)
        if ttft is not None:
            self.ttft.observe(ttft)
        if tpot is not None:
            self.tpot.observe(tpot)
