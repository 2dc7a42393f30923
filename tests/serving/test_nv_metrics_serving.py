"""NVIDIA's metric families and return_perf_metrics outputs on the real Triton server.

The engine model is found by what it is (the ensemble's middle step), not by name: the repository
may be built with NVIDIA's names or Kiln's.
"""
from __future__ import annotations

import queue
import re
import time
import uuid

import numpy as np
import pytest
import requests

pytestmark = [pytest.mark.slow, pytest.mark.server]

PERF = ("kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks", "arrival_time_ns",
        "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns", "acceptance_rate",
        "total_accepted_draft_tokens", "total_draft_tokens")
_LINE = re.compile(r'^(\w+)\{([^}]*)\}\s+(\S+)$')


def engine_model(repo) -> str:
    """The ensemble's middle step (preprocessing -> engine -> postprocessing)."""
    for cfg in sorted(repo.glob("*/config.pbtxt")):
        text = cfg.read_text()
        if re.search(r'platform:\s*"ensemble"', text):
            steps = re.findall(r'model_name:\s*"([^"]+)"', text)
            assert len(steps) == 3, steps
            return steps[1]
    raise AssertionError(f"no ensemble in {repo}")


def scrape(srv) -> dict[tuple[str, frozenset], float]:
    out = {}
    for line in requests.get(srv.metrics_url, timeout=10).text.splitlines():
        m = _LINE.match(line)
        if m:
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            out[(m.group(1), labels)] = float(m.group(3))
    return out


def nv(metrics, family: str, model: str, key: str) -> dict[str, float]:
    """{category label value: value} of one nv_trt_llm_* family for ``model`` (NVIDIA's labels only)."""
    got = {}
    for (name, labels), v in metrics.items():
        d = dict(labels)
        if name == family and d.get("model") == model:
            assert set(d) == {"model", "version", key}, d
            assert d["version"] == "1"
            got[d[key]] = v
    return got


class EngineStream:
    """One streaming request to the engine model on its own gRPC stream (token ids in)."""

    def __init__(self, srv, model: str, ids: list[int], n: int, perf: bool | None):
        import tritonclient.grpc as g
        self.responses: queue.Queue = queue.Queue()
        self.client = g.InferenceServerClient(srv.grpc_url)
        batched = self.client.get_model_config(model).config.max_batch_size > 0
        inputs = []
        values = [("input_ids", np.array(ids, np.int32)), ("input_lengths", np.array([len(ids)], np.int32)),
                  ("request_output_len", np.array([n], np.int32)), ("min_tokens", np.array([n], np.int32)),
                  ("streaming", np.array([True]))]
        if perf is not None:
            values.append(("return_perf_metrics", np.array([perf])))
        for name, arr in values:
            arr = arr[None] if batched else arr  # a batch of one where the model has a batch dimension
            inp = g.InferInput(name, list(arr.shape), "BOOL" if arr.dtype == bool else "INT32")
            inp.set_data_from_numpy(arr)
            inputs.append(inp)
        self.client.start_stream(callback=lambda result, error: self.responses.put((result, error)))
        self.client.async_stream_infer(model, inputs, request_id=str(uuid.uuid4()))

    def collect(self, timeout: float = 240.0) -> list[dict[str, np.ndarray]]:
        """Every response's outputs, up to the final one (the one with a finish_reason)."""
        out, deadline = [], time.monotonic() + timeout
        while True:
            result, error = self.responses.get(timeout=max(deadline - time.monotonic(), 0.1))
            assert error is None, error
            names = [o.name for o in result.get_response().outputs]
            out.append({k: result.as_numpy(k) for k in names})
            reason = out[-1].get("finish_reason")
            if reason is not None and np.asarray(reason).reshape(-1)[0]:
                break
        self.client.stop_stream()
        self.client.close()
        return out


@pytest.fixture(scope="module")
def engine(triton_server):
    return engine_model(triton_server.repo)


