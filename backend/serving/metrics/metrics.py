"""Custom metrics on Triton's /metrics endpoint through the Python backend's ``MetricFamily``.

Names are prefixed ``kiln_`` and labelled with the model name and instance, so several engine
instances stay apart. Gauges are refreshed from ``Executor.stats()`` by the engine host's poller
and before every request's final response; token/request counters and the histograms are updated
from the response path; the speculative decoding counters follow the executor's own running totals
(refreshed with the gauges). So a client holding a request's final response reads metrics that
include that request.

Every model that refuses or ends requests (``engine``, ``bls``, ``preprocessing``) also counts them
in ``kiln_request_errors_total{model, instance, kind}`` (``RequestErrors``; the kinds are
``ERROR_KINDS``); the engine adds ``kiln_engine_failures_total`` (it became unable to serve: its
loop died or a step hung) and follows the executor's ``preemptions`` and ``step_errors`` totals.
Several stubs may create the same family: Triton keeps one family per name and every stub adds its
own labelled series to it.

What the engine computes in is exported once at load (``compute_dtype``):
``kiln_engine_compute_dtype{dtype, asked} 1`` (the runner's dtype and ``engine.cpu_dtype``, or
``dtype=``/``device``) and, when ``auto`` timed the candidates on a CPU,
``kiln_engine_cpu_dtype_step_ms{dtype, shape}`` (the decode-step estimates it chose by).
"""
from __future__ import annotations

import threading
from typing import Any, Mapping

from backend.serving.metrics.nv_metrics import NvMetrics

__all__ = ["ERROR_KINDS", "RequestErrors", "ServingMetrics", "TTFT_BUCKETS", "TPOT_BUCKETS", "stats_counters",
           "stats_gauges"]

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
    # speculative decoding (EAGLE-3), since the model loaded; 0 while nothing was drafted
    "kiln_spec_acceptance_rate": ("Share of draft tokens the target accepted", ("acceptance_rate",)),
    "kiln_spec_mean_acceptance_length": ("Mean tokens gained per verifying step (accepted drafts + the "
                                         "target's own token)", ("mean_acceptance_length",)),
}

# counter name -> (help, the Executor.stats() running totals it follows, first present wins)
_COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "kiln_spec_draft_tokens_proposed_total": ("Draft tokens scored by the target model",
                                              ("draft_tokens_proposed", "draft_tokens")),
    "kiln_spec_draft_tokens_accepted_total": ("Draft tokens the target model accepted",
                                              ("draft_tokens_accepted", "accepted_draft_tokens")),
    "kiln_preemptions_total": ("Running requests preempted when KV blocks ran out (their blocks freed, "
                               "recomputed later)", ("preemptions", "num_preemptions")),
    "kiln_engine_step_errors_total": ("Engine steps that raised (their requests ended with an error; the "
                                      "engine kept serving)", ("step_errors",)),
    # the engine model's responder (backend/serving/engine_model/responder.py), not the executor
    "kiln_engine_responses_total": ("Responses the engine model sent", ("responses_sent",)),
    "kiln_engine_response_parts_total": ("Token groups those responses carried: more than the responses when "
                                         "groups waiting to be sent were joined (serving.coalesce_responses)",
                                         ("response_parts",)),
}

# kind label of kiln_request_errors_total: why a request did not end normally
ERROR_KINDS = (
    "invalid_request",  # refused: a missing, malformed or out-of-range input
    "cancelled",        # the client went away (stream closed or cancelled) or a stop_request stopped it
    "engine",           # the engine failed it: a failed step, a failed engine, an engine error seen by bls
    "unavailable",      # refused: the engine had failed, or too many requests were in flight
    "internal",         # a bug in Kiln's serving code (logged with a traceback)
)


