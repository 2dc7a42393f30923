"""`python -m harness.mlperf.report`: copy a set of harness runs into a results folder.

    python -m harness.mlperf.report --runs build/smollm2-135m-fp8/mlperf --to docs/perf/mlperf

Writes `results.json` (machine, date, commit, and per run: command, scenario, mode, the LoadGen
summary's key numbers, accuracy metrics, TEST06 verdict) and copies each run's
`mlperf_log_summary.txt`, `accuracy.txt` and `verify_accuracy.txt` as `<scenario>-<mode>-<file>`.
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
from pathlib import Path

KEYS = ("Result is", "Samples per second", "Tokens per second", "Completed samples per second",
        "Completed tokens per second", "Mean First Token latency (ns)",
        "99.00 percentile first token latency (ns)", "Mean Time per Output Token (ns)",
        "99.00 percentile time to output token (ns)", "Mean latency (ns)", "target_qps")


def collect(runs_root: Path, dest: Path) -> dict:
    from harness.submission.system import describe

    runs = [json.loads(p.read_text()) for p in sorted(Path(runs_root).glob("*/*/run.json"))]
    if not runs:
        raise SystemExit(f"error: {runs_root}: no */*/run.json (run python -m harness.mlperf first)")
    dest.mkdir(parents=True, exist_ok=True)
    sysdesc = describe("Kiln", "closed", "this machine")
    out = {"machine": {k: sysdesc[k] for k in ("host_processor_model_name", "host_processor_core_count",
                                                "host_memory_capacity", "accelerator_model_name",
                                                "operating_system", "framework", "other_software_stack")},
           "python": platform.python_version(), "runs": []}
    for r in runs:
        d = Path(r["log_dir"])
        prefix = f"{r['scenario']}-{r['mode']}"
        for name in ("mlperf_log_summary.txt", "accuracy.txt", "verify_accuracy.txt"):
            if (d / name).is_file():
                shutil.copy2(d / name, dest / f"{prefix}-{name}")
        out["runs"].append({
            "benchmark": r["benchmark"], "scenario": r["scenario"], "mode": r["mode"],
            "test_run": r["test_run"], "engine": r["engine_stem"], "max_output_tokens": r.get("max_output_tokens"),
            "command": r["command"], "commit": r["commit"], "date": r["date"], "wall_s": r["wall_s"],
            "summary": {k: r["summary"][k] for k in KEYS if k in r["summary"]},
            "accuracy": r.get("accuracy"), "test06_passed": (r.get("test06") or {}).get("passed"),
        })
    (dest / "results.json").write_text(json.dumps(out, indent=1) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.mlperf.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=Path, required=True, help="a log root: <root>/<scenario>/<mode>/run.json")
    p.add_argument("--to", type=Path, required=True)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    res = collect(args.runs, args.to)
    print(f"{len(res['runs'])} run(s) -> {args.to}/results.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
