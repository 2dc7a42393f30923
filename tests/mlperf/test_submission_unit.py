"""Submission pieces that need no server: truncation rule, system JSON, argument errors."""
import hashlib

import pytest

from harness.submission.__main__ import main
from harness.submission.layout import LAYOUTS, REQUIRED_SYSTEM_FIELDS
from harness.submission.package import (MAX_ACCURACY_LOG_SIZE, SubmissionError, package,
                                        truncate_accuracy_log)
from harness.submission.system import describe


def test_truncation_keeps_both_ends_and_records_the_hash(tmp_path):
    src, dst, acc = tmp_path / "log.json", tmp_path / "out.json", tmp_path / "accuracy.txt"
    text = "[\n" + "".join(f'{{ "seq_id" : {i}, "qsl_idx" : {i}, "data" : "{i:08X}" }},\n' for i in range(2000)) + "]\n"
    src.write_text(text)
    acc.write_text("{'rouge1': 1.0}\n")
    truncate_accuracy_log(src, dst, acc)
    out = dst.read_text()
    assert len(text) > MAX_ACCURACY_LOG_SIZE and out == text[:4096] + "\n\n...\n\n" + text[-4096:]
    assert acc.read_text().splitlines()[-1] == "hash=" + hashlib.sha256(text.encode()).hexdigest()
    small = tmp_path / "small.json"
    small.write_text("[]\n")
    truncate_accuracy_log(small, tmp_path / "small_out.json", None)
    assert (tmp_path / "small_out.json").read_text() == "[]\n"


def test_system_description_is_filled_from_this_machine():
    d = describe("Kiln", "closed", "box")
    assert all(d[f] not in (None, "") for f in REQUIRED_SYSTEM_FIELDS)
    assert int(d["host_processor_core_count"]) >= 1 and d["host_memory_capacity"].endswith("GiB")
    assert "LoadGen 6.0.17" in d["other_software_stack"]


def test_errors(tmp_path, capsys):
    with pytest.raises(SubmissionError, match="no harness runs found"):
        package(tmp_path, tmp_path / "out", "Kiln", "box", "v6.0")
    with pytest.raises(SubmissionError, match="allowed: v5.1, v6.0"):
        package(tmp_path, tmp_path / "out", "Kiln", "box", "v4.0")
    assert main(["--build-root", str(tmp_path), "--output", str(tmp_path / "o")]) == 2
    assert "no harness runs found" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # nothing half-written


def test_both_layouts_are_complete():
    for layout in LAYOUTS.values():
        assert layout.perf_dir.endswith("performance/run_1") and "{org}" in layout.systems_dir
    assert LAYOUTS["v6.0"].measurements_file.endswith("/measurements.json")
    assert LAYOUTS["v5.1"].compliance_dir.startswith("closed/{org}/compliance/")
