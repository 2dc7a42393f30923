"""The executor's speculative decoding seam: what ``Executor`` calls on a speculator (implemented in
``backend/speculative``: EAGLE-3's ``EagleSpeculator``, the hidden-state recorder)."""
from __future__ import annotations

from typing import Protocol

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
    """
    capture_hidden_layers: tuple[int, ...]

    def prepare(self, out: SchedulerOutput, inputs: StepInputs) -> None: ...
    def verify(self, out: SchedulerOutput, logits: torch.Tensor, rows: list[SampleRow],
               sampler: Sampler) -> list[list[int]]: ...
    def propose(self, out: SchedulerOutput, inputs: StepInputs, captured: dict[int, torch.Tensor],
                finished: list[Request]) -> None: ...


__all__ = ["Speculator"]
