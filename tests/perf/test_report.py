"""docs/perf/README.md is rendered from the result files beside it (harness/perf/report.py): every
result file has its row, and the committed page equals a fresh render."""
from __future__ import annotations

import json

from harness.perf import report
from harness.perf.lib.results import DOCS


def test_every_result_file_has_its_row():
    text = (DOCS / "README.md").read_text()
    missing = [f.relative_to(DOCS).as_posix() for f in report.result_files()
               if f"| [{f.relative_to(DOCS).as_posix()}](" not in text]
    assert not missing, f"docs/perf/README.md has no row for {missing}: run python -m harness.perf report"


def test_committed_readme_is_a_fresh_render():
    assert report.main(check=True) == 0, "docs/perf/README.md is stale: run python -m harness.perf report"


def test_a_new_or_changed_result_file_makes_the_page_stale(tmp_path, capsys):
    doc = {"benchmark": "gpu-bench", "date": "2026-12-01T10:00:00+00:00", "commit": "abc1234",
           "command": "python -m harness.perf run bench-gpu --note the second try --output /home/someone/out/gpu-bench.json",
           "machine": {"cpu": "Some CPU", "cores": 8, "gpu": "NVIDIA H100 80GB HBM3"},
           "single_stream_cuda_graphs": {"decode_ms_per_token": 4.1}, "throughput": {"output_tok_s": 11844.0}}
    (tmp_path / "gpu-bench-h100.json").write_text(json.dumps(doc))
    assert report.main(check=True, docs=tmp_path) == 1
    assert report.main(docs=tmp_path) == 0 and report.main(check=True, docs=tmp_path) == 0
    page = (tmp_path / "README.md").read_text()
    row = next(ln for ln in page.splitlines() if ln.startswith("| [gpu-bench-h100.json]"))
    assert "NVIDIA H100 80GB HBM3 | 2026-12-01 |" in row and "abc1234" in row
    assert "single stream 4.10 ms/token, 11,844 output tok/s" in row
    assert "/home/someone" not in row and "--output OUT/gpu-bench.json" in row   # no machine paths
    assert "second try" not in row                                              # notes stay in the file
    doc["throughput"]["output_tok_s"] = 11298.0            # an edited figure: the page no longer agrees
    (tmp_path / "gpu-bench-h100.json").write_text(json.dumps(doc))
    assert report.main(check=True, docs=tmp_path) == 1
    capsys.readouterr()
