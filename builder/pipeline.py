"""Run the stage registry: skip what is up to date, build the rest atomically.

Crash safety: every stage writes into ``<dest>.tmp-<pid>``; only after ``run`` returns and its
``stage.json`` is written is the folder renamed to ``<dest>`` (the previous one is first moved to
``<dest>.old-<pid>``, so for an instant nothing is there, which never looks finished). A lock file
serializes builds into the same output folder, so whatever ``*.tmp-*``/``*.old-*`` exist when we hold
the lock are left by a dead build and are removed.
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import importlib
import json
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from backend.bundle import BundleError, rewrite
from backend.logs import get_logger
from builder import estimates, memory
from builder.config import BuildConfig
from builder.stages import STAGES, StageSpec
from builder.stages.base import StageContext, StageError, StageResult, build_time

_LOG = get_logger("builder")
STAGE_FILE = "stage.json"
# Bump when the on-disk output of the pipeline changes meaning: every cached stage rebuilds.
PIPELINE_VERSION = 1


@dataclasses.dataclass
class BuildResult:
    root: Path
    results: dict[str, StageResult]

    @property
    def bundle(self) -> Path | None:
        r = self.results.get("compile")
        return r.path if r else None


def run_pipeline(cfg: BuildConfig, output: str | Path | None = None, *, force: bool = False,
                 until: str | None = None, log: Callable[[str], None] = _LOG.info,
                 progress_factory: Callable[..., Any] | None = None,
                 stage_done: Callable[[StageResult], None] | None = None,
                 memory_limit: int | None = None) -> BuildResult:
    """Build ``cfg`` into its output folder; ``until`` stops after that stage (inclusive).
    ``memory_limit``: host bytes a stage may need (builder/memory.py); None = MemAvailable."""
    root = Path(cfg.output_dir(output)).absolute()
    _check_writable(root, cfg)
    results: dict[str, StageResult] = {}
    with _build_lock(root, log):
        _remove_stale(root, log)
        for spec in STAGES:
            result = _run_stage(spec, cfg, root, results, force, log, progress_factory, memory_limit)
            results[spec.name] = result
            if stage_done is not None:
                stage_done(result)
            if until == spec.name:
                break
        _check_gates(results)
    return BuildResult(root, results)


def _check_writable(root: Path, cfg: BuildConfig) -> None:
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise StageError(f"{root}: output folder is not writable ({e.strerror or e}); "
                         f"allowed: a writable folder (--output DIR or output.dir in {cfg.file})") from None


@contextmanager
def _build_lock(root: Path, log: Callable[[str], None]) -> Iterator[None]:
    with open(root / ".build.lock", "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another build into {root} to finish ...")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _remove_stale(root: Path, log: Callable[[str], None]) -> None:
    parents = {(root / spec.dest).parent for spec in STAGES}
    for parent in parents:
        if not parent.is_dir():
            continue
        for p in parent.iterdir():
            if ".tmp-" in p.name or ".old-" in p.name:
                log(f"removing {p} left by an interrupted build")
                _remove(p)


def _remove(p: Path) -> None:
    if p.is_symlink() or p.is_file():
        p.unlink()
    elif p.exists():
        shutil.rmtree(p)


def stage_key(spec: StageSpec, cfg: BuildConfig, results: dict[str, StageResult], fingerprint: str) -> str:
    payload = {
        "pipeline": PIPELINE_VERSION,
        "stage": spec.name,
        "sections": {s: h for s in spec.sections if (h := cfg.section_hash(s)) is not None},
        "depends": {d: results[d].key if d in results else "" for d in spec.depends},
        "fingerprint": fingerprint,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def read_stage_file(dest: Path) -> dict | None:
    try:
        return json.loads((dest / STAGE_FILE).read_text())
    except (OSError, ValueError):
        return None


def _run_stage(spec: StageSpec, cfg: BuildConfig, root: Path, results: dict[str, StageResult],
               force: bool, log: Callable[[str], None], progress_factory,
               memory_limit: int | None = None) -> StageResult:
    module = importlib.import_module(spec.module)
    dest = root / spec.dest
    ctx = StageContext(cfg, spec.name, root, dest, results, force, log, progress_factory)
    reason = module.skip_reason(ctx) if hasattr(module, "skip_reason") else None
    if reason:
        return StageResult(spec.name, "skipped", None, "", {}, reason=reason)
    fingerprint = module.fingerprint(ctx) if hasattr(module, "fingerprint") else ""
    # STAGE_VERSION: bumped when a stage's code changes what it writes
    fingerprint += f"|v{getattr(module, 'STAGE_VERSION', 0)}"
    key = stage_key(spec, cfg, results, fingerprint)
    previous = None if force else read_stage_file(dest)
    if previous is not None and previous.get("key") == key:
        result = StageResult(spec.name, "cached", dest, key, previous.get("info", {}),
                             seconds=previous.get("seconds", 0.0))
    else:
        _check_memory(spec, module, ctx, log, memory_limit)
        result = _build(spec, module, ctx, dest, key)
    if hasattr(module, "validate"):
        module.validate(ctx, result.info)
    if spec.engine_json_key:
        _record_in_engine_json(results, spec.engine_json_key, result.info)
    return result


def _time_note(name: str, ctx: StageContext) -> str:
    """The stage's time estimate for its log line. A guide only: an input it cannot read leaves the
    stage to report that input itself, so this never stops a build."""
    try:
        est = estimates.stage_time(name, ctx)
    except (OSError, ValueError, KeyError) as e:
        return f"time not estimated ({type(e).__name__})"
    return estimates.describe(est) if est is not None else "time not estimated for this stage"


def _check_memory(spec: StageSpec, module, ctx: StageContext, log: Callable[[str], None],
                  limit: int | None) -> None:
    """Print the stage's peak-memory and time estimates; refuse before any work when its memory
    cannot fit (time never refuses)."""
    time_note = _time_note(spec.name, ctx)
    if not hasattr(module, "memory_estimate"):
        log(f"[{spec.name}] estimated {time_note}")
        return
    est = module.memory_estimate(ctx)
    source = "--memory-limit" if limit is not None else "available now (MemAvailable)"
    limit = memory.available_host_bytes() if limit is None else limit
    log(f"{memory.describe(spec.name, est, limit, source)}; {time_note}")
    error = memory.refusal(spec.name, est, limit, source)
    if error:
        raise StageError(error)


def _build(spec: StageSpec, module, ctx: StageContext, dest: Path, key: str) -> StageResult:
    tmp = dest.parent / f"{dest.name}.tmp-{os.getpid()}"
    _remove(tmp)
    tmp.mkdir(parents=True)
    ctx.out_dir = tmp
    t0 = time.perf_counter()
    try:
        info = module.run(ctx) or {}
        seconds = time.perf_counter() - t0
        record = {"stage": spec.name, "key": key, "seconds": round(seconds, 3),
                  "finished": build_time().strftime("%Y-%m-%dT%H:%M:%SZ"), "info": info}
        (tmp / STAGE_FILE).write_text(json.dumps(record, indent=2, default=str) + "\n")
        _publish(tmp, dest)
    except BaseException:
        _remove(tmp)  # KeyboardInterrupt too; kill -9 leaves tmp for the next build to clean
        raise
    ctx.out_dir = dest
    return StageResult(spec.name, "built", dest, key, info, seconds=seconds)


def _publish(tmp: Path, dest: Path) -> None:
    if dest.exists() or dest.is_symlink():
        old = dest.parent / f"{dest.name}.old-{os.getpid()}"
        _remove(old)
        os.replace(dest, old)
        os.replace(tmp, dest)
        _remove(old)
    else:
        os.replace(tmp, dest)


def _record_in_engine_json(results: dict[str, StageResult], key: str, info: dict) -> None:
    """Record a stage's info under ``key`` of the bundle's engine.json (checked and rewritten atomically
    by backend.bundle, the format's owner)."""
    compiled = results.get("compile")
    if compiled is None or compiled.path is None:
        return
    try:
        rewrite(compiled.path, key, info)
    except BundleError as exc:
        raise StageError(str(exc)) from None


def _check_gates(results: dict[str, StageResult]) -> None:
    verify = results.get("verify")
    if verify is not None and verify.info.get("passed") is False:
        detail = ", ".join(f"{k}={v}" for k, v in verify.info.items() if k != "passed" and not isinstance(v, (dict, list)))
        raise StageError(f"verify: the bundle failed the accuracy gate ({detail}); the result is recorded in "
                         f"engine.json; allowed: fix the quantization settings or relax verify.min_top1_agreement"
                         f" / verify.max_mean_kl")
