"""Peak-memory estimates per build stage, printed before a stage runs and checked against what is free.

A stage module may provide ``memory_estimate(ctx) -> MemoryEstimate``; the pipeline calls it for a
stage it is about to build (never for a cached or skipped one), logs it, and raises ``StageError``
at once when the host estimate exceeds the limit: ``run_pipeline(memory_limit=...)`` / the CLI's
``--memory-limit``, else the kernel's MemAvailable. An out-of-memory kill an hour into a 70B build
is what this replaces; the estimates are deliberately simple formulas (bytes per parameter plus
activations) whose constants come from docs/perf/build-memory.json.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

GiB = 1 << 30
# RSS of a build process with torch, transformers and ModelOpt imported, before any model is read
# (measured: 0.56 GiB for import/compile, 0.86 GiB for a tiny quantize; docs/perf/build-memory.json)
RUNTIME_BASE = int(0.9 * GiB)


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    host_bytes: int
    gpu_bytes: int = 0
    detail: str = ""   # what dominates, for the log line
    advice: str = ""   # what to change when it does not fit


def gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def available_host_bytes() -> int:
    """MemAvailable (what can be allocated without swapping), else physical memory."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def checkpoint_params(hf_dir: Path) -> int:
    """Parameter count of an HF checkpoint from its safetensors headers (nothing is read)."""
    from quant.stream import Shards  # noqa: PLC0415 (reads headers only; safetensors, no torch work)

    return Shards(hf_dir).numel()


def largest_tensor(hf_dir: Path) -> int:
    """Elements of the checkpoint's largest tensor, from its safetensors headers."""
    from quant.stream import Shards  # noqa: PLC0415

    return Shards(hf_dir).largest()


def describe(stage: str, est: MemoryEstimate, limit: int, limit_source: str) -> str:
    gpu = f", GPU {gib(est.gpu_bytes)}" if est.gpu_bytes else ""
    return (f"[{stage}] estimated peak memory: host {gib(est.host_bytes)}{gpu} ({est.detail}); "
            f"{limit_source} {gib(limit)}")


def refusal(stage: str, est: MemoryEstimate, limit: int, limit_source: str) -> str | None:
    """The one-line error when the host estimate exceeds the limit, else None."""
    if est.host_bytes <= limit:
        return None
    return (f"{stage}: needs an estimated {gib(est.host_bytes)} of host memory ({est.detail}) but "
            f"{limit_source} is {gib(limit)}; allowed: {est.advice or 'a machine with more memory'}")
