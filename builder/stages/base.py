"""The interface every build stage implements.

A stage is a module in ``builder/stages/`` listed once in the registry ``builder/stages/__init__.py``
(``STAGES``: name, module, destination folder, the config sections and earlier stages it depends on).
The module provides::

    def run(ctx: StageContext) -> dict:
        '''Write every output file under ctx.out_dir and return JSON-able info about them.'''

and may provide::

    def skip_reason(ctx: StageContext) -> str | None:
        '''Why this stage has nothing to do for this config (e.g. speculative.method is none).'''

    def fingerprint(ctx: StageContext) -> str:
        '''A cheap string that changes when inputs outside the build change (e.g. source files'
        size and mtime); folded into the stage key.'''

    def validate(ctx: StageContext, info: dict) -> None:
        '''Checks to run whether the stage ran or was cached (e.g. config vs model shape).'''

    def memory_estimate(ctx: StageContext) -> builder.memory.MemoryEstimate:
        '''Peak host (and GPU) bytes run() will need, from config and checkpoint headers only:
        printed before run(), which is refused at once when it exceeds the memory limit.'''

    STAGE_VERSION = 1   # bump when the stage's code changes what it writes: cached outputs rebuild

Rules the pipeline (``builder/pipeline.py``) enforces so that stages stay simple:

* ``ctx.out_dir`` is a fresh temporary folder (``<dest>.tmp-<pid>``). When ``run`` returns, the
  pipeline writes ``stage.json`` (stage key, info, timing) into it and renames it into place; if
  ``run`` raises or the process dies, nothing at ``<dest>`` looks finished. A stage must never
  write outside ``ctx.out_dir``.
* The stage key is the sha256 of the stage name, the hashes of its config sections, the keys of the
  stages it depends on and its ``fingerprint``. A destination whose ``stage.json`` has the same key
  is reused without calling ``run`` (``--force`` rebuilds everything).
* Earlier results are in ``ctx.results`` by stage name (:class:`StageResult`: ``path`` to the
  stage's folder, or None when the stage was skipped; ``info`` as returned by ``run``).
  ``ctx.checkpoint_dir()`` is the HF checkpoint to build from: the quantize output when it exists,
  else the import output.
* User mistakes raise ``ConfigError`` (config problems) or ``StageError`` (anything else): one line
  naming the file/key and what is allowed. Bugs may raise anything.
* Long work reports progress with ``with ctx.progress("what", total) as advance: advance(1)`` and
  notes with ``ctx.log("...")``.

Stage-specific contracts:

* draft: write the bundle's ``draft/`` content (``weights.safetensors``, ``config.json``) at the top
  of ``ctx.out_dir``; compile copies every file except ``stage.json`` into ``engine/draft/`` and puts
  ``info["speculative"]`` (if returned) into engine.json's ``speculative``.
* verify: read the bundle at ``ctx.results["compile"].path``; the returned info goes into
  engine.json's ``verify`` (the pipeline rewrites engine.json atomically; engine.json is not in
  ``files``). Return ``{"passed": False, ...}`` to fail the build after recording the result.
* package: write the Triton model repository into ``ctx.out_dir`` (it becomes
  ``<output>/model_repository``); the bundle is ``ctx.results["compile"].path``.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from backend.logs import get_logger
from builder.config import BuildConfig


class StageError(RuntimeError):
    """A build failure caused by the user's input (missing checkpoint, bad file...): one line."""


def build_time() -> datetime.datetime:
    """The time a build records (engine.json's ``created``, each stage's ``finished``): now, or
    ``SOURCE_DATE_EPOCH`` (seconds since 1970, the reproducible-builds convention) when set, so two
    builds of one config and checkpoint are the same bytes apart from the stages' measured durations."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH", "").strip()
    if not epoch:
        return datetime.datetime.now(datetime.timezone.utc)
    try:
        return datetime.datetime.fromtimestamp(int(epoch), datetime.timezone.utc)
    except (ValueError, OverflowError, OSError):
        raise StageError(f"SOURCE_DATE_EPOCH={epoch!r}: not a whole number of seconds since 1970-01-01 UTC; "
                         f"unset it to record the build's own time") from None


@dataclasses.dataclass
class StageResult:
    name: str
    status: str                 # built | cached | skipped
    path: Path | None           # the stage's output folder (None when skipped)
    key: str                    # stage key ("" when skipped)
    info: dict[str, Any]
    seconds: float = 0.0
    reason: str = ""            # why skipped


@dataclasses.dataclass
class StageContext:
    config: BuildConfig
    name: str                   # this stage's name
    root: Path                  # build output root (build/<stem>)
    out_dir: Path               # where this stage writes (a temporary folder)
    results: dict[str, StageResult]
    force: bool = False
    log: Callable[[str], None] = get_logger("builder").info   # the CLI passes its console
    progress_factory: Callable[..., Any] | None = None

    def result(self, name: str) -> StageResult | None:
        return self.results.get(name)

    def checkpoint_dir(self) -> Path:
        """The HF checkpoint later stages build from: quantized if quantize ran, else imported."""
        for name in ("quantize", "import"):
            r = self.results.get(name)
            if r is not None and r.path is not None:
                return r.path
        raise AssertionError("checkpoint_dir() called before the import stage produced a checkpoint")

    @contextmanager
    def progress(self, description: str, total: int | None = None) -> Iterator[Callable[[int], None]]:
        if self.progress_factory is None:
            yield lambda n=1: None
            return
        with self.progress_factory(description, total) as advance:
            yield advance
