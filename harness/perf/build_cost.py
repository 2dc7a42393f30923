"""What building an engine costs: a full build's seconds per stage (``time``) and each stage's peak
host memory on random-weight Llamas of two depths (``memory``).

    python -m harness.perf.build_cost time [CONFIG] [--output DIR] [--json F] [--cold]
    python -m harness.perf.build_cost memory [--layers 12 24] [--hidden 2048] [--num-samples 8] [--json F]

``time`` runs ``python -m builder build CONFIG --output DIR --force`` in a subprocess (wall time
includes interpreter start-up, as ``make build`` does), then reads each stage's ``stage.json``.
``--cold`` deletes DIR first. The JSON records the machine, its load average (the development
machines are shared: times under load are not comparable with an idle machine), date, command and
commit.

``memory`` writes random-weight Llama checkpoints (`harness/perf/lib/models.py`: hidden 2048, SmolLM2's
tokenizer, sharded, never whole in memory) under --workdir, then builds each through the stages
named by --stages, one `python -m builder build ... --until STAGE` subprocess per stage (the
earlier stages are cached, so each process does one stage's work), and reads the process's peak RSS
from `wait4` (it covers the subprocess and the children it waited for). The goal:
the deepest model's peak <= 1.2x the shallowest's and below the deepest checkpoint's bf16 size.
Peak RSS does not depend on timing, so a loaded machine changes the seconds, not the bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from harness.perf.lib.results import header, product_path, write_result

MODULE = "harness.perf.build_cost"
BASE_CONFIG = "configs/smollm2-135m-fp8.yaml"
# the code a build runs: "-dirty" in the recorded commit means one of these differs from HEAD
BUILD_CODE = ("builder", "quant", "plugins", "backend")


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def build_time(argv: list[str], full_argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE} time", description="Time a full build, every stage rebuilt.")
    p.add_argument("config", nargs="?", default="configs/smollm2-135m-fp8.yaml")
    p.add_argument("--output", default=None, help="build folder (default build/perf/build-<config stem>)")
    p.add_argument("--json", "--out", dest="json", default=None, help="result JSON (default build/perf/build-time.json)")
    p.add_argument("--cold", action="store_true", help="delete the build folder first")
    args = p.parse_args(argv)
    from backend import bundle
    from builder.stages import STAGES
    out = Path(args.output or f"build/perf/build-{Path(args.config).stem}")
    if args.cold and out.exists():
        shutil.rmtree(out)
    cmd = [sys.executable, "-m", "builder", "build", args.config, "--output", str(out), "--force"]
    head = header("build-time", MODULE, full_argv, dirty_paths=BUILD_CODE)
    load_before = load_average()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    load_after = load_average()
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
        "load_average_before": load_before,
        "load_average_after": load_after,
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


def _measure(cmd: list[str]) -> dict:
    """Run `cmd` and return its exit code, peak RSS (wait4's ru_maxrss, kB on Linux) and seconds."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    chunks = []
    assert proc.stdout is not None
    for line in proc.stdout:  # drain the pipe so the child never blocks on a full buffer
        chunks.append(line)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    text = b"".join(chunks).decode(errors="replace")
    return {"exit_code": proc.returncode, "peak_rss_bytes": usage.ru_maxrss * 1024,
            "seconds": round(time.perf_counter() - t0, 1), "log_tail": text.strip().splitlines()[-3:]}


def _tokenizer_dir(workdir: Path) -> Path:
    """SmolLM2's import (config + tokenizer), built by the builder's own import stage."""
    out = workdir / "smollm2"
    cmd = [sys.executable, "-m", "builder", "build", "configs/smollm2-135m-bf16.yaml", "--until", "import",
           "--output", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return out / "work" / "import"


def build_memory(argv: list[str], full_argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE} memory", description="Peak host memory (RSS) of each build stage.")
    p.add_argument("--layers", type=int, nargs="+", default=[12, 24])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--num-samples", type=int, default=8, help="calibration prompts")
    p.add_argument("--max-seq-len", type=int, default=256, help="calibration tokens per prompt")
    p.add_argument("--stages", nargs="+", default=["import", "quantize", "compile"])
    p.add_argument("--workdir", default="build/perf/build-memory")
    p.add_argument("--json", "--out", dest="json", default=None, help="result JSON (default build/perf/build-memory.json)")
    args = p.parse_args(argv)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer_dir(workdir)
    head = header("build-memory", MODULE, full_argv, dirty_paths=BUILD_CODE)
    head["machine"]["ram_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    load_before = load_average()
    models = {}
    for n in args.layers:
        ckpt = workdir / f"llama-h{args.hidden}-l{n}"
        if not (ckpt / "model.safetensors.index.json").is_file():
            shutil.rmtree(ckpt, ignore_errors=True)
            # In a subprocess: Linux keeps a process's peak RSS across fork and exec, so every build
            # started by a parent that once held a GB shard would report at least that GB
            code = ("import sys; from harness.perf.lib.models import write_random_llama; "
                    "write_random_llama(sys.argv[1], sys.argv[2], hidden=int(sys.argv[3]), layers=int(sys.argv[4]), "
                    "intermediate=int(sys.argv[5]))")
            subprocess.run([sys.executable, "-c", code, str(ckpt), str(tok), str(args.hidden), str(n),
                            str(args.intermediate)], check=True)
        ckpt_bytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
        out = workdir / f"build-l{n}"
        shutil.rmtree(out, ignore_errors=True)
        overrides = [f"model.source={ckpt.resolve()}", f"quantization.calibration.num_samples={args.num_samples}",
                     f"quantization.calibration.max_seq_len={args.max_seq_len}",
                     f"verify.enabled={'true' if 'verify' in args.stages else 'false'}"]
        stages = {}
        for stage in args.stages:
            cmd = [sys.executable, "-m", "builder", "build", BASE_CONFIG, *overrides, "--output", str(out),
                   "--until", stage]
            stages[stage] = r = _measure(cmd)
            print(f"layers={n} {stage}: peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB, {r['seconds']} s, "
                  f"exit {r['exit_code']}", flush=True)
            if r["exit_code"] != 0:
                print("\n".join(r["log_tail"]), file=sys.stderr)
                break
        qinfo = out / "work" / "quantize" / "kiln_quant.json"
        models[str(n)] = {
            "layers": n, "hidden": args.hidden, "intermediate": args.intermediate,
            "checkpoint_bf16_bytes": ckpt_bytes,
            "quantize_path": json.loads(qinfo.read_text()).get("path") if qinfo.is_file() else None,
            "stages": stages,
            "peak_rss_bytes": max(s["peak_rss_bytes"] for s in stages.values()),
        }
        shutil.rmtree(out, ignore_errors=True)  # GBs of engine per depth
    lo, hi = models[str(min(args.layers))], models[str(max(args.layers))]
    result = {
        **head,
        "what": "peak RSS per build stage, random-weight Llama (SmolLM2 tokenizer), fp8 weights + fp8 KV",
        "build_command": f"python -m builder build {BASE_CONFIG} model.source=<checkpoint> "
                         f"quantization.calibration.num_samples={args.num_samples} "
                         f"quantization.calibration.max_seq_len={args.max_seq_len} --until <stage>",
        "load_average_before": load_before,
        "load_average_after": load_average(),
        # the floor of every figure: a child's peak RSS starts from its parent's at fork
        "parent_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "models": models,
        "done_when": {
            "deep_over_shallow_peak": round(hi["peak_rss_bytes"] / lo["peak_rss_bytes"], 3),
            "deep_peak_over_deep_checkpoint": round(hi["peak_rss_bytes"] / hi["checkpoint_bf16_bytes"], 3),
            "target": "deep/shallow <= 1.2 and deep peak < deep checkpoint's bf16 bytes",
        },
        "note": "peak RSS is not timing-sensitive; seconds are, and the machine is shared (see load average)",
    }
    result["done_when"]["met"] = (result["done_when"]["deep_over_shallow_peak"] <= 1.2
                                  and result["done_when"]["deep_peak_over_deep_checkpoint"] < 1.0)
    write_result(result, args.json, "build-memory.json")
    print(json.dumps(result["done_when"]))
    return 0 if all(s["exit_code"] == 0 for m in models.values() for s in m["stages"].values()) else 1

COMMANDS = {"time": build_time, "memory": build_memory}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] not in COMMANDS:
        print(f"usage: python -m {MODULE} {{{','.join(COMMANDS)}}} [ARGS]", file=sys.stderr)
        return 2
    return COMMANDS[args[0]](args[1:], argv)


if __name__ == "__main__":
    sys.exit(main())
