"""Facts every benchmark records beside its numbers (docs/perf/ rule: machine, date, command,
commit), in one place so the result files stay comparable. Standard library only."""
from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (Linux), else whatever platform reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# The CPU features that decide Kiln's CPU paths and HF's speed in bf16 (backend/runtime/cpu_dtype.py,
# plugins/cpu): recorded with every CPU result, present or not.
SIMD_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16", "avx_vnni")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, bool]:
    """Which of ``SIMD_FLAGS`` ``cpuinfo`` lists (all False where it cannot be read)."""
    try:
        line = next((ln for ln in cpuinfo.read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        line = ""
    have = set(line.split(":", 1)[-1].split())
    return {flag: flag in have for flag in SIMD_FLAGS}


def cpu_machine() -> dict:
    """The CPU side of a result's ``machine``: model, its SIMD flags, cores this process may use, Python."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0
    return {"cpu": cpu_model(), "cpu_flags": cpu_flags(), "cores": cores, "python": platform.python_version()}


def git_commit() -> str:
    """Short HEAD of this checkout; KILN_COMMIT when the tree was copied without its .git (a lent GPU
    machine receives the working tree only)."""
    if os.environ.get("KILN_COMMIT"):
        return os.environ["KILN_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def write_result(doc: dict, output: str | Path) -> None:
    """Write a result file (``-``: nowhere, the caller printed it), its folder made if needed."""
    if str(output) == "-":
        return
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")
