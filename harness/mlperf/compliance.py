"""Compliance TEST06 for LLM benchmarks (MLPerf Inference compliance/nvidia/TEST06).

The test is a PerformanceOnly run with the audit settings below (LoadGen reads them from the
audit config file and logs 100 sampled responses to `mlperf_log_accuracy.json`), followed by
three checks on that log:
  * first token: outside Offline, the token reported with FirstTokenComplete equals the first
    token of the final output (a SUT must not report a cheap placeholder as its first token);
  * EOS: an output ends with at most one EOS token (padding with EOS would inflate tokens/s);
  * sample length: the `token_count` reported to LoadGen equals the output's length.
We additionally reject an EOS anywhere but the last position, since generation stops there.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from harness.mlperf.sut import OUTPUT_DTYPE

# The audit.config of compliance/TEST06 (mode 2 = PerformanceOnly).
AUDIT_SETTINGS = {
    "mode": 2,
    "accuracy_log_rng_seed": 720381539243781796,
    "accuracy_log_sampling_target": 100,
    "min_query_count": 100,
    "min_duration": 0,
    "sample_concatenate_permutation": 0,
}


def write_audit_config(path: Path, min_query_count: int | None = None) -> Path:
    """Write TEST06's audit config. `min_query_count` shrinks the run for --test-run only; a
    submission must use the official 100."""
    settings = dict(AUDIT_SETTINGS)
    if min_query_count is not None:
        settings["min_query_count"] = min_query_count
        settings["accuracy_log_sampling_target"] = min_query_count
    path = Path(path)
    path.write_text("# MLPerf TEST06 audit settings\n" + "".join(f"*.*.{k} = {v}\n" for k, v in settings.items()))
    return path


def verify_test06(accuracy_log: Path, scenario: str, eos_token_ids: tuple[int, ...]) -> dict:
    entries = json.loads(Path(accuracy_log).read_text())
    eos = set(eos_token_ids)
    first_ok, eos_ok, len_ok = True, True, True
    problems = []
    check_first = scenario != "Offline"
    if not entries:
        problems.append("accuracy log is empty: the audit config was not applied")
        eos_ok = len_ok = first_ok = False
    for e in entries:
        data = np.frombuffer(bytes.fromhex(e["data"]), dtype=OUTPUT_DTYPE)
        if e.get("token_count") != len(data):
            len_ok = False
            problems.append(f"qsl_idx {e['qsl_idx']}: token_count {e.get('token_count')} != {len(data)} tokens")
        eos_pos = [i for i, t in enumerate(data.tolist()) if t in eos]
        if len(eos_pos) > 1 or (eos_pos and eos_pos[0] != len(data) - 1):
            eos_ok = False
            problems.append(f"qsl_idx {e['qsl_idx']}: EOS at positions {eos_pos} of {len(data)}")
        if check_first:
            first = np.frombuffer(bytes.fromhex(e.get("token_data", "")), dtype=OUTPUT_DTYPE)
            if len(first) == 0 or len(data) == 0 or first[0] != data[0]:
                first_ok = False
                problems.append(f"qsl_idx {e['qsl_idx']}: first token {first.tolist()[:1]} != output {data.tolist()[:1]}")
    passed = first_ok and eos_ok and len_ok
    return {"first_token": first_ok if check_first else None, "eos": eos_ok, "sample_length": len_ok,
            "passed": passed, "num_samples": len(entries), "problems": problems}


def report_text(result: dict) -> str:
    first = "Skipped" if result["first_token"] is None else result["first_token"]
    lines = [f"First token check pass: {first}", f"EOS check pass: {result['eos']}",
             f"Sample length check pass: {result['sample_length']}",
             "TEST06 verification complete" if result["passed"] else "TEST06 verification failed"]
    lines += [f"  {p}" for p in result["problems"][:20]]
    return "\n".join(lines) + "\n"