def _flatten(stats: Mapping[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for k, v in stats.items():
        if isinstance(v, Mapping):
            flat.update({f"{k}_{kk}": vv for kk, vv in v.items()})
            flat.update({kk: vv for kk, vv in v.items() if kk not in stats})
        else:
            flat[k] = v
    return flat


def _pick(flat: Mapping[str, Any], table: Mapping[str, tuple[str, tuple[str, ...]]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, (_help, keys) in table.items():
        for k in keys:
            v = flat.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[name] = float(v)
                break
    return out


def stats_counters(stats: Mapping[str, Any]) -> dict[str, float]:
    """Executor stats -> the running totals the counters follow (absent keys are left out)."""
    return _pick(_flatten(stats), _COUNTERS)


def stats_gauges(stats: Mapping[str, Any]) -> dict[str, float]:
    """Executor stats -> gauge values (flat keys, or nested under ``kv_cache``/``scheduler``)."""
    out = _pick(_flatten(stats), _GAUGES)
    if "kiln_kv_blocks_used" not in out and {"kiln_kv_blocks_total", "kiln_kv_blocks_free"} <= out.keys():
        out["kiln_kv_blocks_used"] = out["kiln_kv_blocks_total"] - out["kiln_kv_blocks_free"]
    return out


# Every metric operation of this process goes through this lock. The Python backend stub keeps a
# metric's pending operation in the Metric object itself and sends it with the GIL released, so two
# threads updating one metric at once race on it (a storm of cancelled bls streams, whose threads
# count cancellations, crashed the server with boost::interprocess::lock_exception before the lock).
_LOCK = threading.RLock()


class RequestErrors:
    """``kiln_request_errors_total{model, instance, kind}``: one series per kind, created at 0."""

    def __init__(self, pb: Any, model: str, instance: str):
        mf = pb.MetricFamily
        with _LOCK:
            self._family = mf(name="kiln_request_errors_total", kind=mf.COUNTER,
                              description="Requests that did not end normally, by kind: invalid_request, "
                                          "cancelled, engine, unavailable, internal")
            self._by_kind = {k: self._family.Metric(labels={"model": model, "instance": instance, "kind": k})
                             for k in ERROR_KINDS}

    def count(self, kind: str) -> None:
        try:
            with _LOCK:
                if self._by_kind:
                    self._by_kind[kind].increment(1)
        except Exception:  # noqa: BLE001 - metrics must never cost a request its response
            pass

    def close(self) -> None:
        """Drop the series and the family now (call from ``finalize``): released later, while the
        stub's interpreter shuts down, they segfault the stub."""
        with _LOCK:
            self._by_kind = {}
            self._family = None


class ServingMetrics:
    def __init__(self, pb: Any, model: str, instance: str, *, version: str | None = None,
                 nv_instance: str | None = None):
        """``version`` given: also export tensorrtllm_backend's ``nv_trt_llm_*`` families
        (``nv_metrics.NvMetrics``, labelled model/version, plus ``nv_instance`` when given)."""
        labels = {"model": model, "instance": instance}
        self.pb, self.labels = pb, labels
        mf = pb.MetricFamily
        # families must stay referenced: a metric is dropped when its family is collected
        self._families: list[Any] = []
        self.errors = RequestErrors(pb, model, instance)
        with _LOCK:
            self._failures = self._make(mf, "kiln_engine_failures_total", "Times the engine became unable to "
                                        "serve (its loop died or a step hung); in-flight requests then end with "
                                        "an error", mf.COUNTER, labels)
            self._gauges = {name: self._make(mf, name, h, mf.GAUGE, labels) for name, (h, _k) in _GAUGES.items()}
            self._counters = {name: self._make(mf, name, h, mf.COUNTER, labels)
                              for name, (h, _k) in _COUNTERS.items()}
            self._totals: dict[str, float] = {}  # the executor totals the counters were last brought to
            self.nv = NvMetrics(pb, model, version, nv_instance) if version is not None else None
            self.generated = self._make(mf, "kiln_generated_tokens_total", "Tokens generated", mf.COUNTER, labels)
            self._pending_tokens = 0   # counted, not yet published (see ``tokens``)
            self.requests = self._make(mf, "kiln_requests_finished_total", "Requests finished", mf.COUNTER, labels)
            self.ttft = self._make(mf, "kiln_time_to_first_token_seconds", "Time from request arrival to its "
                                   "first generated token", mf.HISTOGRAM, labels, TTFT_BUCKETS)
            self.tpot = self._make(mf, "kiln_time_per_output_token_seconds", "Mean time per output token after "
                                   "the first, per request", mf.HISTOGRAM, labels, TPOT_BUCKETS)
        self.closed = False

    def _make(self, mf, name, desc, kind, labels, buckets=None):
        fam = mf(name=name, description=desc, kind=kind)
        self._families.append(fam)
        return fam.Metric(labels=labels, buckets=buckets) if buckets else fam.Metric(labels=labels)

    def update(self, stats: Mapping[str, Any]) -> None:
        with _LOCK:
            if self.closed:
                return
            self._publish_tokens()
            for name, value in stats_gauges(stats).items():
                self._gauges[name].set(value)
            if self.nv is not None:  # NVIDIA's names, from the same snapshot
                self.nv.update(stats)
            # The executor keeps running totals; a Prometheus counter only goes up, so add the growth
            # since the last refresh (a total that shrank means a new executor: count it from there).
            for name, total in stats_counters(stats).items():
                last = self._totals.get(name, 0.0)
                if total > last:
                    self._counters[name].increment(total - last)
                self._totals[name] = total

    def compute_dtype(self, choice: Mapping[str, Any]) -> None:
        """Export a ``DtypeChoice.as_dict()`` (backend/runtime/cpu_dtype.py); called once, at load."""
        with _LOCK:
            if self.closed:
                return
            mf = self.pb.MetricFamily
            info = self._make(mf, "kiln_engine_compute_dtype", "What the engine computes in (value 1): dtype, "
                              "and asked = engine.cpu_dtype (auto: measured at load), dtype= or device",
                              mf.GAUGE, {**self.labels, "dtype": choice["dtype"], "asked": choice["asked"]})
            info.set(1.0)
            self._dtype_series = [info]   # a series lives while its Python object does
            timed = choice.get("timings_ms") or {}
            if timed:
                fam = mf(name="kiln_engine_cpu_dtype_step_ms", kind=mf.GAUGE,
                         description="engine.cpu_dtype auto: estimated decode-step ms of each candidate dtype "
                                     "(one layer timed at load x layers + the logits matmul), by step shape")
                self._families.append(fam)
                for dtype, shapes in timed.items():
                    for shape, ms in shapes.items():
                        m = fam.Metric(labels={**self.labels, "dtype": dtype, "shape": shape})
                        m.set(float(ms))
                        self._dtype_series.append(m)

    def tokens(self, n: int) -> None:
        """Count ``n`` generated tokens. Published by the next ``update`` or ``request_done``, not
        here: a Triton metric write is a round trip to the server, and this is called for every
        stream on every step (2% of the engine's loop at 16 streams, py-spy)."""
        with _LOCK:
            self._pending_tokens += n

    def _publish_tokens(self) -> None:
        """Called with _LOCK held, not closed."""
        if self._pending_tokens:
            self.generated.increment(self._pending_tokens)
            self._pending_tokens = 0

    def request_done(self, ttft: float | None, tpot: float | None) -> None:
        with _LOCK:
            if self.closed:
                return
            self._publish_tokens()  # before the request's final response: it then reads its tokens
            self.requests.increment(1)
            if ttft is not None:
                self.ttft.observe(ttft)
            if tpot is not None:
                self.tpot.observe(tpot)

    def engine_failed(self) -> None:
        with _LOCK:
            if not self.closed:
                self._failures.increment(1)

    def close(self) -> None:
        """Drop every series and family now (call from ``finalize``; see ``RequestErrors.close``)."""
        with _LOCK:
            self.closed = True
            self.errors.close()
            self._gauges, self._counters, self._dtype_series = {}, {}, []
            if self.nv is not None:
                self.nv.close()
                self.nv = None
            self._failures = self.generated = self.requests = self.ttft = self.tpot = None
            self._families = []
