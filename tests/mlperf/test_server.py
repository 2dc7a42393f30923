"""Real LoadGen runs against a real Triton server serving the default engine (SmolLM2 FP8).

One server for the module; every run is a --test-run with 4 queries of at most 8 tokens so the
whole file fits the CI budget on 2 cores (the numbers are not benchmarks: see docs/perf/mlperf/).
"""
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from harness.mlperf.run import RunRequest, run
from harness.model_names import DEFAULT as NAMES
from harness.submission.check import check_tree
from harness.submission.package import package

pytestmark = [pytest.mark.slow, pytest.mark.server]
REPO = Path(__file__).resolve().parents[2]
# the default engine; KILN_MLPERF_TEST_ENGINE=smollm2-135m-bf16 runs the same tests on another build
ENGINE = os.environ.get("KILN_MLPERF_TEST_ENGINE", "smollm2-135m-fp8")
# The default engine's recipe (FP8 weights + FP8 KV) with a lighter calibration and no verify stage,
# to keep the build inside this file's CI budget; the harness does not care how well it calibrated.
BUILD_OVERRIDES = ["quantization.calibration.num_samples=4", "quantization.calibration.max_seq_len=64",
                   "verify.enabled=false"]
CONFIG = REPO / "configs" / f"{ENGINE}.yaml"
MAX_TOKENS, QUERIES = 8, 4


@pytest.fixture(scope="module")
def served(build_bundle, tmp_path_factory):
    from harness.serving_server import TritonServer

    out = Path(build_bundle(ENGINE, BUILD_OVERRIDES)).parent
    root = tmp_path_factory.mktemp("mlperf-runs")
    user_conf = root / "user.conf"  # arrivals fast enough that a 4-query Server run takes seconds
    user_conf.write_text("smollm2.Offline.target_qps = 2\nsmollm2.Server.target_qps = 4\n")
    with TritonServer(out / "model_repository", log_file=root / "tritonserver.log") as srv:
        yield {"out": out, "url": srv.grpc_url, "root": root, "user_conf": user_conf, "results": {}}


def _run(served, scenario, mode="PerformanceOnly", compliance=None, queries=QUERIES):
    key = (scenario, compliance or mode, queries)
    root = served["root"] if queries == QUERIES else served["root"] / f"q{queries}"  # packaged: QUERIES only
    if key not in served["results"]:
        served["results"][key] = run(RunRequest(
            config=CONFIG, output=served["out"], scenario=scenario, mode=mode, compliance=compliance,
            test_run=True, server_url=served["url"], log_root=root / ENGINE / "mlperf",
            user_conf=served["user_conf"], max_output_tokens=MAX_TOKENS, test_queries=queries))
    return served["results"][key]


def test_offline_and_server_logs_have_token_metrics(served):
    off = _run(served, "Offline")
    srv = _run(served, "Server")
    for res in (off, srv):
        d = Path(res["log_dir"])
        assert (d / "mlperf_log_summary.txt").is_file() and (d / "mlperf_log_detail.txt").is_file()
        assert res["sut_errors"] == []
        detail = (d / "mlperf_log_detail.txt").read_text()
        assert '"key": "requested_use_token_latencies", "value": true' in detail
        assert '"key": "result_query_count", "value": 4' in detail or res["scenario"] == "Offline"
    assert float(off["summary"]["Tokens per second"]) > 0
    summary = (Path(srv["log_dir"]) / "mlperf_log_summary.txt").read_text()
    for metric in ("Completed tokens per second", "Mean First Token latency (ns)",
                   "Mean Time per Output Token (ns)"):
        assert metric in summary
    detail = (Path(srv["log_dir"]) / "mlperf_log_detail.txt").read_text()
    assert '"key": "result_first_token_mean_latency_ns"' in detail


