"""What a client of the executor gets back: ``TokenEvent``s through a ``RequestHandle`` (iterate it,
or pass ``on_event`` to ``Executor.submit``), or one ``GenerationResult`` per request."""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator


@dataclass(slots=True)
class TokenEvent:
    request_id: str
    token_ids: list[int]
    logprobs: list | None = None
    finished: bool = False
    finish_reason: str | None = None     # "length" | "stop" | "cancelled" | "error"
    error: str | None = None
    # The executor's Request (its timestamps and KV block counts), for the per-request perf figures.
    # Read it only inside the event callback: that runs on the executor's thread, which owns it.
    request: Any = field(default=None, repr=False, compare=False)
    # Host fp32 tensors, only for requests that asked (backend/engine/logits_out.py): the prompt's
    # [prompt, vocab] with the first token, and [len(token_ids), vocab] for this event's tokens.
    context_logits: Any = field(default=None, repr=False, compare=False)
    generation_logits: Any = field(default=None, repr=False, compare=False)


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list | None = None
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    context_logits: Any = field(default=None, repr=False)      # [prompt, vocab] when asked for
    generation_logits: Any = field(default=None, repr=False)   # [tokens, vocab] when asked for


class RequestHandle:
    """Iterate for ``TokenEvent``s (blocking), or pass ``on_event`` to ``submit`` instead.

    ``_deliver`` runs on the engine's loop thread once per request per step (hundreds per step at
    large batches), so it takes no lock unless a reader is asleep: ``deque.append`` is atomic, and
    a reader announces itself (``_sleeping``) under the lock and looks at the queue once more before
    it waits, so an event appended before it announced is seen then, and one appended after finds
    the announcement and wakes it (the wake needs the lock, which the reader holds until it waits).
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 on_event: Callable[[TokenEvent], None] | None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._on_event = on_event
        self._events: deque[TokenEvent] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._sleeping = 0               # readers waiting in _cond (changed only under its lock)
        self.finished = False

    def _deliver(self, ev: TokenEvent) -> None:
        if self._on_event is not None:
            self._on_event(ev)
        else:
            self._events.append(ev)
        if ev.finished:
            self.finished = True
        if self._sleeping:
            with self._cond:
                self._cond.notify_all()

    def _sleep_until(self, ready: Callable[[], bool], timeout: float | None = None) -> bool:
        """Wait until ``ready()`` (checked under the lock after announcing the wait; see the class)."""
        if ready():
            return True
        with self._cond:
            self._sleeping += 1
            try:
                return self._cond.wait_for(ready, timeout)
            finally:
                self._sleeping -= 1

    def __iter__(self) -> Iterator[TokenEvent]:
        assert self._on_event is None, "this handle delivers its events to the on_event callback"
        events = self._events
        while True:
            if not events:
                self._sleep_until(lambda: bool(events))
            ev = events.popleft()        # one reader per handle: nobody else pops
            yield ev
            if ev.finished:
                return

    def result(self) -> GenerationResult:
        """Block until finished and collect every event into one result."""
        tokens: list[int] = []
        logprobs: list = []
        context, generation = None, []
        last = None
        for ev in self:
            tokens.extend(ev.token_ids)
            if ev.logprobs:
                logprobs.extend(ev.logprobs)
            if ev.context_logits is not None:
                context = ev.context_logits
            if ev.generation_logits is not None:
                generation.append(ev.generation_logits)
            last = ev
        gen = None
        if generation:
            import torch  # only requests that asked for logits get here
            gen = torch.cat(generation)
        return GenerationResult(self.request_id, self.prompt_token_ids, tokens, last.finish_reason,
                                logprobs or None, last.error, context_logits=context, generation_logits=gen)

    def wait(self, timeout: float | None = None) -> bool:
        return self._sleep_until(lambda: self.finished, timeout)


__all__ = ["GenerationResult", "RequestHandle", "TokenEvent"]
