"""What a client of the executor gets back: ``TokenEvent``s through a ``RequestHandle`` (iterate it,
or pass ``on_event`` to ``Executor.submit``), or one ``GenerationResult`` per request."""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator


@dataclass
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
    """Iterate for ``TokenEvent``s (blocking), or pass ``on_event`` to ``submit`` instead."""

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 on_event: Callable[[TokenEvent], None] | None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._on_event = on_event
        self._events: deque[TokenEvent] = deque()
        self._cond = threading.Condition()
        self.finished = False

    def _deliver(self, ev: TokenEvent) -> None:
        if self._on_event is not None:
            self._on_event(ev)
        with self._cond:
            if self._on_event is None:
                self._events.append(ev)
            self.finished = self.finished or ev.finished
            self._cond.notify_all()

    def __iter__(self) -> Iterator[TokenEvent]:
        assert self._on_event is None, "this handle delivers its events to the on_event callback"
        while True:
            with self._cond:
                while not self._events:
                    self._cond.wait()
                ev = self._events.popleft()
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
        with self._cond:
            return self._cond.wait_for(lambda: self.finished, timeout)


__all__ = ["GenerationResult", "RequestHandle", "TokenEvent"]
