"""The one result writer: what every benchmark records beside its numbers (machine, date, command,
commit, load) and where the file goes. Standard library only (torch is passed in by GPU callers).

    doc = {**header("kernels", "harness.perf.kernels.gpu_kernels", argv, torch=torch), "decode": ...}
    write_result(doc, args.out, "kernels-h100.json")   # None: build/perf/kernels-h100.json

Results land under ``build/perf/`` unless the caller names a path (``--out``/``--output``), so a run
never replaces a committed ``docs/perf/`` file by accident: publishing one is an explicit choice.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
DOCS = REPO / "docs" / "perf"
# Where results go when no path is given; KILN_PERF_OUT moves it (tests point it at a temporary folder)
DEFAULT_DIR = REPO / "build" / "perf"
# Set by `python -m harness.perf run NAME`: the command a user typed, recorded instead of the module's
COMMAND_ENV = "KILN_PERF_COMMAND"


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


def gpu_machine(torch) -> dict:
    """The GPU side of a result's ``machine``: device 0's name, SM, memory, and the stack's versions."""
    import triton  # noqa: PLC0415 - only where a GPU result is written
    props = torch.cuda.get_device_properties(0)
    return {"gpu": torch.cuda.get_device_name(), "sm": f"{props.major}{props.minor}",
            "gpu_mem_gib": round(props.total_memory / 2**30, 1), "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda}


def load() -> dict:
    """The host's load average when the run started: a busy shared machine explains a slow figure."""
    try:
        one, five, _ = os.getloadavg()
    except OSError:
        return {}
    return {"load_avg_1m": round(one, 2), "load_avg_5m": round(five, 2)}


def git_commit(dirty_paths: tuple[str, ...] = ()) -> str:
    """Short HEAD of this checkout; KILN_COMMIT when the tree was copied without its .git (a GPU host
    may receive the working tree only). ``-dirty`` is appended when one of ``dirty_paths`` (the code
    a benchmark measures) differs from HEAD, so a figure of uncommitted code is never taken for HEAD's."""
    if os.environ.get("KILN_COMMIT"):
        return os.environ["KILN_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        sha = out.stdout.strip() or "unknown"
        if dirty_paths and sha != "unknown":
            st = subprocess.run(["git", "status", "--porcelain", "--", *dirty_paths], cwd=REPO, capture_output=True,
                                text=True)
            sha += "-dirty" if st.stdout.strip() else ""
        return sha
    except OSError:
        return "unknown"


def product_path(arg: str) -> str:
    """``arg`` as a reader can reproduce it: a path inside the checkout relative to it, any other
    absolute path reduced to ``OUT/<name>`` (a temporary or host-specific folder means nothing elsewhere)."""
    if not arg.startswith("/"):
        return arg
    p = Path(arg)
    try:
        return str(p.resolve().relative_to(REPO.resolve())) or "."
    except ValueError:
        return f"OUT/{p.name}" if p.name else "OUT"


def command(module: str, argv: list[str] | None = None) -> str:
    """The command as a user types it: the suite runner's when it started this run, else
    ``python -m <module> <args>``, with every path made machine-independent (``product_path``)."""
    if os.environ.get(COMMAND_ENV):
        return os.environ[COMMAND_ENV]
    args = sys.argv[1:] if argv is None else list(argv)
    out = []
    for a in map(str, args):
        key, eq, val = a.partition("=")
        out.append(f"{key}={product_path(val)}" if eq and key.startswith("--") else product_path(a))
    return " ".join(["python", "-m", module, *(shlex.quote(a) for a in out)])


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def header(benchmark: str, module: str, argv: list[str] | None = None, *, torch=None,
           dirty_paths: tuple[str, ...] = ()) -> dict:
    """The fields every result file starts with. ``torch`` given and a GPU visible: the machine is
    the GPU's (and the host CPU's); otherwise the CPU's, with torch's version and threads if given."""
    machine = cpu_machine()
    if torch is not None:
        machine["torch"] = torch.__version__
        machine["threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            machine.update(gpu_machine(torch))
    return {"benchmark": benchmark, "date": now(), "command": command(module, argv),
            "commit": git_commit(dirty_paths),
            "machine": machine, "load": load()}


def gpu_slug(name: str | None) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``h100-80gb-hbm3``: the suffix of a GPU result's file name."""
    return (name or "cpu").lower().replace("nvidia ", "").replace(" ", "-")


def default_output(name: str) -> Path:
    """Where a result named ``name`` goes when the caller named no path."""
    return Path(os.environ.get("KILN_PERF_OUT") or DEFAULT_DIR) / name


def write_result(doc: dict, output: str | Path | None, name: str | None = None, *, indent: int = 2) -> Path | None:
    """Write a result file, its folder made if needed. ``output``: the caller's path; ``-`` writes
    nothing (the caller printed it); None writes ``default_output(name)``. Returns the path written."""
    if output is not None and str(output) == "-":
        return None
    if output is None:
        if name is None:
            raise ValueError("write_result: no output path and no default name for the result file")
        output = default_output(name)
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=indent) + "\n")
    print(f"wrote {out}")
    return out


def gpu_name(doc: dict) -> str:
    """The GPU a result was measured on, ``cpu`` where none (old files kept it at the top level)."""
    return (doc.get("machine") or {}).get("gpu") or doc.get("gpu") or "cpu"


def write_checks(doc: dict, output: str | Path | None, stem: str) -> int:
    """A GPU check's result, named ``<stem>-<gpu>.json`` by default; 0 when every entry of
    ``doc["bundles"]`` with an "ok" says so."""
    path = write_result(doc, output, f"{stem}-{gpu_slug(gpu_name(doc))}.json", indent=1)
    bad = [k for k, v in (doc.get("bundles") or {}).items() if not v.get("ok")]
    print(f"{stem}: {'all ok' if not bad else 'FAILED: ' + ', '.join(bad)}; written {path}")
    return 1 if bad else 0
