"""Delivering each request's events and ending requests early (cancel, a failed step): a mixin of
``Executor`` (``executor.py``), which owns what it works on: the scheduler and its lock, the
request handles, generators and grammar guides, the cancel queue and the latency samples.

Every method here runs on the loop thread (the executor's threading contract): a handle's events
come from one thread, and each request gets exactly one final event.
"""
from __future__ import annotations

from typing import Sequence

import torch

from backend.engine.events import TokenEvent
from backend.engine.logits_out import take_context
from backend.engine.request import FINISH_REASONS, Request, RequestStatus
from backend.logs import for_request, get_logger

_LOG = get_logger("engine.executor")


class RequestEvents:
    def _emit_tokens(self, req: Request, tokens: list[int], lp: list | None, done: bool,
                     generation_logits: torch.Tensor | None = None) -> None:
        # The step loops deliver the common case themselves (a token for a request still running,
        # no guides in the engine, no logits asked for): executor._run, OverlapLoop._resolve_pending.
        rid = req.request_id
        if self._guides and tokens and rid in self._guides:
            self._guides[rid].accept(tokens)    # before the request's next mask is filled
        ctx = take_context(req) if req.context_logits else None
        ev = TokenEvent(rid, tokens, lp, done, FINISH_REASONS.get(req.status) if done else None, None, req, ctx,
                        generation_logits)
        if done:
            self._emit(rid, ev, final=True)
            return
        handle = self._handles.get(rid)
        if handle is not None:
            try:
                handle._deliver(ev)
            except Exception:  # noqa: BLE001 - a consumer's callback bug must not stop the engine
                self._callback_failed(rid)

    def _fail_requests(self, reqs: Sequence[Request], msg: str) -> None:
        """End these requests with an error event (a failed step). A request the scheduler already
        finished whose last token was never delivered (overlapped loop) still gets its final event."""
        for req in reqs:
            rid = req.request_id
            self._abort(rid, RequestStatus.FINISHED_ERROR, msg)
            if rid in self._handles:
                self._emit(rid, TokenEvent(rid, [], None, True, "error", msg), final=True)

    def _process_cancels(self) -> None:
        while True:
            with self._lock:
                if not self._cancels:
                    return
                rid = self._cancels.popleft()
            self._abort(rid, RequestStatus.FINISHED_ABORTED, None)

    def _abort(self, rid: str, status: RequestStatus, error: str | None) -> None:
        with self._lock:
            req = self.scheduler.abort(rid, status, error)
        if req is not None:
            self._emit(rid, TokenEvent(rid, [], None, True, FINISH_REASONS[status], error, request=req),
                       final=True)

    def _emit(self, rid: str, ev: TokenEvent, final: bool) -> None:
        handle = self._handles.get(rid)
        if handle is None:
            return
        if final:
            self._handles.pop(rid, None)
            self._generators.pop(rid, None)
            self._guides.pop(rid, None)
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
            self._ttft.append(req.first_token_time - req.arrival_time)
            n = len(req.output_token_ids)
            if n > 1:
                self._tpot.append((now - req.first_token_time) / (n - 1))


__all__ = ["RequestEvents"]
