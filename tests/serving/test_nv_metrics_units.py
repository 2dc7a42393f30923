"""NVIDIA-named metrics and perf outputs without a server: the mapping from the executor's stats to
the nv_trt_llm_* series, their labels, and the per-request KV/timestamp figures from a real
scheduler and block manager (pure Python)."""
from __future__ import annotations

import types

import numpy as np

from backend.engine.kv_cache import BlockManager
from backend.engine.scheduler import Scheduler
from backend.serving.metrics.metrics import ServingMetrics
from backend.serving.metrics.nv_metrics import NV_FAMILIES, NV_NOT_EXPORTED, nv_values
from backend.serving.metrics.perf_metrics import PERF_OUTPUTS, perf_tensors
from tests.runtime.scheduler_helpers import make, run, step
from tests.serving.test_reliability_units import _Family, _series

STATS = {"running": 3, "waiting": 2, "max_batch_size": 64, "iter_scheduled": 3, "iter_context_requests": 1,
         "iter_context_tokens": 40, "iter_generation_requests": 2, "iter_paused": 0, "iter_time": 1764170000.25,
         "steps": 17, "kv_blocks_total": 256, "kv_blocks_free": 250, "kv_blocks_used": 6, "kv_block_size": 16,
         "kv_alloc_new_blocks": 9, "kv_reused_blocks": 2}


def test_stats_map_to_nvidia_families_and_label_values():
    v = nv_values(STATS)
    req, kv = "nv_trt_llm_request_metrics", "nv_trt_llm_kv_cache_block_metrics"
    ifb, gen = "nv_trt_llm_inflight_batcher_metrics", "nv_trt_llm_general_metrics"
    assert {k: v[(req, k)] for k in NV_FAMILIES[req][2]} == {"active": 3, "max": 64, "scheduled": 3, "context": 1,
                                                            "waiting": 2}
    assert {k: v[(kv, k)] for k in NV_FAMILIES[kv][2]} == {
        "max": 256, "free": 250, "used": 6, "tokens_per": 16, "fraction": 6 / 256, "alloc_new": 9, "reused": 2,
        "alloc_total": 11}
    assert {k: v[(ifb, k)] for k in NV_FAMILIES[ifb][2]} == {"total_context_tokens": 40, "generation_requests": 2,
                                                            "micro_batch_id": 0, "paused_requests": 0}
    assert v[(gen, "iteration_counter")] == 17
    assert v[(gen, "timestamp")] == 1764170000250000  # microseconds since the epoch
    # every key is a declared (family, label value); nothing NVIDIA-named that Kiln cannot fill
    assert all(fam in NV_FAMILIES and lv in NV_FAMILIES[fam][2] for fam, lv in v)
    assert not set(NV_FAMILIES) & set(NV_NOT_EXPORTED)


def test_missing_stats_are_left_out_not_invented():
    v = nv_values({"kv_blocks_total": 10, "kv_blocks_free": 4})
    assert v == {("nv_trt_llm_kv_cache_block_metrics", "max"): 10, ("nv_trt_llm_kv_cache_block_metrics", "free"): 4,
                 ("nv_trt_llm_kv_cache_block_metrics", "used"): 6,
                 ("nv_trt_llm_kv_cache_block_metrics", "fraction"): 0.6}
    assert nv_values({}) == {}


def test_serving_metrics_publish_nvidia_series_with_nvidia_labels():
    _Family.made = []
    pb = types.SimpleNamespace(MetricFamily=_Family)
    sm = ServingMetrics(pb, "tensorrt_llm", "tensorrt_llm_0_0", version="1")
    sm.update(STATS)
    used = _series("nv_trt_llm_kv_cache_block_metrics")
    assert used[(("kv_cache_block_type", "used"), ("model", "tensorrt_llm"), ("version", "1"))] == 6
    for fam, (_d, key, values) in NV_FAMILIES.items():
        assert {dict(k)[key] for k in _series(fam)} == set(values), fam
        assert all(set(dict(k)) == {"model", "version", key} for k in _series(fam)), fam
    assert _series("kiln_kv_blocks_used")  # kiln_* beside, from the same update
    sm.close()
    sm.update({**STATS, "kv_blocks_used": 99})  # after close: a no-op
    assert used == _series("nv_trt_llm_kv_cache_block_metrics")
    # several engine instances: their series stay apart
    _Family.made = []
    ServingMetrics(pb, "tensorrt_llm", "i1", version="1", nv_instance="i1").update(STATS)
    assert all(dict(k)["instance"] == "i1" for k in _series("nv_trt_llm_general_metrics"))
    # without a version (older callers) no NVIDIA family is created
    _Family.made = []
    ServingMetrics(pb, "engine", "0").update(STATS)
    assert not any(f.name.startswith("nv_") for f in _Family.made)


def test_per_request_blocks_and_timestamps_from_the_scheduler():
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_batch_size=4, max_num_tokens=64)  # the executor's clock: time.monotonic
    a = make("a", range(10, 20), max_tokens=5)       # 10 prompt tokens: 3 blocks of 4
    sched.add(a)
    run(sched)
    assert a.num_reused_blocks == 0
    # prompt + generated - 1 tokens hold KV at the end: 14 -> 4 blocks, each taken once
    assert a.num_new_blocks == -(-(10 + 5 - 1) // 4) == 4
    b = make("b", list(range(10, 20)) + [7], max_tokens=2)  # shares a's first 2 full blocks
    sched.add(b)
    run(sched)
    assert b.num_reused_blocks == 2 and b.num_new_blocks == 1
    t = perf_tensors(b)
    assert set(t) == set(PERF_OUTPUTS)
    assert int(t["kv_cache_alloc_total_blocks"][0]) == 3
    assert t["kv_cache_alloc_new_blocks"].dtype == np.int32 and t["arrival_time_ns"].dtype == np.int64
    ts = [int(t[k][0]) for k in ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns",
                                 "last_token_time_ns")]
    assert 0 < ts[0] and ts == sorted(ts)
    stats = sched.stats()
    assert stats["kv_alloc_new_blocks"] == 5 and stats["kv_reused_blocks"] == 2
    assert stats["iter_scheduled"] == 0  # nothing left to run
    assert stats["steps"] > 0 and stats["iter_time"] > 0


def test_last_iteration_figures_while_requests_run():
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_batch_size=4, max_num_tokens=64)
    sched.add(make("a", range(10, 30), max_tokens=8))
    step(sched)                                   # a's prompt (20 tokens)
    sched.add(make("b", range(40, 46), max_tokens=8))
    step(sched)                                   # a decodes, b's prompt
    s = sched.stats()
    assert (s["iter_scheduled"], s["iter_context_requests"], s["iter_context_tokens"],
            s["iter_generation_requests"], s["iter_paused"]) == (2, 1, 6, 1, 0)
    assert s["steps"] == 2 and s["max_batch_size"] == 4


def test_no_request_means_zero_perf_figures():
    t = perf_tensors(None)
    assert {k: int(v[0]) for k, v in t.items()} == dict.fromkeys(PERF_OUTPUTS, 0)


def test_instance_count_decides_the_extra_instance_label():
    from backend.serving.engine_model.model_args import instance_count
    assert instance_count({}) == 1
    assert instance_count({"instance_group": [{"count": 1, "kind": "KIND_CPU"}]}) == 1
    assert instance_count({"instance_group": [{"count": 2}, {"count": 1}]}) == 3
