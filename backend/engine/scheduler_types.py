"""The scheduler's data: what one step runs (``ScheduledSeq``, ``SchedulerOutput``) and the queue
of requests waiting for admission (pure Python, no torch)."""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from backend.engine.request import Request


@dataclass(slots=True)
class ScheduledSeq:
    request: Request
    start_pos: int        # tokens already in the KV cache before this step
    num_new_tokens: int   # query length this step (includes num_spec_tokens)
    is_prefill: bool      # (part of) a prompt or a recompute, rather than a decode
    sample: bool          # this step reaches the end of the known tokens: sample a token
    num_spec_tokens: int = 0   # trailing draft tokens (request.spec_token_ids[:n]) to verify


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan. Valid until the next ``schedule()``: decode entries are per-request objects
    that the scheduler refreshes in place every step (building hundreds of new ones per step cost
    more than the rest of scheduling)."""
    scheduled: list[ScheduledSeq]            # prefills first, then decodes
    preempted: list[Request] = field(default_factory=list)
    # Requests that finished or were aborted since the previous schedule(): input preparation
    # drops their cached rows.
    finished_request_ids: list[str] = field(default_factory=list)
    num_prefills: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_spec_tokens: int = 0                 # draft tokens scored this step (0 = no speculation)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_sampled(self) -> int:
        return sum(1 for s in self.scheduled if s.sample)


class WaitingQueue:
    """Requests waiting for admission: highest priority first, FCFS (arrival order) among equals.
    A preempted request re-enters with its original arrival number, so it goes before later ones.
    Aborted entries are dropped lazily when they reach the head (removal from a heap is O(n))."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Request]] = []
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def push(self, request: Request) -> None:
        assert request.arrival_seq >= 0, "the scheduler numbers requests before queueing them"
        heapq.heappush(self._heap, (-request.priority, request.arrival_seq, request))
        self._count += 1

    def peek(self) -> Request | None:
        heap = self._heap
        while heap:
            req = heap[0][2]
            if req.is_finished:          # aborted while waiting
                heapq.heappop(heap)
                continue
            return req
        return None

    def pop(self) -> Request:
        req = self.peek()
        assert req is not None
        heapq.heappop(self._heap)
        self._count -= 1
        return req

    def discard(self, request: Request) -> None:
        """Forget a request that is about to be marked finished (its entry is skipped later)."""
        assert self._count > 0
        self._count -= 1


__all__ = ["ScheduledSeq", "SchedulerOutput", "WaitingQueue"]
