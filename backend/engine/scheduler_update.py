"""Applying one step's results to the scheduler's requests (pure Python, no torch): ``update`` appends
the sampled tokens, checks stop tokens and limits, and finishes the requests that are done. A mixin
of ``Scheduler`` (``scheduler.py``), which owns the state it works on: ``running``, ``requests``,
``block_manager``, the counters and ``_finished_ids``."""
from __future__ import annotations

from collections.abc import Sequence

from backend.engine.request import Request, RequestStatus
from backend.engine.scheduler_types import ScheduledSeq, SchedulerOutput

_RUNNING = RequestStatus.RUNNING


class StepResults:
    def update(self, output: SchedulerOutput, sampled_token_ids: Sequence[int | Sequence[int]]
               ) -> list[Request]:
        """Apply one step's results. ``sampled_token_ids[j]`` belongs to the j-th scheduled sequence
        whose ``sample`` flag is set (scheduled order): an int, or with speculation a list of the
        accepted draft tokens followed by one more token. Returns the requests that finished;
        ``last_update_skipped`` says how many sampling rows were skipped (their requests ended
        while the step ran: they took no token)."""
        now = self.clock()
        finished: list[Request] = []
        seqs = output.scheduled
        npre = output.num_prefills
        nsampled = len(sampled_token_ids)
        j = 0
        skipped = 0                      # sampling rows of requests that ended while the step ran
        for s in seqs[:npre]:            # prefill chunks: the general path
            req = s.request
            if not s.sample:             # a prompt chunk that does not reach the end yet
                if req.status is _RUNNING:
                    assert req.num_computed_tokens == s.start_pos
                    req.num_computed_tokens += s.num_new_tokens
                    self.num_prefill_tokens_computed += s.num_new_tokens
                continue
            assert j < nsampled, f"{nsampled} sampled entries for more sampling sequences"
            tok = sampled_token_ids[j]
            j += 1
            if req.status is not _RUNNING:
                skipped += 1             # aborted while the step ran
                continue
            assert req.num_computed_tokens == s.start_pos
            done = self._update_general(req, s, tok)
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            if done:
                self._finish(req, done, now)
                finished.append(req)
        # Decodes, every one sampling, in the order of the rest of ``sampled_token_ids``. This loop
        # runs for every sequence every step: the plain case is kept to a few attribute operations
        # (a decode's first token time was stamped by its prefill).
        assert nsampled - j == len(seqs) - npre, \
            f"{nsampled} sampled entries for {j + len(seqs) - npre} sampling sequences"
        plain = 0
        for s, tok in zip(seqs[npre:] if npre else seqs, sampled_token_ids[j:] if j else sampled_token_ids):
            req = s.request
            if req.status is not _RUNNING:
                skipped += 1             # aborted while the step ran
                continue
            assert req.num_computed_tokens == s.start_pos
            if s.num_spec_tokens or type(tok) is not int:
                done = self._update_general(req, s, tok)
            else:
                req.num_computed_tokens += 1
                plain += 1
                if req.spec_token_ids:
                    req.spec_token_ids = []
                out_ids = req.output_token_ids
                out_ids.append(tok)
                all_ids = req.all_token_ids
                all_ids.append(tok)
                done = None
                if tok in req.stop_ids:
                    # The first min_tokens tokens never stop generation (the sampler masks them).
                    if len(out_ids) > req.params.min_tokens:
                        req.stop_token = tok
                        done = RequestStatus.FINISHED_STOPPED
                if done is None and len(all_ids) >= req.token_limit:
                    done = RequestStatus.FINISHED_LENGTH
            req.last_token_time = now
            if done:
                self._finish(req, done, now)
                finished.append(req)
        self.num_decode_tokens_computed += plain
        self.num_generated_tokens += plain
        self.last_update_skipped = skipped
        return finished

    def _update_general(self, req: Request, s: ScheduledSeq, toks) -> RequestStatus | None:
        """Prefill completions, speculative verifications and list-shaped results."""
        # Plain Python ints go into the token lists: numpy/torch scalars would leak into outputs.
        toks = [int(t) for t in toks] if hasattr(toks, "__len__") else [int(toks)]
        if s.is_prefill:
            self.num_prefill_tokens_computed += s.num_new_tokens
        else:
            self.num_decode_tokens_computed += s.num_new_tokens
        if s.num_spec_tokens:
            accepted = len(toks) - 1
            assert 0 <= accepted <= s.num_spec_tokens, (toks, s.num_spec_tokens)
            rejected = s.num_spec_tokens - accepted
            self.block_manager.rollback(req, rejected)
            req.num_computed_tokens += s.num_new_tokens - rejected
            req.num_draft_tokens += s.num_spec_tokens
            req.num_accepted_draft_tokens += accepted
            self.num_draft_tokens += s.num_spec_tokens
            self.num_accepted_draft_tokens += accepted
        else:
            req.num_computed_tokens += s.num_new_tokens
            assert len(toks) == 1, f"{len(toks)} tokens sampled without drafts"
        if req.spec_token_ids:
            req.spec_token_ids = []
        for tok in toks:                 # tokens after a finishing one are dropped
            req.output_token_ids.append(tok)
            req.all_token_ids.append(tok)
            self.num_generated_tokens += 1
            if tok in req.stop_ids and len(req.output_token_ids) > req.params.min_tokens:
                req.stop_token = tok
                return RequestStatus.FINISHED_STOPPED
            if len(req.all_token_ids) >= req.token_limit:
                return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, req: Request, status: RequestStatus, now: float) -> None:
        self.running.remove(req)
        self.block_manager.free(req)
        req.status = status
        req.finished_time = now
        req.spec_token_ids = []
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)


__all__ = ["StepResults"]
