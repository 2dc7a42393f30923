"""``make bench-engine`` end to end in its ``--dry-run`` size (harness/perf/throughput/engine.py): the real
executor and Hugging Face ``generate`` in both dtypes on the real SmolLM2; what is checked is the
report's shape and arithmetic, never a speed."""
from __future__ import annotations

import json

import pytest

from harness.perf.throughput.engine import main

pytestmark = pytest.mark.slow


def test_dry_run_times_hf_in_both_dtypes_and_compares_with_the_faster(smollm2_bundle, tmp_path):
    out = tmp_path / "bench-engine.json"
    assert main(["--engine", str(smollm2_bundle), "--dry-run", "--dtype", "float32", "--output", str(out)]) == 0
    r = json.loads(out.read_text())
    runs = r["hf_generate"]
    assert sorted(runs) == ["bfloat16", "float32"]
    assert all(run["dtype"] == dt and run["output_tokens"] == 2 * 4 for dt, run in runs.items())
    best = max(runs, key=lambda dt: runs[dt]["output_tok_per_s"])
    ours = r["executor"]["output_tok_per_s"]
    assert r["hf_best_dtype"] == best and r["speedup_vs_hf"] == round(ours / runs[best]["output_tok_per_s"], 3)
    assert r["speedup_vs_hf"] == min(r["speedup_vs_hf_each"].values())
    assert r["executor"]["output_tokens"] == 2 * 4 and r["workload"]["dry_run"] is True
    assert r["executor"]["compute_dtype"]["dtype"] == "float32" == r["executor"]["compute_dtype"]["asked"]


def test_bad_hf_dtypes_are_refused(smollm2_bundle, capsys):
    with pytest.raises(SystemExit):
        main(["--engine", str(smollm2_bundle), "--hf-dtypes", "float16"])
    assert "--hf-dtypes: 'float16'; allowed" in capsys.readouterr().err


def test_serving_bench_compares_kiln_with_the_faster_hf_dtype():
    """``make bench --baseline hf``'s ratio (harness/perf/serving/sweep.py): against the faster of HF's
    bf16 and fp32 runs, and each kept."""
    from harness.perf.throughput.engine import in_each_dtype
    from harness.perf.serving.sweep import ratio_vs_hf
    hf = in_each_dtype(lambda dt: {"dtype": dt, "output_token_throughput": {"bfloat16": 300.0, "float32": 150.0}[dt]},
                       "output_token_throughput")
    assert hf["best"] == "bfloat16" and hf["best_tok_s"] == 300.0 and list(hf["runs"]) == ["bfloat16", "float32"]
    rows = [{"model": "ensemble", "mode": "concurrency", "concurrency": 1, "output_token_throughput": 50.0},
            {"model": "ensemble", "mode": "concurrency", "concurrency": 16, "output_token_throughput": 600.0}]
    r = ratio_vs_hf(rows, hf, 16)
    assert (r["hf_dtype"], r["ratio"], r["ratio_each"]) == ("bfloat16", 2.0, {"bfloat16": 2.0, "float32": 4.0})
    assert ratio_vs_hf(rows, hf, 64) is None   # no level at the baseline's batch size: no ratio
