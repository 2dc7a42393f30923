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

import torch

from backend.engine.inputs import InputPreparer
from backend.engine.late_tokens import PLACEHOLDER, LateRows, fill, late_rows
from backend.engine.logits_out import generation_rows, stash_context
from backend.engine.request import Request
from backend.engine.request_table import RequestTable
from backend.engine.sampler import DeviceSample, Sampler
from backend.engine.scheduler import SchedulerOutput
from backend.runtime.spec import EngineError


def wants_overlap(want, device: torch.device, speculating: bool) -> bool:
    """Whether ``engine.overlap_scheduling`` (``want``) asks for the overlapped loop, given the
    device and whether a speculator will run: "auto" = overlapped on a CUDA device unless a
    speculator is attached; true on any device (on CPU only its structure: ops are synchronous)."""
    if want not in ("auto", True, False):
        raise EngineError(f"engine.overlap_scheduling: {want!r}; allowed: auto, true, false")
    if speculating:
        # Drafts for step n+1 come from step n's accepted tokens on the host: nothing to overlap.
        if want is True:
            raise EngineError("engine.overlap_scheduling: true cannot run with speculative decoding "
                              "(the next drafts need this step's tokens on the host); allowed: auto, "
                              "false, or Executor(speculative=False)")
        return False
    return want is True or (want == "auto" and device.type == "cuda")


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
    """``Executor.step`` when overlap scheduling is on: the peer of ``SyncLoop`` (``sync_loop.py``),
    with the same table, preparer, runner and sampler; owns only the step in flight."""

    def __init__(self, table: RequestTable, inputs: InputPreparer, runner, sampler: Sampler) -> None:
        self.table = table
        self.inputs = inputs
        self.runner = runner
        self.sampler = sampler
        self.copy = HostCopy(runner.device)
        self.pending: InFlight | None = None

    def step(self) -> int:
        table = self.table
        if self.pending is not None and self.pending.needs_history:
            self._guarded(None, self._resolve_pending)   # the next step's sampling reads token values
        table.process_cancels()
        with table.lock:
            out = table.scheduler.schedule()
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
        """A failure ends the requests ``fn`` touched: this step's and the one in flight."""
        self.table.guarded(fn, lambda: self._touched(out))

    def _touched(self, out: SchedulerOutput | None) -> list[Request]:
        reqs = [s.request for s in out.scheduled] if out is not None else []
        if self.pending is not None:
            reqs += self.pending.requests
            self.pending = None
        return reqs

    def _run(self, out: SchedulerOutput) -> None:
        table = self.table
        prev = self.pending
        inputs = self.inputs.prepare(out, prev.rows if prev is not None else None)
        ids = inputs.input_ids
        if inputs.late_dst is not None:
            # Decode rows whose input token was sampled by the step still on the device.
            ids.index_copy_(0, inputs.late_dst, prev.sample.tokens.index_select(0, inputs.late_src))
        logits, _ = self.runner.execute(ids, inputs.meta, inputs.logits_indices)
        if inputs.context:
            logits = stash_context(logits, inputs.context)   # rare; a synchronous copy
        sampling = [s.request for s in inputs.sample_seqs]
        gen_rows = generation_rows(sampling, inputs.logits_counts)
        # copies on the device, read once the step's event has fired (no extra host sync)
        gen = {i: logits[r].float().clone() for i, r in gen_rows} if gen_rows else None
        rows = table.sample_rows(sampling)
        ds = self.sampler.sample(logits, rows)
        copy = self.copy.start(ds.packed())
        # The device runs this step while the host finishes the previous one.
        if prev is not None:
            self._resolve_pending()
        with table.lock:
            table.scheduler.update(out, [PLACEHOLDER] * len(sampling))
            lrows = late_rows(sampling, table.scheduler.last_update_skipped)
        # (rows of requests aborted meanwhile may count too: at worst one step resolves early)
        self.pending = InFlight(lrows, ds, copy, any(r.history for r in rows), gen)

    def _resolve_pending(self) -> None:
        """Read the step in flight's samples (waiting for its event), fill its placeholders, deliver."""
        table = self.table
        prev = self.pending
        res = prev.sample.unpack(HostCopy.wait(prev.copy))
        now = time.monotonic()
        with table.lock:
            emit = fill(table.scheduler, prev.rows, res.token_ids, now)
        self.pending = None
        table.deliver(emit, res.logprobs, prev.logits, now)


__all__ = ["HostCopy", "InFlight", "OverlapLoop", "wants_overlap"]
