"""Cancellation and error accounting pieces that need no server: bls inner request ids, the
executor totals behind the reliability counters, and the metric objects' lifetime."""
from __future__ import annotations

import types

from backend.serving.metrics.metrics import ERROR_KINDS, RequestErrors, ServingMetrics, stats_counters


def test_bls_inner_ids_are_unguessable():
    from backend.serving.text_models.bls import new_inner_id
    from backend.serving.engine_model.engine_host import MIN_STOP_ID_LEN
    ids = {new_inner_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(i.startswith("bls-") and len(i) == 4 + 32 and len(i) >= MIN_STOP_ID_LEN for i in ids)
    assert all(int(i[4:], 16) >= 0 for i in ids)  # 128 random bits in hex


def test_preemptions_and_step_errors_follow_the_executor_totals():
    assert stats_counters({"preemptions": 3, "step_errors": 1, "draft_tokens": 0, "running": 2}) == {
        "kiln_preemptions_total": 3.0, "kiln_engine_step_errors_total": 1.0,
        "kiln_spec_draft_tokens_proposed_total": 0.0}


class _Metric:
    def __init__(self, labels):
        self.labels, self.value = labels, 0.0

    def increment(self, v):
        self.value += v

    set = observe = increment


class _Family:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    made: list = []

    def __init__(self, name, description, kind):
        self.name, self.metrics = name, []
        _Family.made.append(self)

    def Metric(self, labels, buckets=None):  # noqa: N802 - pb_utils' name
        m = _Metric(labels)
        self.metrics.append(m)
        return m


def _series(name):
    return {tuple(sorted(m.labels.items())): m.value for f in _Family.made if f.name == name for m in f.metrics}


def test_counters_grow_with_the_executor_totals_and_errors_by_kind():
    _Family.made = []
    pb = types.SimpleNamespace(MetricFamily=_Family)
    sm = ServingMetrics(pb, "engine", "0")
    sm.update({"preemptions": 2, "step_errors": 0})
    sm.update({"preemptions": 5, "step_errors": 1})
    pre = _series("kiln_preemptions_total")
    assert list(pre.values()) == [5.0]
    sm.errors.count("cancelled")
    sm.errors.count("invalid_request")
    sm.errors.count("invalid_request")
    by_kind = {dict(k)["kind"]: v for k, v in _series("kiln_request_errors_total").items()}
    assert by_kind == {**dict.fromkeys(ERROR_KINDS, 0.0), "cancelled": 1.0, "invalid_request": 2.0}
    sm.engine_failed()
    assert list(_series("kiln_engine_failures_total").values()) == [1.0]
    sm.close()  # later calls (a late poller refresh, a late request) are no-ops, not errors
    sm.update({"preemptions": 9})
    sm.tokens(3)
    sm.request_done(0.1, 0.01)
    sm.errors.count("engine")
    assert list(_series("kiln_preemptions_total").values()) == [5.0]


def test_request_errors_of_another_model_are_their_own_series():
    _Family.made = []
    pb = types.SimpleNamespace(MetricFamily=_Family)
    bls, pre = RequestErrors(pb, "bls", "0"), RequestErrors(pb, "preprocessing", "0")
    bls.count("cancelled")
    pre.count("invalid_request")
    got = {(dict(k)["model"], dict(k)["kind"]): v for k, v in _series("kiln_request_errors_total").items() if v}
    assert got == {("bls", "cancelled"): 1.0, ("preprocessing", "invalid_request"): 1.0}


def test_compute_dtype_is_exported_with_the_timings_it_was_chosen_by():
    _Family.made = []
    pb = types.SimpleNamespace(MetricFamily=_Family)
    sm = ServingMetrics(pb, "engine", "0")
    sm.compute_dtype({"dtype": "float32", "asked": "auto", "reason": "r", "probe_s": 0.5,
                      "timings_ms": {"float32": {"1 seq x 256 ctx": 40.0}, "bfloat16": {"1 seq x 256 ctx": 60.0}}})
    info = _series("kiln_engine_compute_dtype")
    assert info == {(("asked", "auto"), ("dtype", "float32"), ("instance", "0"), ("model", "engine")): 1.0}
    step = {(dict(k)["dtype"], dict(k)["shape"]): v for k, v in _series("kiln_engine_cpu_dtype_step_ms").items()}
    assert step == {("float32", "1 seq x 256 ctx"): 40.0, ("bfloat16", "1 seq x 256 ctx"): 60.0}
    _Family.made = []
    ServingMetrics(pb, "engine", "1").compute_dtype({"dtype": "bfloat16", "asked": "bfloat16", "timings_ms": {}})
    assert list(_series("kiln_engine_compute_dtype").values()) == [1.0]
    assert not _series("kiln_engine_cpu_dtype_step_ms")   # nothing timed: no series


def test_generated_tokens_are_published_in_one_write_before_a_final_response_or_on_refresh():
    """Counting a step's tokens writes no metric (each write is a round trip to the server); the
    count reaches kiln_generated_tokens_total at the next refresh, or when a request finishes
    (before its final response goes out)."""
    _Family.made = []
    pb = types.SimpleNamespace(MetricFamily=_Family)
    sm = ServingMetrics(pb, "engine", "0")
    writes = []
    gen = sm.generated
    gen.increment = lambda v: (writes.append(v), _Metric.increment(gen, v))
    for n in (1, 1, 2, 0):
        sm.tokens(n)
    assert writes == [] and gen.value == 0.0
    sm.request_done(0.1, 0.01)
    assert writes == [4] and gen.value == 4.0
    sm.tokens(3)
    sm.update({})
    sm.update({})   # nothing new: no write
    assert writes == [4, 3] and gen.value == 7.0
