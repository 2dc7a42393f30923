"""harness.bench.gpu's pieces on CPU with a tiny shape (the benchmark itself needs a GPU): synthetic FP8
weights in the bundle layout load into a real Executor through a manifest-only bundle and generate, and
the single-stream and throughput measurements count what was generated."""
from __future__ import annotations

import pytest

from harness.bench import gpu as bench_gpu

TINY = dict(bench_gpu.LLAMA31_8B, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=512)


@pytest.fixture()
def executor(tmp_path):
    from backend.engine.executor import Executor
    w = bench_gpu.synthetic_fp8_weights(TINY, device="cpu")
    assert w["layers.0.qkv.weight"].shape == (4 * 32 + 2 * 2 * 32, 128)
    assert bench_gpu.weight_bytes_per_token(w) < sum(t.numel() * t.element_size() for t in w.values())
    engine = {"max_batch_size": 8, "max_num_tokens": 256, "max_seq_len": 128, "max_input_len": 64,
              "kv_block_size": 16, "kv_cache_dtype": "fp8_e4m3", "max_kv_tokens": 2048}
    bundle = bench_gpu.manifest_bundle(TINY, engine, tmp_path / "engine")
    ex = Executor(bundle, device="cpu", weights=w, verify_hashes=False)
    yield ex
    ex.shutdown()


def test_single_stream_and_throughput_count_tokens(executor):
    ss = bench_gpu.single_stream(executor, TINY["vocab_size"], prompt_len=20, out_len=12)
    assert ss["output_len"] == 12 and ss["decode_ms_per_token"] > 0
    tp = bench_gpu.throughput(executor, TINY["vocab_size"], n=6, isl=30, osl=5, max_seconds=120)
    assert tp["complete"] and tp["completed_requests"] == 6
    assert tp["output_tokens"] == 6 * 5


def test_throughput_stops_at_the_deadline_and_says_so(executor):
    tp = bench_gpu.throughput(executor, TINY["vocab_size"], n=8, isl=60, osl=60, max_seconds=0.0)
    assert not tp["complete"] and tp["completed_requests"] < 8
