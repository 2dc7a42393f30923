"""Running rows of the suite table: one suite (``run``), or the GPU host's ordered parts (``gpu_host``).

A GPU host is reached with no venv and no network and for a bounded time, so its run is one call
that shares a budget (T_TOTAL seconds) between steps: each step runs under its own limit cut to what
is left, and is skipped (said so) when less than MIN_PART_S is left, so one slow or hung step cannot
take the others' time. Every knob is an environment variable, as a GPU host's one command line can
set them: PARTS, T_TOTAL, MIN_PART_S, T_<STEP> (``Step.limit_env``), the steps' argument variables
(``Step.args_env``), SWEEP_APPLY, NCU_CASE, NCU_CFGS.
"""
from __future__ import annotations

import importlib.util
import re
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from harness.perf.lib.results import COMMAND_ENV, REPO, product_path
from harness.perf.suites import BY_NAME, DEFAULT_PARTS, GPU_HOST, MIN_STEP_S, TOTAL_S, Step, Suite


def suite_argv(suite: Suite, extra: list[str], output: str | Path | None, python: str = sys.executable) -> list[str]:
    """The command that runs ``suite`` with ``extra`` arguments, its result written to ``output``
    (None: wherever the suite writes by default, under build/perf/)."""
    argv = ["bash", *suite.entry] if suite.script else [python, *suite.entry]
    argv += extra
    if output is not None:
        if suite.out_flag is None:
            raise SystemExit(f"suite {suite.name} takes no result path (--output): it writes "
                             + ("nothing of its own" if suite.output is None else suite.output))
        argv += [suite.out_flag, str(output)]
    return argv


def check_entry(suite: Suite) -> str | None:
    """Why ``suite`` cannot start here (its module or script is missing), None when it can."""
    if suite.script:
        return None if (REPO / suite.entry[0]).is_file() else f"{suite.entry[0]}: no such script"
    module = suite.entry[1]
    try:
        found = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        found = None
    return None if found is not None else f"{module}: no such module"


def user_command(words: list[str], python: str = sys.executable) -> str:
    """A command line as recorded in result files: the interpreter as ``python``, machine paths
    replaced (results.product_path)."""
    return " ".join("python" if w == python else shlex.quote(product_path(w)) for w in words)


def run(name: str, extra: list[str], *, output: str | None = None, dry_run: bool = False,
        limit_s: float | None = None) -> int:
    suite = BY_NAME.get(name)
    if suite is None:
        raise SystemExit(f"unknown suite {name!r}; known: {', '.join(BY_NAME)} (python -m harness.perf list)")
    argv = suite_argv(suite, extra, output)
    problem = check_entry(suite)
    where = output or (f"build/perf/{suite.output}" if suite.output else "as the suite names it, under build/perf/")
    if dry_run:
        print(f"{suite.name} ({suite.group}, {suite.device}, budget {suite.budget_s} s): "
              f"{user_command(argv)}")
        print(f"  result: {where}" + (f"; env {suite.env}" if suite.env else ""))
        if problem:
            print(f"  cannot run: {problem}", file=sys.stderr)
        return 2 if problem else 0
    if problem:
        print(f"harness.perf run {name}: {problem}", file=sys.stderr)
        return 2
    env = dict(os.environ, **suite.env)
    env[COMMAND_ENV] = user_command(["python", "-m", "harness.perf", "run", name]
                                    + (["--output", output] if output else []) + (["--", *extra] if extra else []))
    try:
        return subprocess.run(argv, cwd=REPO, env=env, timeout=limit_s).returncode
    except subprocess.TimeoutExpired:
        print(f"harness.perf run {name}: stopped at its limit of {limit_s:.0f} s", file=sys.stderr)
        return 124


# -- the GPU host -----------------------------------------------------------------------------------

def _step_args(step: Step, parts: list[str], env: dict, limit: int) -> list[str]:
    args = list(step.args)
    if step.args_env and env.get(step.args_env):
        args += shlex.split(env[step.args_env])
    else:
        args += step.default_args
        if step.after_part and step.after_part[0] in parts:
            args += step.after_part[1]
    if step.budget_flag:
        args += [step.budget_flag, str(limit - 5)]
    for var in step.time_limit_env:
        if env.get(var):
            args += ["--time-limit", env[var]]
            break
    return args


