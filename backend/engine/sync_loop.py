"""The synchronous engine loop: one step is schedule -> prepare inputs -> run model -> sample (or
verify drafts) -> update -> deliver, each step's tokens read on the host before the next is
scheduled. The peer of the overlapped loop (``overlap.py``); ``Executor`` runs one of the two.

Speculative decoding runs here only: an optional ``speculator`` (``speculator_seam.Speculator``)
proposes draft tokens after each step (``propose``) and turns the target model's logits for
``1 + k`` rows per sequence into accepted tokens (``verify``). Without one, one token is sampled per
sequence.
"""
from __future__ import annotations

import time

from backend.engine.inputs import InputPreparer
from backend.engine.logits_out import generation_rows, stash_context
from backend.engine.request import RequestStatus
from backend.engine.request_table import RequestTable
from backend.engine.sampler import Sampler
from backend.engine.scheduler import SchedulerOutput
from backend.engine.speculator_seam import Speculator

_ABORTED = RequestStatus.FINISHED_ABORTED


class SyncLoop:
    """``Executor.step`` when overlap scheduling is off (and always with a speculator)."""

    pending = None                       # no step is ever left in flight (OverlapLoop's counterpart)

    def __init__(self, table: RequestTable, inputs: InputPreparer, runner, sampler: Sampler,
                 speculator: Speculator | None) -> None:
        self.table = table
        self.inputs = inputs
        self.runner = runner
        self.sampler = sampler
        self.speculator = speculator

    def step(self) -> int:
        table = self.table
        table.process_cancels()
        with table.lock:
            out = table.scheduler.schedule()
        if out.is_empty:
            return 0
        table.guarded(lambda: self._run(out), lambda: [s.request for s in out.scheduled])
        return len(out.scheduled)

    def drain(self) -> None:
        """Nothing in flight: every step's tokens are delivered before it returns."""

    def _run(self, out: SchedulerOutput) -> None:
        spec = self.speculator
        table = self.table
        inputs = self.inputs.prepare(out)
        if spec is not None:
            spec.prepare(out, inputs)
        capture = spec.capture_hidden_layers if spec is not None else ()
        logits, captured = self.runner.execute(inputs.input_ids, inputs.meta, inputs.logits_indices, capture)
        if inputs.context:
            logits = stash_context(logits, inputs.context)
        sampling = [s.request for s in inputs.sample_seqs]
        gen_rows = generation_rows(sampling, inputs.logits_counts)
        gen = dict(zip((i for i, _ in gen_rows),
                       logits[[r for _, r in gen_rows]].float().cpu())) if gen_rows else None
        rows = table.sample_rows(sampling)
        logprobs = None
        if spec is not None and out.num_spec_tokens:
            sampled: list = spec.verify(out, logits, rows, self.sampler)
            # Rows sampled without drafts in a speculative step keep their logprobs.
            logprobs = spec.last_logprobs
        else:
            res = self.sampler(logits, rows)
            sampled, logprobs = res.token_ids, res.logprobs
        with table.lock:
            before = [len(r.output_token_ids) for r in sampling]
            finished = table.scheduler.update(out, sampled)
        if spec is not None:
            spec.propose(out, inputs, captured, finished)
        new = [r.output_token_ids[b:] if r.status is not _ABORTED else () for r, b in zip(sampling, before)]
        table.deliver(zip(sampling, range(len(sampling)), new), logprobs, gen, time.monotonic())


__all__ = ["SyncLoop"]