@pytest.fixture(scope="module")
def tok(triton_server):
    from backend.serving.conversion.tokenizer import load_tokenizer
    return load_tokenizer(triton_server.repo.parent / "engine")


def test_nvidia_families_follow_a_running_request(triton_server, engine, tok):
    before = scrape(triton_server)
    kv0 = nv(before, "nv_trt_llm_kv_cache_block_metrics", engine, "kv_cache_block_type")
    assert set(kv0) == {"max", "free", "used", "tokens_per", "fraction", "alloc_total", "alloc_new", "reused"}
    assert kv0["max"] > 0 and kv0["tokens_per"] > 0 and kv0["free"] + kv0["used"] == kv0["max"]
    gen0 = nv(before, "nv_trt_llm_general_metrics", engine, "general_type")
    assert set(gen0) == {"iteration_counter", "timestamp"}
    succ0 = sum(v for (n, lb), v in before.items() if n == "nv_inference_request_success"
                and dict(lb).get("model") == engine)

    ids = tok.encode(f"{uuid.uuid4()} Write a very long story about a dragon who learns to sing.")
    stream = EngineStream(triton_server, engine, ids, 300, perf=None)
    seen_running, counters = None, []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        m = scrape(triton_server)
        req = nv(m, "nv_trt_llm_request_metrics", engine, "request_type")
        kv = nv(m, "nv_trt_llm_kv_cache_block_metrics", engine, "kv_cache_block_type")
        ifb = nv(m, "nv_trt_llm_inflight_batcher_metrics", engine, "inflight_batcher_specific_metric")
        counters.append(nv(m, "nv_trt_llm_general_metrics", engine, "general_type")["iteration_counter"])
        assert set(req) == {"active", "max", "scheduled", "context", "waiting"}
        assert set(ifb) == {"total_context_tokens", "generation_requests", "micro_batch_id", "paused_requests"}
        if req["active"] >= 1 and kv["used"] > 0 and ifb["generation_requests"] >= 1:
            seen_running = (req, kv, ifb)
            if len(counters) >= 3 and counters[-1] > counters[0]:
                break
        time.sleep(0.3)
    assert seen_running is not None, "never saw the request running in nv_trt_llm_* metrics"
    req, kv, ifb = seen_running
    assert req["max"] == 64 and req["scheduled"] >= 1  # engine.max_batch_size=64 in the serving build
    assert kv["used"] >= -(-len(ids) // kv["tokens_per"])
    assert kv["fraction"] == pytest.approx(kv["used"] / kv["max"], rel=1e-6)
    assert ifb["micro_batch_id"] == 0
    assert counters[-1] > counters[0], counters  # iterations keep counting while it generates

    responses = stream.collect()
    assert sum(len(np.asarray(r["output_ids"]).reshape(-1)) for r in responses) == 300
    after = scrape(triton_server)
    gen = nv(after, "nv_trt_llm_general_metrics", engine, "general_type")
    assert gen["iteration_counter"] >= gen0["iteration_counter"] + 300  # at least one per token
    assert gen["timestamp"] / 1e6 == pytest.approx(time.time(), abs=120)  # microseconds since the epoch
    kv1 = nv(after, "nv_trt_llm_kv_cache_block_metrics", engine, "kv_cache_block_type")
    assert kv1["alloc_new"] - kv0["alloc_new"] >= -(-(len(ids) + 299) // kv1["tokens_per"]) - kv1["reused"]
    assert kv1["alloc_total"] == kv1["alloc_new"] + kv1["reused"]
    succ = sum(v for (n, lb), v in after.items() if n == "nv_inference_request_success"
               and dict(lb).get("model") == engine)
    assert succ == succ0 + 1  # Triton's own per-model count, beside NVIDIA's families
    # nothing left: the per-iteration gauges read 0, the pool is free again
    deadline = time.monotonic() + 15
    while True:
        m = scrape(triton_server)
        req = nv(m, "nv_trt_llm_request_metrics", engine, "request_type")
        kv = nv(m, "nv_trt_llm_kv_cache_block_metrics", engine, "kv_cache_block_type")
        if (req["active"], req["scheduled"], kv["used"]) == (0, 0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert (req["active"], req["scheduled"], req["waiting"], kv["used"]) == (0, 0, 0, 0)
    assert kv["free"] == kv["max"]


def test_perf_outputs_exactly_when_asked_and_consistent(triton_server, engine, tok):
    bs = nv(scrape(triton_server), "nv_trt_llm_kv_cache_block_metrics", engine, "kv_cache_block_type")["tokens_per"]
    ids = tok.encode(f"{uuid.uuid4()} " + "Tell me everything about the history of the harbour town. " * 3)
    n = 12
    first = EngineStream(triton_server, engine, ids, n, perf=True).collect()
    for r in first:  # on every response, one value each
        assert set(PERF) <= set(r)
        assert all(np.asarray(r[k]).size == 1 for k in PERF)
    got = {k: np.asarray(first[-1][k]).reshape(-1)[0] for k in PERF}
    assert first[-1]["arrival_time_ns"].dtype == np.int64 and first[-1]["kv_cache_alloc_new_blocks"].dtype == np.int32
    t = [int(got[k]) for k in ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns",
                               "last_token_time_ns")]
    assert 0 < t[0] <= t[1] <= t[2] <= t[3], t
    assert t[3] - t[0] < 120e9
    new, reused, total = (int(got[k]) for k in PERF[:3])
    assert total == new + reused
    # a fresh prompt: no block reused; blocks for prompt + generated - 1 tokens (the last one has no KV)
    assert reused == 0
    assert total == -(-(len(ids) + n - 1) // int(bs))
    assert (got["acceptance_rate"], got["total_draft_tokens"]) == (0.0, 0)  # no draft in this bundle
    for perf in (None, False):  # not asked: none of them
        for r in EngineStream(triton_server, engine, ids, n, perf=perf).collect():
            assert not set(PERF) & set(r), perf
    # the same prompt again: its full blocks come from the prefix cache (all but the last token's)
    again = EngineStream(triton_server, engine, ids, n, perf=True).collect()[-1]
    reused2 = int(np.asarray(again["kv_cache_reused_blocks"]).reshape(-1)[0])
    total2 = int(np.asarray(again["kv_cache_alloc_total_blocks"]).reshape(-1)[0])
    assert reused2 == (len(ids) - 1) // int(bs) > 0
    assert total2 == total


def bls_model(repo) -> str:
    """The model whose config names the engine model it calls (``engine_model``)."""
    for cfg in sorted(repo.glob("*/config.pbtxt")):
        text = cfg.read_text()
        if '"engine_model"' in text:
            return re.search(r'^name:\s*"([^"]+)"', text, re.M).group(1)
    raise AssertionError(f"no bls model in {repo}")


def test_bls_passes_the_perf_outputs_through(triton_server):
    from harness.serving_client import http_generate
    bls = bls_model(triton_server.repo)
    text = f"{uuid.uuid4()} " + "The capital of France is a city on the river Seine. " * 3  # > 2 KV blocks
    plain = http_generate(triton_server.http_url, bls, text, max_tokens=6, temperature=0.0)
    assert not set(PERF) & set(plain)
    body = http_generate(triton_server.http_url, bls, text, max_tokens=6, temperature=0.0,
                         return_perf_metrics=True)
    assert set(PERF) <= set(body)
    one = {k: np.asarray(body[k]).reshape(-1)[0] for k in PERF}
    t = [int(one[k]) for k in ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns",
                               "last_token_time_ns")]
    assert 0 < t[0] <= t[1] <= t[2] <= t[3], t
    assert int(one["kv_cache_alloc_total_blocks"]) == int(one["kv_cache_alloc_new_blocks"]) + int(
        one["kv_cache_reused_blocks"]) > 0
    # the same prompt ran just before (without perf figures): its full blocks were reused
    assert int(one["kv_cache_reused_blocks"]) >= 2
