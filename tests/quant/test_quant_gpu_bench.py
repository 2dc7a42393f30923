"""harness.perf.quant_gpu's dry run (the same code as on the GPU, on the CPU at hidden 256): the
JSON carries the figures the committed GPU result needs, and a time limit stops it after a layer
and says so."""
from __future__ import annotations

import json

from harness.perf import quant_gpu


def _run(tmp_path, smollm2_hf_dir, *extra) -> dict:
    out = tmp_path / "r.json"
    assert quant_gpu.main(["--dry-run", "--out", str(out), "--tokenizer", str(smollm2_hf_dir),
                           "--workdir", str(tmp_path / "work"), *extra]) == 0
    assert not (tmp_path / "work").exists()  # 25 GB at 8B: removed unless --keep
    return json.loads(out.read_text())


def test_dry_run_reports_phases_and_peaks(tmp_path, smollm2_hf_dir):
    r = _run(tmp_path, smollm2_hf_dir)
    w, q = r["phases"]["write_checkpoint"], r["phases"]["quantize"]
    assert r["complete"] and q["complete"] and q["layers_done"] == r["shape"]["layers"] == 2
    assert (q["device"], q["dtype"]) == ("cpu", "float32")
    assert 0 < q["bytes"] < w["bytes"]  # fp8 layers under the bf16 source
    assert q["peak_rss_bytes"] > 0 and len(q["per_layer_s"]) == 1 and r["estimate"]["host_bytes"] > 0
    assert r["commit"] and r["date"] and "--dry-run" in r["command"]


def test_time_limit_stops_after_a_layer(tmp_path, smollm2_hf_dir):
    r = _run(tmp_path, smollm2_hf_dir, "--time-limit", "0")
    q = r["phases"]["quantize"]
    assert not r["complete"] and not q["complete"] and q["layers_done"] == 1
    assert "1/2 layers" in q["stopped"]
