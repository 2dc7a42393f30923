"""The overlapped engine loop (``engine.overlap_scheduling``): the host schedules and prepares step
n+1 while the device runs step n, as vLLM's async scheduling and TensorRT-LLM's overlap scheduler do.

One iteration (``OverlapLoop.step``)::

    schedule(n+1) -> prepare(n+1) -> [device] input_ids[late rows] = samples(n)[...]
    -> launch forward + sampling of n+1 -> ONE non_blocking copy of its samples into pinned memory
       + a CUDA event
    -> wait for step n's event (normally long done: step n+1 is queued behind it) -> fill step n's
       placeholders, stop checks, events to clients          <- the device runs n+1 meanwhile
    -> Scheduler.update(n+1) with placeholders (backend/engine/late_tokens.py)

Host syncs per decode step: exactly one, the event of the packed sample copy (``HostCopy``);
everything else the step sends to the device goes from pinned memory without blocking (input
preparation, the sampler's per-row parameters). Steps whose rows read earlier tokens' values
(bad words, penalties) resolve the step before first, so they are synchronous.

On CPU torch ops run synchronously, so the loop only has its structure there (tests check it gives
exactly the synchronous loop's tokens and logprobs). Speculative decoding keeps the synchronous
loop: the drafts of step n+1 are proposed from step n's accepted tokens on the host.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from backend.engine.events import TokenEvent
from backend.engine.late_tokens import PLACEHOLDER, LateRows, fill, late_rows
from backend.engine.logits_out import generation_rows, stash_context
from backend.engine.request import FINAL, Request
from backend.engine.sampler import DeviceSample
from backend.engine.scheduler import SchedulerOutput
from backend.logs import get_logger
from backend.runtime.spec import EngineError

if TYPE_CHECKING:
    from backend.engine.executor import Executor

_LOG = get_logger("engine.overlap")


def overlap_loop(ex: "Executor", speculator) -> "OverlapLoop | None":
    """The loop ``engine.overlap_scheduling`` asks for, given the speculator the executor will run:
    "auto" = overlapped on a CUDA device unless a speculator is attached; true on any device (on CPU
    only its structure: ops are synchronous)."""
    want = ex.spec.engine.overlap_scheduling
    if want not in ("auto", True, False):
        raise EngineError(f"engine.overlap_scheduling: {want!r}; allowed: auto, true, false")
    if speculator is not None:
        # Drafts for step n+1 come from step n's accepted tokens on the host: nothing to overlap.
        if want is True:
            raise EngineError("engine.overlap_scheduling: true cannot run with speculative decoding "
                              "(the next drafts need this step's tokens on the host); allowed: auto, "
                              "false, or Executor(speculative=False)")
        return None
    if want is True or (want == "auto" and ex.device.type == "cuda"):
        return OverlapLoop(ex)
    return None


class HostCopy:
    """Device -> pinned host copies, one per step, each with an event to wait on. Two buffers per
    dtype: step n's copy may be in flight while step n-1's is read, never longer."""

    def __init__(self, device: torch.device) -> None:
        self.async_ = device.type == "cuda"
        self._bufs: dict[tuple[torch.dtype, int], torch.Tensor] = {}
        self._flip = 0

    def start(self, t: torch.Tensor):
        if not self.async_:
            return t, None               # CPU: the value is already there (ops are synchronous)
        key = (t.dtype, self._flip)
        self._flip ^= 1
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < t.numel():
            buf = self._bufs[key] = torch.empty(max(t.numel(), 1024) * 2, dtype=t.dtype, pin_memory=True)
        host = buf[:t.numel()]
        host.copy_(t, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    @staticmethod
    def wait(handle) -> torch.Tensor:
        host, event = handle
        if event is not None:
            event.synchronize()          # the step's one host sync
        return host


@dataclass
class InFlight:
    """A step launched whose samples the host has not read yet."""
    rows: LateRows
    sample: DeviceSample
    copy: tuple
    needs_history: bool
    # sample row -> its raw logits on the device, for requests with return_generation_logits
    logits: dict[int, torch.Tensor] | None = None

    @property
    def requests(self) -> list[Request]:
        return self.rows.requests


class OverlapLoop:
    """``Executor.step`` when overlap scheduling is on. Uses the executor's scheduler, preparer,
    runner, sampler and event plumbing; owns only the step in flight."""

    def __init__(self, ex: "Executor") -> None:
        self.ex = ex
        self.copy = HostCopy(ex.device)
        self.pending: InFlight | None = None

    def step(self) -> int:
        ex = self.ex
        if self.pending is not None and self.pending.needs_history:
            self._guarded(None, self._resolve_pending)   # the next step's sampling reads token values
        ex._process_cancels()
        with ex._lock:
            out = ex.scheduler.schedule()
        if out.is_empty:
            if self.pending is not None:               # the last step's tokens are still owed
                self._guarded(None, self._resolve_pending)
            return 0
        self._guarded(out, lambda: self._run(out))
        return len(out.scheduled)

    def drain(self) -> None:
        """Deliver the step in flight (loop exit, shutdown)."""
        if self.pending is not None:
            self._guarded(None, self._resolve_pending)

    # -- one step ---------------------------------------------------------------------------
    def _guarded(self, out: SchedulerOutput | None, fn) -> None:
        """Run ``fn`` as the executor runs a step: a failure ends the requests it touched (this step's
        and the one in flight) with an error, and the loop goes on."""
        ex = self.ex
        ex._step_started = time.monotonic()
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - a failing step must not kill the loop
            ex._step_errors += 1
            msg = f"{type(exc).__name__}: {exc}"
            reqs = [s.request for s in out.scheduled] if out is not None else []
            if self.pending is not None:
                reqs += self.pending.requests
                self.pending = None
            _LOG.exception("step failed; ending its %d requests with an error (%s)", len(reqs),
                           ", ".join(dict.fromkeys(r.request_id for r in reqs)))
            ex._fail_requests(reqs, msg)
        ex._step_started = None

    def _run(self, out: SchedulerOutput) -> None:
        ex = self.ex
        prev = self.pending
        inputs = ex.inputs.prepare(out, prev.rows if prev is not None else None)
        ids = inputs.input_ids
        if inputs.late_dst is not None:
            # Decode rows whose input token was sampled by the step still on the device.
            ids.index_copy_(0, inputs.late_dst, prev.sample.tokens.index_select(0, inputs.late_src))
        logits, _ = ex.runner.execute(ids, inputs.meta, inputs.logits_indices)
        if inputs.context:
            logits = stash_context(logits, inputs.context)   # rare; a synchronous copy
        sampling = [s.request for s in inputs.sample_seqs]
        gen_rows = generation_rows(sampling, inputs.logits_counts)
        # copies on the device, read once the step's event has fired (no extra host sync)
        gen = {i: logits[r].float().clone() for i, r in gen_rows} if gen_rows else None
        rows = ex._sample_rows(sampling)
        ds = ex.sampler.sample(logits, rows)
        copy = self.copy.start(ds.packed())
        # The device runs this step while the host finishes the previous one.
        if prev is not None:
            self._resolve_pending()
        with ex._lock:
            ex.scheduler.update(out, [PLACEHOLDER] * len(sampling))
            lrows = late_rows(sampling, ex.scheduler.last_update_skipped)
        # (rows of requests aborted meanwhile may count too: at worst one step resolves early)
        self.pending = InFlight(lrows, ds, copy, any(r.history for r in rows), gen)

    def _resolve_pending(self) -> None:
        """Read the step in flight's samples (waiting for its event), fill its placeholders, emit."""
        ex = self.ex
        prev = self.pending
        res = prev.sample.unpack(HostCopy.wait(prev.copy))
        now = time.monotonic()
        with ex._lock:
            emit = fill(ex.scheduler, prev.rows, res.token_ids, now)
        self.pending = None
        logprobs = res.logprobs
        tokens = res.token_ids
        # _emit_tokens' common case delivered here, as in Executor._run
        fast = ex._handles if not ex._guides and not prev.logits else None
        for req, i in emit:
            lp = [logprobs[i]] if logprobs[i] is not None else None
            if lp:
                req.output_logprobs.extend(lp)
            if fast is not None and req.status < FINAL and not req.context_logits:
                handle = fast.get(req.request_id)
                if handle is not None:
                    try:
                        handle._deliver(TokenEvent(req.request_id, [tokens[i]], lp, False, None, None, req))
                    except Exception:  # noqa: BLE001 - a consumer's callback bug must not stop the engine
                        ex._callback_failed(req.request_id)
                continue
            done = req.status >= FINAL
            if done:
                ex._record_latency(req, now)
            gen = prev.logits.get(i) if prev.logits else None
            ex._emit_tokens(req, [tokens[i]], lp, done, None if gen is None else gen.cpu().unsqueeze(0))


__all__ = ["HostCopy", "InFlight", "OverlapLoop"]
