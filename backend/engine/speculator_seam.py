"""The executor's speculative decoding seam: what ``Executor`` calls on a speculator (implemented in
``backend/speculative``: EAGLE-3's ``EagleSpeculator``, the hidden-state recorder), and the table of
speculative methods ``attach`` turns on.

The engine names each method's module by string and imports it only when a bundle's draft asks for
it: the speculative package implements this seam (it imports the engine), never the reverse.
"""
from __future__ import annotations

import importlib
from typing import Any, Protocol

import torch

from backend.engine.inputs import StepInputs
from backend.engine.request import Request
from backend.engine.sampler import Sampler, SampleRow
from backend.engine.scheduler import SchedulerOutput


class Speculator(Protocol):
    """What the executor calls when speculative decoding is on (implemented in ``backend/speculative``).

    * ``capture_hidden_layers``: target layers whose outputs ``propose`` needs.
    * ``prepare(out, inputs)``: before the forward; may set ``inputs.meta.tree_mask`` for token trees.
    * ``verify(out, logits, rows, sampler)``: ``logits`` has ``1 + num_spec_tokens`` rows per sampling
      sequence (scheduled order); returns, per sampling sequence, the accepted draft tokens followed by
      one token sampled from the target (the list the scheduler's ``update`` takes).
    * ``propose(out, inputs, captured, finished)``: after ``update``; sets ``request.spec_token_ids``
      for running requests (the scheduler reserves slots for them next step). ``captured[i]`` is the
      output of target layer ``i`` for EVERY token of the step (``[T, hidden]``, the step's token
      order: ``inputs.meta.query_start_loc`` delimits sequences); ``inputs.logits_counts`` tells how
      many rows each sampling sequence had. Requests with ``params.speculative = False`` must get
      no drafts.
    Greedy requests must produce exactly the tokens they would without speculation.

    Every speculator subclasses it, so the members with a default are there to read (no caller probes):
    * ``stats``: the counters ``Executor.stats()`` reports (an object with ``as_dict()``), None if none;
    * ``last_logprobs``: after ``verify``, the logprobs of the rows it sampled without drafts;
    * ``request_stats(request_id)``: one request's draft counts (``draft_tokens_proposed``,
      ``draft_tokens_accepted``), kept after it ends; empty where the speculator keeps none.
    """
    capture_hidden_layers: tuple[int, ...]
    stats: Any = None
    last_logprobs: list | None = None

    def prepare(self, out: SchedulerOutput, inputs: StepInputs) -> None: ...
    def verify(self, out: SchedulerOutput, logits: torch.Tensor, rows: list[SampleRow],
               sampler: Sampler) -> list[list[int]]: ...
    def propose(self, out: SchedulerOutput, inputs: StepInputs, captured: dict[int, torch.Tensor],
                finished: list[Request]) -> None: ...

    def request_stats(self, request_id: str) -> dict:
        return {}


# speculative.method of engine.json -> "module:function" that attaches it: fn(executor, **overrides)
SPECULATIVE_METHODS: dict[str, str] = {"eagle3": "backend.speculative.speculator:attach"}


def attach(executor, method: str = "eagle3", **overrides) -> Speculator:
    """Turn on speculative decoding ``method`` for ``executor`` with its bundle's draft (the method's
    module imported now, not before); ``overrides``: the method's own settings."""
    if method not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative.method: {method!r}; allowed: {', '.join(SPECULATIVE_METHODS)}")
    module, _, name = SPECULATIVE_METHODS[method].partition(":")
    return getattr(importlib.import_module(module), name)(executor, **overrides)


__all__ = ["SPECULATIVE_METHODS", "Speculator", "attach"]