def _ncu_argv(argv: list[str], env: dict) -> list[str]:
    """Nsight Compute around the decode launch: one profiled launch per NCU_CFGS entry (';'-separated
    JSON tuning values), DRAM throughput, occupancy, warp stalls."""
    ncu = shutil.which("ncu") or next(iter(sorted(Path("/opt/nvidia/nsight-compute").glob("*/ncu"))), "ncu")
    cfgs = (env.get("NCU_CFGS") or "{}").split(";")
    case = env.get("NCU_CASE") or "fp8-b512-ctx1536"
    argv = [a for a in argv]
    i = argv.index("--case")
    argv[i + 1] = case
    sections = [x for s in ("SpeedOfLight", "Occupancy", "WarpStateStats", "MemoryWorkloadAnalysis")
                for x in ("--section", s)]
    return [str(ncu), "-k", "regex:paged_decode_kernel", "--launch-skip", "3", "--launch-count", str(len(cfgs)),
            *sections, *argv, *[x for c in cfgs for x in ("--cfg", c)]]


def _dtests_passed(log: Path) -> bool:
    text = log.read_text(errors="replace") if log.is_file() else ""
    return " passed" in text and not re.search(r"[0-9]+ (failed|error)", text)


def gpu_host(out: Path, env: dict | None = None, *, dry_run: bool = False) -> int:
    """Every part of ``GPU_HOST`` named in PARTS (default ``DEFAULT_PARTS``), results and logs into ``out``."""
    env = dict(os.environ if env is None else env)
    parts = (env.get("PARTS") or " ".join(DEFAULT_PARTS)).split()
    known = [p for p, _ in GPU_HOST]
    unknown = [p for p in parts if p not in known]
    if unknown:
        print(f"gpu-host: PARTS names unknown parts {unknown}; allowed: {', '.join(known)}", file=sys.stderr)
        return 2
    total, min_s = int(env.get("T_TOTAL") or TOTAL_S), int(env.get("MIN_PART_S") or MIN_STEP_S)
    python = env.get("PYTHON") or sys.executable
    out.mkdir(parents=True, exist_ok=True)
    env["PYTHONUNBUFFERED"] = "1"
    start = time.monotonic()
    planned = 0          # a dry run spends no time: each step is counted at its limit, to show what fits
    dtests_ok = True
    for part, steps in GPU_HOST:
        if part not in parts:
            continue
        for step in steps:
            suite = BY_NAME[step.suite]
            label = Path(step.log).stem
            used = int(time.monotonic() - start) + planned
            limit = min(int(env.get(step.limit_env) or step.limit_s), total - used)
            args = _step_args(step, parts, env, limit)
            argv = suite_argv(suite, args, out / suite.output if suite.output else None, python)
            if suite.name == "ncu":
                argv = _ncu_argv(argv, env)
            if limit < min_s:
                print(f"{label} skipped: {limit}s left for it (MIN_PART_S {min_s}; T_TOTAL={total}s, {used}s used)")
                continue
            if dry_run:
                print(f"{label}: limit {limit}s, log {step.log}: {user_command(argv, python)}")
                planned += limit
                continue
            t0 = time.monotonic()
            step_env = dict(env, **suite.env)
            step_env[COMMAND_ENV] = user_command(argv, python)
            log = out / step.log
            with log.open("w") as fh:
                try:
                    rc = subprocess.run(argv, cwd=REPO, env=step_env, stdout=fh, stderr=subprocess.STDOUT,
                                        timeout=limit).returncode
                except subprocess.TimeoutExpired:
                    rc = 124
                except OSError as exc:   # e.g. no ncu on this host
                    fh.write(f"{exc}\n")
                    rc = 127
            print(f"{label} rc={rc} limit={limit}s took={int(time.monotonic() - t0)}s", flush=True)
            if step.show_last_line and log.is_file():
                lines = log.read_text(errors="replace").splitlines()
                print(lines[-1] if lines else "")
            if suite.name == "dtests":
                dtests_ok = _dtests_passed(log)
                lines = log.read_text(errors="replace").splitlines()
                print(lines[-1] if lines else "")
            if suite.name == "sweep" and env.get("SWEEP_APPLY"):
                env.update(_apply_sweep(out / suite.output, env["SWEEP_APPLY"], dtests_ok, python))
    print(f"gpu-host: {int(time.monotonic() - start)}s of T_TOTAL={total}s")
    return 0


def _apply_sweep(result: Path, apply: str, dtests_ok: bool, python: str) -> dict:
    """SWEEP_APPLY=<kernel>/<variant>: the later steps of this call run that entry's winner
    (KILN_TUNING), unless the decode tests failed on this GPU."""
    if not dtests_ok:
        print("sweep winner NOT applied: the decode tests failed on this GPU (dtests.log)")
        return {}
    proc = subprocess.run([python, "-m", "harness.perf.kernels.sweep", str(result), apply], cwd=REPO,
                          capture_output=True, text=True)
    tuning = proc.stdout.strip() if proc.returncode == 0 else ""
    print(f"sweep winner of {apply}: KILN_TUNING={tuning or 'unset (no winner)'}")
    return {"KILN_TUNING": tuning} if tuning else {}