def test_accuracy_texts_equal_the_servers_greedy_outputs(served):
    import tritonclient.grpc as grpcclient
    from tokenizers import Tokenizer

    from harness.mlperf.accuracy import read_accuracy_log
    from harness.mlperf.samples import load_samples
    from harness.mlperf.settings import load_benchmarks

    res = _run(served, "Offline", "AccuracyOnly")
    outputs = read_accuracy_log(Path(res["log_dir"]) / "mlperf_log_accuracy.json")
    assert len(outputs) == QUERIES and all(0 < len(t) <= MAX_TOKENS for t in outputs.values())
    acc_txt = (Path(res["log_dir"]) / "accuracy.txt").read_text()
    assert acc_txt.startswith("{") and "'tokens_per_sample'" in acc_txt
    # FP8 greedy tokens depend on which requests share a batch, so the exact comparison uses a
    # one-query accuracy run: the engine then runs that prompt alone, as it does the direct request
    res = _run(served, "Offline", "AccuracyOnly", queries=1)
    outputs = read_accuracy_log(Path(res["log_dir"]) / "mlperf_log_accuracy.json")
    assert list(outputs) == [0]
    samples = load_samples(load_benchmarks().get("smollm2"), served["out"], None)
    tok = Tokenizer.from_file(str(served["out"] / "engine" / "tokenizer" / "tokenizer.json"))
    client = grpcclient.InferenceServerClient(served["url"])
    got = {}
    client.start_stream(callback=lambda result, error: got.setdefault("r", (result, error)))
    try:
        for idx in outputs:
            # one non-streaming greedy request straight to the engine model, outside the SUT
            ids = np.asarray(samples[idx].input_ids, np.int32)
            # batch dimension first, as NVIDIA's tensorrt_llm model takes them
            ins = [grpcclient.InferInput("input_ids", [1, len(ids)], "INT32"),
                   grpcclient.InferInput("request_output_len", [1, 1], "INT32"),
                   grpcclient.InferInput("temperature", [1, 1], "FP32")]
            ins[0].set_data_from_numpy(ids[None])
            ins[1].set_data_from_numpy(np.asarray([[MAX_TOKENS]], np.int32))
            ins[2].set_data_from_numpy(np.asarray([[0.0]], np.float32))
            got.clear()
            client.async_stream_infer(NAMES.engine, ins)
            import time
            deadline = time.time() + 120
            while "r" not in got and time.time() < deadline:
                time.sleep(0.05)
            result, error = got["r"]
            assert error is None, error
            # not streamed: NVIDIA's output_ids, the prompt then the generated ids
            direct = result.as_numpy("output_ids").reshape(-1).tolist()
            assert direct[:len(ids)] == ids.tolist()
            direct = direct[len(ids):]
            assert direct == outputs[idx]
            assert tok.decode(direct, skip_special_tokens=True).strip() == \
                tok.decode(outputs[idx], skip_special_tokens=True).strip()
    finally:
        client.stop_stream()
        client.close()


@pytest.mark.parametrize("scenario", ["Server", "Offline"])
def test_test06_passes(served, scenario):
    res = _run(served, scenario, compliance="TEST06")
    t = res["test06"]
    assert t["passed"], t["problems"]
    assert t["num_samples"] >= QUERIES and t["sample_length"] and t["eos"]
    assert t["first_token"] is (True if scenario == "Server" else None)
    verify = (Path(res["log_dir"]) / "verify_accuracy.txt").read_text()
    assert "TEST06 verification complete" in verify


def test_submission_tree_from_real_runs(served, tmp_path):
    for scenario in ("Offline", "Server"):
        _run(served, scenario)
        _run(served, scenario, "AccuracyOnly")
        _run(served, scenario, compliance="TEST06")
    tree = package(served["root"], tmp_path / "submission", "Kiln", "cpu_test_kiln", "v6.0")
    base = tree / "closed" / "Kiln" / "results" / "cpu_test_kiln" / "smollm2"
    for scenario in ("Offline", "Server"):
        for f in ("performance/run_1/mlperf_log_summary.txt", "performance/run_1/mlperf_log_detail.txt",
                  "accuracy/mlperf_log_accuracy.json", "accuracy/accuracy.txt", "user.conf",
                  "measurements.json", "README.md", "TEST06/verify_accuracy.txt",
                  "TEST06/accuracy/mlperf_log_accuracy.json"):
            assert (base / scenario / f).is_file(), f
    engine = json.loads((served["out"] / "engine" / "engine.json").read_text())
    expected = {"none": "bf16"}.get(engine["quantization"]["format"], engine["quantization"]["format"])
    assert json.loads((base / "Offline" / "measurements.json").read_text())["weight_data_types"] == expected
    system = json.loads((tree / "closed/Kiln/systems/cpu_test_kiln.json").read_text())
    assert system["host_processor_core_count"] and system["framework"].startswith("Kiln")
    problems, warnings = check_tree(tree, "v6.0")
    assert problems == []
    (base / "Server" / "accuracy" / "mlperf_log_detail.txt").unlink()
    shutil.rmtree(base / "Offline" / "TEST06")
    problems, _ = check_tree(tree, "v6.0")
    assert any("Server/accuracy/mlperf_log_detail.txt: missing" in p for p in problems)
    assert any("Offline/TEST06/verify_accuracy.txt: missing" in p for p in problems)
    assert len(problems) == 3
