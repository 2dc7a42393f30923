"""The executor's request table: what it keeps per live request beside the scheduler (the client's
handle, a seeded generator, a grammar guide), the cancel queue and the latency samples, and the one
place a token reaches a client (``deliver``).

Both step loops (``sync_loop.py``, ``overlap.py``) and ``Executor`` work through this table; none
of them touches another's state. The scheduler and the lock that guards it between the caller's
thread (``submit``, ``cancel``) and the loop thread are the table's too: ending a request early
means both aborting it in the scheduler and sending its final event.

Every method but ``add`` and ``cancel`` runs on the loop thread (the executor's threading contract):
a handle's events come from one thread, and each request gets exactly one final event.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, Iterable, Sequence

import torch

from backend.engine.events import RequestHandle, TokenEvent
from backend.engine.logits_out import take_context
from backend.engine.request import FINAL, FINISH_REASONS, Request, RequestStatus
from backend.engine.sampler import SampleRow
from backend.engine.scheduler import Scheduler
from backend.logs import for_request, get_logger

_LOG = get_logger("engine.executor")
# Latency samples kept for stats() (a ring: serving reads percentiles of recent traffic).
_SAMPLES = 4096


class RequestTable:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.lock = threading.Lock()             # guards the scheduler and ``cancels`` between threads
        self.handles: dict[str, RequestHandle] = {}
        self.generators: dict[str, torch.Generator] = {}
        self.guides: dict = {}                   # request id -> guided.Guide (structured output)
        self.cancels: deque[str] = deque()
        self.ttft: deque[float] = deque(maxlen=_SAMPLES)
        self.tpot: deque[float] = deque(maxlen=_SAMPLES)
        self.step_errors = 0
        self.step_started: float | None = None   # set while a step runs: health() spots a stuck one

    # -- the caller's thread (the lock held) --------------------------------------------------
    def add(self, req: Request, handle: RequestHandle, guide, generator: torch.Generator | None) -> None:
        """Queue ``req`` (``Scheduler.add`` raises ValueError before anything is kept). The caller
        holds ``lock``."""
        rid = req.request_id
        self.scheduler.add(req)
        self.handles[rid] = handle
        if guide is not None:
            self.guides[rid] = guide
        if generator is not None:
            self.generators[rid] = generator

    # -- the loop thread ----------------------------------------------------------------------
    def sample_rows(self, sampling: Sequence[Request]) -> list[SampleRow]:
        # One row per request for its life: what it refers to (params, token lists, generator,
        # grammar) is fixed at submit, and the lists grow in place
        return [r.sample_row or self._new_sample_row(r) for r in sampling]

    def _new_sample_row(self, r: Request) -> SampleRow:
        rid = r.request_id
        row = r.sample_row = SampleRow(r.params, r.prompt_token_ids, r.output_token_ids,
                                       self.generators.get(rid), self.guides.get(rid) if self.guides else None)
        return row

    def deliver(self, step: Iterable[tuple[Request, int, list[int]]], logprobs: Sequence | None,
                logits: dict[int, torch.Tensor] | None, now: float) -> None:
        """Hand one step's new tokens to their clients: ``step`` yields (request, its row of the
        step's samples, its new tokens); ``logprobs[row]`` and ``logits[row]`` (raw generation
        logits, for requests that asked) go with them. A request with no new token gets no event
        (the loops give a request cancelled meanwhile, whose final event is out, none).

        The common case, a token for a request still running with no guides in the engine and no
        logits to hand over, goes straight to its handle here, without a call per request (a step
        delivers to every running request: this loop is a visible share of the step's host time)."""
        handles = self.handles
        fast = not self.guides and not logits
        for req, i, tokens in step:
            if not tokens:
                continue
            lp = [logprobs[i]] if logprobs is not None and logprobs[i] is not None else None
            if lp:
                req.output_logprobs.extend(lp)
            if fast and req.status < FINAL and not req.context_logits:
                handle = handles.get(req.request_id)
                if handle is not None:
                    try:
                        handle._deliver(TokenEvent(req.request_id, tokens, lp, False, None, None, req))
                    except Exception:  # noqa: BLE001 - a consumer's callback bug must not stop the engine
                        self._callback_failed(req.request_id)
                continue
            done = req.status >= FINAL
            if done:
                self._record_latency(req, now)
            gen = logits.get(i) if logits else None
            self._emit_tokens(req, tokens, lp, done, None if gen is None else gen.cpu().unsqueeze(0))

    def _emit_tokens(self, req: Request, tokens: list[int], lp: list | None, done: bool,
                     generation_logits: torch.Tensor | None) -> None:
        rid = req.request_id
        if self.guides and rid in self.guides:
            self.guides[rid].accept(tokens)     # before the request's next mask is filled
        ctx = take_context(req) if req.context_logits else None
        ev = TokenEvent(rid, tokens, lp, done, FINISH_REASONS.get(req.status) if done else None, None, req, ctx,
                        generation_logits)
        if done:
            self._emit(rid, ev, final=True)
            return
        handle = self.handles.get(rid)
        if handle is not None:
            try:
                handle._deliver(ev)
            except Exception:  # noqa: BLE001 - a consumer's callback bug must not stop the engine
                self._callback_failed(rid)

    def guarded(self, fn: Callable[[], None], touched: Callable[[], list[Request]]) -> None:
        """Run one step's ``fn``: a failure ends the requests ``touched()`` names with an error event
        (logged, counted in ``step_errors``) and the loop goes on."""
        self.step_started = time.monotonic()
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - a failing step must not kill the loop
            self.step_errors += 1
            msg = f"{type(exc).__name__}: {exc}"
            reqs = touched()
            _LOG.exception("step failed; ending its %d requests with an error (%s)", len(reqs),
                           ", ".join(dict.fromkeys(r.request_id for r in reqs)))
            self.fail(reqs, msg)
        self.step_started = None

    def fail(self, reqs: Sequence[Request], msg: str) -> None:
        """End these requests with an error event (a failed step). A request the scheduler already
        finished whose last token was never delivered (overlapped loop) still gets its final event."""
        for req in reqs:
            rid = req.request_id
            self.abort(rid, RequestStatus.FINISHED_ERROR, msg)
            if rid in self.handles:
                self._emit(rid, TokenEvent(rid, [], None, True, "error", msg), final=True)

    def fail_all(self, msg: str) -> None:
        """The loop itself failed: every request still gets exactly one final event. With overlap,
        requests that finished in the scheduler may still be owed their last token (a handle but no
        scheduler entry)."""
        with self.lock:
            pending = list(self.scheduler.requests)
        for rid in dict.fromkeys(pending + list(self.handles)):
            try:
                self.abort(rid, RequestStatus.FINISHED_ERROR, msg)
            except Exception:  # noqa: BLE001 - the state may be what broke: still tell the client
                pass
            handle = self.handles.pop(rid, None)
            if handle is not None:
                handle._deliver(TokenEvent(rid, [], None, True, "error", msg))

    def cancel(self, rid: str) -> None:
        """Queue ``rid``'s abort for the loop thread (the caller holds ``lock``)."""
        self.cancels.append(rid)

    def process_cancels(self) -> None:
        while True:
            with self.lock:
                if not self.cancels:
                    return
                rid = self.cancels.popleft()
            self.abort(rid, RequestStatus.FINISHED_ABORTED, None)

    def abort(self, rid: str, status: RequestStatus, error: str | None) -> None:
        with self.lock:
            req = self.scheduler.abort(rid, status, error)
        if req is not None:
            self._emit(rid, TokenEvent(rid, [], None, True, FINISH_REASONS[status], error, request=req),
                       final=True)

    def _emit(self, rid: str, ev: TokenEvent, final: bool) -> None:
        handle = self.handles.get(rid)
        if handle is None:
            return
        if final:
            self.handles.pop(rid, None)
            self.generators.pop(rid, None)
            self.guides.pop(rid, None)
        try:
            handle._deliver(ev)
        except Exception:  # noqa: BLE001 - a consumer's callback bug must not stop the engine
            self._callback_failed(rid)

    @staticmethod
    def _callback_failed(rid: str) -> None:
        """(Called from an ``except`` block: logs the exception.)"""
        for_request(_LOG, rid).exception("the response callback failed")

    def _record_latency(self, req: Request, now: float) -> None:
        if req.first_token_time is not None:
            self.ttft.append(req.first_token_time - req.arrival_time)
            n = len(req.output_token_ids)
            if n > 1:
                self.tpot.append((now - req.first_token_time) / (n - 1))


__all__ = ["RequestTable"]
