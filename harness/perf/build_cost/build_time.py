"""Measure a full build (every stage rebuilt) the way a user runs it, and record per-stage times.

    python -m harness.perf.build_cost.build_time [CONFIG] [--output DIR] [--json F] [--cold]

Runs ``python -m builder build CONFIG --output DIR --force`` in a subprocess (wall time includes
interpreter start-up, as ``make build`` does), then reads each stage's ``stage.json``. ``--cold``
deletes DIR first. The JSON records the machine, its load average (the development machines are
shared: times under load are not comparable with an idle machine), date, command and commit.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from backend import bundle
from builder.stages import STAGES
from harness.perf.lib.results import header, product_path, write_result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.perf.build_cost.build_time", description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", default="configs/smollm2-135m-fp8.yaml")
    p.add_argument("--output", default=None, help="build folder (default build/perf/build-<config stem>)")
    p.add_argument("--json", "--out", dest="json", default=None, help="result JSON (default build/perf/build-time.json)")
    p.add_argument("--cold", action="store_true", help="delete the build folder first")
    args = p.parse_args(argv)
    out = Path(args.output or f"build/perf/build-{Path(args.config).stem}")
    if args.cold and out.exists():
        shutil.rmtree(out)
    cmd = [sys.executable, "-m", "builder", "build", args.config, "--output", str(out), "--force"]
    head = header("build-time", "harness.perf.build_cost.build_time", argv,
                  dirty_paths=("builder", "quant", "plugins", "backend"))
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    load_after = os.getloadavg()
    error = proc.stderr.strip().splitlines()[-1] if proc.returncode != 0 and proc.stderr.strip() else None
    if proc.returncode != 0 and not (out / "engine" / bundle.MANIFEST).is_file():
        sys.stderr.write(proc.stderr[-2000:])
        return proc.returncode
    stages = {}
    for spec in STAGES:
        f = out / spec.dest / "stage.json"
        stages[spec.name] = json.loads(f.read_text())["seconds"] if f.is_file() else None
    engine = bundle.read(out / "engine")
    result = {
        **head,
        "what": f"full build of {args.config}, every stage rebuilt (--force)",
        "build_command": " ".join(["python"] + [product_path(c) for c in cmd[1:]]),
        "equivalent": f"make build CONFIG={args.config} OUT={product_path(str(out))} BUILD_ARGS=--force",
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
        "tools": engine.tools,
        "wall_seconds": round(wall, 2),
        "exit_code": proc.returncode,
        "error": error,  # e.g. the verify gate failing after every stage ran
        "stage_seconds": stages,
        "target_seconds": 180,
        "bundle": {"format": engine["quantization"]["format"], "kv_cache": engine["engine"]["kv_cache_dtype"],
                   "files": len(engine["files"]), "kernels": len(engine["kernels"]),
                   "verify": engine.get("verify")},
        "note": "wall-clock on a machine that may run other work: compare only runs with similar load",
    }
    write_result(result, args.json, "build-time.json")
    print(json.dumps({"wall_seconds": result["wall_seconds"], "stage_seconds": stages,
                      "load": result["load_average_after"], "error": error}))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
