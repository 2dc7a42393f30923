"""Command lines (serve, client, bench) refuse bad arguments in one line; small pure helpers."""
from __future__ import annotations

import types

import pytest

from backend.serving.engine_model.engine_host import chosen_logprobs
from backend.serving.metrics.metrics import stats_gauges
from harness.perf.serving import sweep as bench
from harness import client, serve
from harness.serving_server import free_port
from harness.model_names import DEFAULT as NAMES


def _fails(capsys, fn, argv, fragment):
    with pytest.raises(SystemExit) as e:
        fn(argv)
    assert e.value.code == 2
    assert fragment in capsys.readouterr().err


def test_serve_arguments(capsys, tmp_path):
    _fails(capsys, serve.parse_args, [], "--model-repository")
    _fails(capsys, serve.parse_args, ["--model-repository", str(tmp_path / "nope")], "not found; build it first")
    _fails(capsys, serve.parse_args, ["--model-repository", str(tmp_path), "--http-port", "8001"], "must differ")
    _fails(capsys, serve.parse_args, ["--model-repository", str(tmp_path), "--grpc-port", "70000"],
           "--grpc-port: 70000; allowed: 1..65535")
    a = serve.parse_args(["--model-repository", str(tmp_path)])
    assert (a.http_port, a.grpc_port, a.metrics_port, a.host) == (8000, 8001, 8002, "127.0.0.1")


def test_client_arguments_and_unreachable_server(capsys):
    _fails(capsys, client.parse_args, ["hi", "--max-tokens", "0"], "--max-tokens: 0; allowed: >= 1")
    _fails(capsys, client.parse_args, ["hi", "--protocol", "udp"], "invalid choice")
    port = free_port()  # nothing listens there
    assert client.main(["--protocol", "http", "--url", f"127.0.0.1:{port}", "hi"]) == 2
    assert f"127.0.0.1:{port}" in capsys.readouterr().err


def test_bench_arguments(capsys):
    _fails(capsys, bench.parse_args, ["--concurrency", "1,x"], "--concurrency: '1,x'; allowed: comma-separated")
    _fails(capsys, bench.parse_args, ["--concurrency", "0"], "every level must be >= 1")
    _fails(capsys, bench.parse_args, ["--concurrency", "", "--max-tokens", "4"], "nothing to run")
    _fails(capsys, bench.parse_args, ["--request-rate", "-1"], "--request-rate: -1.0; allowed: > 0")
    a = bench.parse_args(["--models", "ensemble,tensorrt_llm_bls"])
    assert a.levels == [1, 4, 16, 64] and a.model_list == ["ensemble", "tensorrt_llm_bls"]
    assert bench.parse_args([]).model_list == [NAMES.ensemble]


def test_stats_to_gauges():
    # the executor's stats() shape: scheduler counters plus the block manager's
    g = stats_gauges({"running": 3, "waiting": 1, "kv_blocks_total": 256, "kv_blocks_used": 10,
                      "kv_blocks_free": 246, "kv_blocks_cached": 4, "prefix_cache_hit_rate": 0.25,
                      "ttft_s": [0.1], "device": "cpu"})
    assert g == {"kiln_requests_running": 3.0, "kiln_requests_waiting": 1.0, "kiln_kv_blocks_used": 10.0,
                 "kiln_kv_blocks_free": 246.0, "kiln_kv_blocks_cached": 4.0, "kiln_kv_blocks_total": 256.0,
                 "kiln_prefix_cache_hit_rate": 0.25}
    # used is derived when only total and free are known
    assert stats_gauges({"kv_cache": {"num_blocks": 8, "num_free_blocks": 6}})["kiln_kv_blocks_used"] == 2.0


def test_chosen_logprobs_reads_the_sampler_format():
    ev = types.SimpleNamespace(token_ids=[5, 9], logprobs=[(-0.5, [(5, -0.5)]), (-1.25, [(9, -1.25)])])
    assert chosen_logprobs(ev) == [-0.5, -1.25]
    assert chosen_logprobs(types.SimpleNamespace(token_ids=[5], logprobs=None)) == []


def test_bench_levels_send_prompts_no_earlier_level_sent():
    """A repeated prompt would be served from the prefix cache (HF has none): levels take consecutive
    slices, and a row says how many of its prompts an earlier level sent once the list wraps."""
    base = [f"q{i}" for i in range(10)]
    assert bench.level_prompts(base, 0, 4) == (["q0", "q1", "q2", "q3"], 0)
    assert bench.level_prompts(base, 4, 4) == (["q4", "q5", "q6", "q7"], 0)
    assert bench.level_prompts(base, 8, 4) == (["q8", "q9", "q0", "q1"], 2)   # wrapped onto level 1's
    assert bench.level_prompts(base, 12, 3) == (["q2", "q3", "q4"], 3)         # all sent before
    assert bench.WARMUP_PROMPT not in base
