"""Tokens that reach the host one step late (pure Python, no torch): the scheduler's side of the
overlapped loop (``backend/engine/overlap.py``).

While the device runs step n the host already schedules step n+1, so step n's tokens are not known
when the scheduler must account for them. ``Scheduler.update`` is called with ``PLACEHOLDER`` for
each of them: every count (computed tokens, KV slots, ``max_tokens`` and ``max_seq_len`` limits)
comes out exactly as with the real token, so step n+1's decode rows are scheduled as usual and
take their input token from step n's samples on the device. What needs the token's value waits for
``fill``, one step later: the stop check (a request that stopped at step n has one wasted row in
step n+1, whose sample is discarded), the output lists and the events.

Why this keeps the KV cache right: a block's hash covers only ``all_token_ids`` up to
``num_computed_tokens``; the one placeholder a running request can hold sits at index
``num_computed_tokens`` (the token sampled last), and the loop fills step n's placeholders before it
calls ``update`` for step n+1, the only call that moves ``num_computed_tokens`` past them. A request
preempted while its placeholder is unfilled is not re-admitted in that step (the scheduler admits
nothing in a step that preempted), and its placeholder is filled before the next ``schedule()``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from backend.engine.request import Request, RequestStatus

# Never a token id (SamplingParams and the executor refuse negative ids), so never a stop token.
PLACEHOLDER = -1


@dataclass(slots=True)
class LateRows:
    """The rows of one step whose sampled token the host does not know yet, as parallel lists (no
    object per row: a step has one per running request). Each one's placeholder is its request's
    last output token until ``fill``: the next placeholder comes only with the next ``update``,
    which the loop calls after ``fill``."""
    requests: list[Request]
    index: Sequence[int]    # each one's row of the step's sampled tokens (the step's sampling order)


def late_rows(sampling: Sequence[Request], skipped: int) -> LateRows:
    """After ``update(out, [PLACEHOLDER] * n)`` skipped ``skipped`` of the ``sampling`` rows
    (``Scheduler.last_update_skipped``: requests no longer running, e.g. stopped by the previous
    step's ``fill`` after this step was scheduled): the rows that got a placeholder."""
    if not skipped:
        return LateRows(list(sampling), range(len(sampling)))
    # A skipped request's last output token is a real one: its earlier placeholder was filled
    # before this update.
    keep = [i for i, req in enumerate(sampling)
            if req.output_token_ids and req.output_token_ids[-1] == PLACEHOLDER]
    return LateRows([sampling[i] for i in keep], keep)


def fill(scheduler, rows: LateRows, tokens: Sequence[int], now: float) -> list[tuple[Request, int, list[int]]]:
    """Put the real tokens in place of the placeholders and apply what needed their values (stop
    tokens). Returns (request, sample row, [its token]) of the rows that take an event (not
    cancelled or failed meanwhile), as ``RequestTable.deliver`` takes them; a request
    ``is_finished`` when that token was its last."""
    emit = []
    running = RequestStatus.RUNNING
    aborted, failed = RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR
    for req, i in zip(rows.requests, rows.index):
        tok = tokens[i]
        out = req.output_token_ids
        assert out[-1] == PLACEHOLDER, req
        out[-1] = tok
        req.all_token_ids[-1] = tok      # (all_token_ids = prompt + output: the same placeholder)
        status = req.status
        if status is aborted or status is failed:
            continue
        n = len(out)
        if n == 1:
            req.first_token_time = now   # update() stamped the placeholder; the token arrives now
        req.last_token_time = now
        if tok in req.stop_ids and n > req.params.min_tokens:
            req.stop_token = tok
            if status is RequestStatus.FINISHED_LENGTH:
                # The last token allowed was also a stop token: the synchronous update checks
                # stops first and says "stop".
                req.status = RequestStatus.FINISHED_STOPPED
            elif status is running or status is RequestStatus.PREEMPTED:
                scheduler.abort(req.request_id, RequestStatus.FINISHED_STOPPED)
        emit.append((req, i, [tok]))
    return emit


__all__ = ["LateRows", "PLACEHOLDER", "fill", "late_rows"]
