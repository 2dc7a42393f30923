"""harness.perf.throughput.gpu's pieces on CPU with a tiny shape (the benchmark itself needs a GPU): synthetic FP8
weights in the bundle layout load into a real Executor through a manifest-only bundle and generate, and
the single-stream and throughput measurements count what was generated; the whole command in its dry
run: concurrency bounded by the KV pool alone, a time limit stated in the result."""
from __future__ import annotations

import pytest

from harness.perf.throughput import gpu as bench_gpu
from harness.perf.lib import models

TINY = models.TINY


@pytest.fixture()
def executor(tmp_path):
    from backend.engine.executor import Executor
    w = models.synthetic_fp8_weights(TINY, device="cpu")
    assert w["layers.0.qkv.weight"].shape == (4 * 32 + 2 * 2 * 32, 128)
    assert models.weight_bytes_per_token(w) < sum(t.numel() * t.element_size() for t in w.values())
    engine = {"max_batch_size": 8, "max_num_tokens": 256, "max_seq_len": 128, "max_input_len": 64,
              "kv_block_size": 16, "kv_cache_dtype": "fp8_e4m3", "max_kv_tokens": 2048}
    bundle = models.manifest_bundle(TINY, engine, tmp_path / "engine")
    ex = Executor(bundle, device="cpu", weights=w, verify_hashes=False)
    yield ex
    ex.shutdown()


def test_single_stream_and_throughput_count_tokens(executor):
    ss = bench_gpu.single_stream(executor, TINY["vocab_size"], prompt_len=20, out_len=12)
    assert ss["output_len"] == 12 and ss["decode_ms_per_token"] > 0
    tp = bench_gpu.throughput(executor, TINY["vocab_size"], n=6, isl=30, osl=5, time_limit=120)
    assert tp["complete"] and tp["completed_requests"] == 6
    assert tp["output_tokens"] == 6 * 5


def test_throughput_stops_at_the_deadline_and_says_so(executor):
    tp = bench_gpu.throughput(executor, TINY["vocab_size"], n=8, isl=60, osl=60, time_limit=0.0)
    assert not tp["complete"] and tp["completed_requests"] < 8
    assert tp["time_limit_s"] == 0.0 and tp["output_tok_s"] >= 0


def test_dry_run_is_bounded_by_kv_capacity_alone(tmp_path):
    """max_batch_size 4096, a pool holding 3 requests' whole lives: at most 3 run at once, none is
    preempted (guaranteed_no_evict), all 8 finish, and the result says what bounded it."""
    import json
    out = tmp_path / "dry.json"
    assert bench_gpu.main(["--dry-run", "--skip-eager", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    tp = res["throughput"]
    assert res["engine"]["max_batch_size"] == 4096 and res["engine"]["scheduler_policy"] == "guaranteed_no_evict"
    assert res["kv"]["requests_at_once"] == 3 == tp["kv_requests_at_once"]
    assert tp["complete"] and tp["completed_requests"] == tp["num_requests"] == 8
    assert tp["output_tokens"] == 8 * tp["osl"] and tp["preemptions"] == 0
    assert 1 <= tp["peak_running"] <= 3
    assert tp["time_limit_s"] is None and tp["time_limit_from"] is None
    assert res["single_stream_cuda_graphs"]["output_len"] == 8
    ab = res["single_stream_overlap_ab"]   # engine.overlap_scheduling on vs off, same engine, same run
    assert ab["on"]["output_len"] == ab["off"]["output_len"] == 8 and ab["off_over_on"] > 0


def test_dry_run_budget_cuts_the_time_limit_and_says_so(tmp_path):
    import json
    out = tmp_path / "dry.json"
    assert bench_gpu.main(["--dry-run", "--skip-eager", "--time-limit", "100", "--budget-s", "1",
                           "--out", str(out)]) == 0
    tp = json.loads(out.read_text())["throughput"]
    assert tp["time_limit_from"] == "--budget-s" and tp["time_limit_s"] == 0.0 and not tp["complete"]


def test_throughput_says_where_its_time_went_and_profiles_a_window(executor):
    """The step-kind split adds up to the run's steps and tokens, and a profiler window (opened at once,
    closed at the end if the run is shorter) counts the steps and tokens it held (its kernel table and
    GPU busy fraction need a GPU: none here, so the table is empty and the fraction 0)."""
    from harness.perf.throughput.gpu import ProfileWindow
    before = executor.stats()
    tp = bench_gpu.throughput(executor, TINY["vocab_size"], n=4, isl=40, osl=30, time_limit=120,
                              window=ProfileWindow(0.0, seconds=60.0))
    after = executor.stats()
    split = tp["where_time_went"]
    assert sum(w["steps"] for w in split.values()) == after["steps"] - before["steps"]
    assert split["with_prefill"]["prefill_tokens"] == 4 * 40 and split["with_prefill"]["steps"] >= 1
    assert sum(w["decode_tokens"] for w in split.values()) == after["decode_tokens_computed"] - before["decode_tokens_computed"]
    pw = tp["profile_window"]
    assert pw is not None and 1 <= pw["steps"] <= after["steps"] - before["steps"]
    assert pw["decode_tokens"] > 0 and pw["kernels"] == [] and pw["gpu_busy"] == 0
