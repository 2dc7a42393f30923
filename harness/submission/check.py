"""Structural self-check of a submission tree: lists every missing or malformed piece.

This mirrors the structure part of MLPerf's submission checker for the chosen round (files that
must exist, non-empty system and measurement fields, truncated accuracy logs with their hash,
TEST06 present and passing for LLM benchmarks). It does not re-judge performance validity;
INVALID LoadGen results (every --test-run is one) are reported as warnings.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from harness.submission.layout import (ACC_FILES, LAYOUTS, MEASUREMENT_FIELDS, PERF_FILES,
                                       REQUIRED_SYSTEM_FIELDS, TEST06_FILES)
from harness.submission.package import IMPL, MAX_ACCURACY_LOG_SIZE, VIEWABLE_SIZE


def _dirs(p: Path) -> list[str]:
    return sorted(d.name for d in p.iterdir() if d.is_dir()) if p.is_dir() else []


def check_tree(root: Path, round_: str = "v6.0") -> tuple[list[str], list[str]]:
    """Return (problems, warnings); an empty problem list means the tree is complete."""
    layout = LAYOUTS[round_]
    root = Path(root)
    problems: list[str] = []
    warnings: list[str] = []
    orgs = _dirs(root / "closed")
    if not orgs:
        return [f"{root}/closed: no organization folder"], warnings
    for org in orgs:
        results = root / "closed" / org / "results"
        systems = _dirs(results)
        if not systems:
            problems.append(f"{results}: no system folders")
        for sysname in systems:
            kw = {"org": org, "system": sysname, "impl": IMPL}
            sys_json = root / layout.fmt(layout.systems_dir, **kw) / f"{sysname}.json"
            if not sys_json.is_file():
                problems.append(f"{sys_json}: missing system description")
            else:
                desc = json.loads(sys_json.read_text())
                for f in REQUIRED_SYSTEM_FIELDS:
                    if desc.get(f) in (None, ""):
                        problems.append(f"{sys_json}: field {f!r} missing or empty")
            for bench in _dirs(results / sysname):
                for scenario in _dirs(results / sysname / bench):
                    p = dict(kw, benchmark=bench, scenario=scenario)
                    _check_result(root, layout, p, problems, warnings)
    return problems, warnings


def _check_result(root: Path, layout, p: dict, problems: list[str], warnings: list[str]) -> None:
    perf = root / layout.fmt(layout.perf_dir, **p)
    acc = root / layout.fmt(layout.acc_dir, **p)
    for d, names in ((perf, PERF_FILES), (acc, ACC_FILES)):
        for n in names:
            if not (d / n).is_file() or (d / n).stat().st_size == 0:
                problems.append(f"{d / n}: missing or empty")
    summary = perf / "mlperf_log_summary.txt"
    if summary.is_file() and "Result is : VALID" not in summary.read_text():
        warnings.append(f"{summary}: LoadGen result is not VALID")
    acc_txt, acc_log = acc / "accuracy.txt", acc / "mlperf_log_accuracy.json"
    if acc_txt.is_file():
        text = acc_txt.read_text()
        if not re.search(r"^hash=[0-9a-f]{64}$", text, re.M):
            problems.append(f"{acc_txt}: no hash= line (accuracy log not processed by the truncation step)")
        for m in re.finditer(r"^accuracy level (\S+): FAIL(.*)$", text, re.M):
            warnings.append(f"{acc_txt}: accuracy level {m.group(1)} not met{m.group(2)}")
    if acc_log.is_file() and acc_log.stat().st_size > MAX_ACCURACY_LOG_SIZE + 16 and \
            acc_log.stat().st_size > 2 * VIEWABLE_SIZE + 16:
        problems.append(f"{acc_log}: not truncated ({acc_log.stat().st_size} bytes)")
    sdir = root / layout.fmt(layout.scenario_dir, **p)
    for n in ("user.conf", "README.md", *layout.extra_scenario_files):
        if not (sdir / n).is_file():
            problems.append(f"{sdir / n}: missing")
    mfile = root / layout.fmt(layout.measurements_file, **p)
    if not mfile.is_file():
        problems.append(f"{mfile}: missing measurements description")
    else:
        m = json.loads(mfile.read_text())
        problems += [f"{mfile}: field {f!r} missing or empty" for f in MEASUREMENT_FIELDS if not m.get(f)]
    t06 = root / layout.fmt(layout.compliance_dir, **p) / "TEST06"
    for n in TEST06_FILES:
        if not (t06 / n).is_file():
            problems.append(f"{t06 / n}: missing (TEST06 is required for LLM benchmarks)")
    verify = t06 / "verify_accuracy.txt"
    if verify.is_file() and "TEST06 verification complete" not in verify.read_text():
        problems.append(f"{verify}: TEST06 did not pass")
    src = root / layout.fmt(layout.src_dir, **p)
    if not src.is_dir() or not any(src.iterdir()):
        problems.append(f"{src}: missing source code reference")
