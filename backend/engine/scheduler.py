"""Iteration-level (continuous) batching scheduler (pure Python, no torch).

Every ``schedule()`` re-forms the batch within ``max_num_tokens`` (tokens computed this step) and
``max_batch_size`` (sequences running at once), in this order:

1. running decodes (one token each, plus draft tokens when speculative decoding proposed some),
2. running prefills that continue a chunked prompt,
3. new or preempted requests, highest priority first, FCFS among equals; admission stops at the
   first request that does not fit (skipping it would starve long prompts).

Running requests are kept sorted by (priority desc, arrival), so the preemption victim when blocks
run out is always the tail: the lowest-priority, latest request. Preemption is by recompute: its
blocks are freed (full ones stay in the prefix cache, which usually makes the recompute cheap) and it
goes back to the waiting queue with its original place.

Admission policies live in ``scheduler_policies.py`` (``POLICIES``: ``max_utilization``,
``guaranteed_no_evict``); the step's data types and the waiting queue in ``scheduler_types.py``;
applying a step's sampled tokens (``update``) in ``scheduler_update.py``.

The executor calls ``schedule()``, runs the model on the returned ``SchedulerOutput``, samples one
token (or, with speculation, the accepted drafts plus one) per sequence whose ``sample`` flag is set,
and calls ``update(output, sampled)``.
"""
from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable

from backend.engine.kv_cache import BlockManager
from backend.engine.request import Request, RequestStatus
from backend.engine.sampling_params import room_problem
from backend.engine.scheduler_policies import POLICIES, GuaranteedNoEvict, MaxUtilization
from backend.engine.scheduler_types import ScheduledSeq, SchedulerOutput, WaitingQueue
from backend.engine.scheduler_update import StepResults

_RUNNING = RequestStatus.RUNNING


def _sort_key(req: Request) -> tuple[int, int]:
    return (-req.priority, req.arrival_seq)


class Scheduler(StepResults):
    def __init__(self, block_manager: BlockManager, max_batch_size: int, max_num_tokens: int,
                 policy: str = "max_utilization", enable_chunked_prefill: bool = True,
                 max_seq_len: int | None = None, eos_token_ids: Iterable[int] = (),
                 clock: Callable[[], float] = time.monotonic) -> None:
        if policy not in POLICIES:
            raise ValueError(f"engine.scheduler_policy: {policy!r}; allowed: {', '.join(POLICIES)}")
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"engine.max_batch_size: {max_batch_size!r}; allowed: an integer >= 1")
        if not isinstance(max_num_tokens, int) or max_num_tokens < 1:
            raise ValueError(f"engine.max_num_tokens: {max_num_tokens!r}; allowed: an integer >= 1")
        self.block_manager = block_manager
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.policy = POLICIES[policy]()
        self.policy_name = policy
        self.enable_chunked_prefill = enable_chunked_prefill
        capacity = block_manager.num_blocks * block_manager.block_size
        self.max_seq_len = capacity if max_seq_len is None else max_seq_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.clock = clock
        self.running: list[Request] = []          # sorted by (priority desc, arrival)
        self.waiting = WaitingQueue()
        self.requests: dict[str, Request] = {}    # every unfinished request
        self._finished_ids: list[str] = []
        self._next_seq = 0
        # Counters.
        self.num_steps = 0
        self.peak_scheduled = 0     # most sequences in one step so far (what bounded concurrency shows here)
        self.num_preemptions = 0
        self.num_prefill_tokens_computed = 0
        self.num_decode_tokens_computed = 0
        self.num_generated_tokens = 0
        self.num_draft_tokens = 0
        self.num_accepted_draft_tokens = 0
        self.last_update_skipped = 0    # scheduler_update.py
        # The last iteration (a schedule() that ran something): what NVIDIA's inflight batcher
        # reports per iteration. (scheduled, context requests, context tokens, generation requests,
        # requests paused = preempted, its wall-clock time in seconds)
        self.last_iteration: tuple[int, int, int, int, int, float] = (0, 0, 0, 0, 0, 0.0)

    # -- sizes --------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def blocks_for_life(self, request: Request) -> int:
        """KV blocks ``request`` holds at most at once (its ``token_limit``: prompt + max_tokens, capped;
        with a sliding window on every layer, the window's and one step's: kv_cache.py)."""
        return self.block_manager.most_blocks(request.token_limit, self.max_num_tokens)

    # -- queue operations ---------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a request. Raises ValueError (nothing queued) when it can never be served."""
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already in use by an unfinished request")
        n = request.num_prompt_tokens
        if n >= self.max_seq_len:
            raise ValueError(f"request {rid!r}: prompt of {n} tokens (max_seq_len {self.max_seq_len}): "
                             f"{room_problem(1, self.max_seq_len - n)}")
        if not self.enable_chunked_prefill and n > self.max_num_tokens:
            raise ValueError(f"request {rid!r}: prompt of {n} tokens exceeds engine.max_num_tokens "
                             f"({self.max_num_tokens}) and chunked prefill is off")
        bm = self.block_manager
        capacity = bm.num_blocks * bm.block_size
        limit = min(n + request.params.max_tokens, self.max_seq_len)
        if bm.most_blocks(limit, self.max_num_tokens) > bm.num_blocks:
            raise ValueError(f"request {rid!r}: prompt + max_tokens = {limit} "
                             f"tokens can never fit the KV cache of {capacity} tokens")
        if request.status is not RequestStatus.WAITING:
            raise ValueError(f"request {rid!r}: status {request.status.name}; allowed: WAITING")
        stops = set(request.params.stop_token_ids)
        if not request.params.ignore_eos:
            stops |= self.eos_token_ids
        request.stop_ids = frozenset(stops)
        request.token_limit = limit
        request.arrival_seq = self._next_seq
        self._next_seq += 1
        self.requests[rid] = request
        self.waiting.push(request)

    def abort(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED,
              error: str | None = None) -> Request | None:
        """Finish a request at any point (cancel, or ``FINISHED_ERROR`` with ``error``) and free its
        blocks. Returns the request, or None when it is unknown or already finished."""
        assert status.is_finished
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status is _RUNNING:
            self.running.remove(req)
        else:
            self.waiting.discard(req)
        self.block_manager.free(req)
        req.status = status
        req.error = error
        req.finished_time = self.clock()
        req.spec_token_ids = []
        self._finished_ids.append(request_id)
        return req

    # -- scheduling ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        bm = self.block_manager
        budget = self.max_num_tokens
        running = self.running
        decodes: list[ScheduledSeq] = []
        prefills: list[ScheduledSeq] = []
        preempted: list[Request] = []
        continuing: list[Request] = []
        append_slots = bm.append_slots

        # 1. Running decodes (exactly the last sampled token lacks KV). This loop runs for every
        # sequence every step: the common case is kept to a few attribute reads and writes.
        spec_total = 0
        decodes_append = decodes.append
        i = 0                            # how many running requests this loop looked at
        # Iterating while _preempt_tail pops the list's tail is safe: iteration just ends sooner.
        for req in running:
            if budget <= 0:
                break
            i += 1
            num_tokens = len(req.all_token_ids)
            start = req.num_computed_tokens
            if num_tokens - start != 1 or not req.output_token_ids:
                continuing.append(req)   # still prefilling (its last prompt token included)
                continue
            k = len(req.spec_token_ids)
            if k:
                # No draft past the request's end or the step budget.
                k = max(min(k, req.token_limit - num_tokens - 1, budget - 1), 0)
                budget -= k
                spec_total += k
            if not k and num_tokens <= req.slot_room:
                # The slot is in the last block and no block awaits its hash (what slot_room says,
                # kv_cache.py): all that BlockManager.append_slots(req, 1) would do is this.
                req.num_slots = num_tokens
            else:
                while not append_slots(req, 1, k):
                    if self._preempt_tail(req, decodes, prefills, preempted):
                        break
                if req.status is not _RUNNING:
                    budget += k          # (its drafts are not run either)
                    spec_total -= k
                    break                # it was the tail itself: nothing after it remains
            # One ScheduledSeq per request, refreshed in place: building hundreds of objects per
            # step was a third of the host overhead. (An output is valid until the next schedule.)
            seq = req.sched_seq
            if seq is None:
                seq = req.sched_seq = ScheduledSeq(req, start, 1 + k, False, True, k)
            else:
                seq.start_pos = start
                if seq.num_spec_tokens != k:
                    seq.num_new_tokens = 1 + k
                    seq.num_spec_tokens = k
            decodes_append(seq)
            budget -= 1
        # Running requests past the budget may still be prefilling: pick them up too.
        for req in running[i:]:
            if len(req.all_token_ids) - req.num_computed_tokens > 1 or not req.output_token_ids:
                continuing.append(req)

        # 2. Running prefills continuing a chunked prompt.
        for req in continuing:
            if budget <= 0:
                break
            if req.status is not _RUNNING:
                continue                 # preempted above
            start = req.num_computed_tokens
            remaining = len(req.all_token_ids) - start
            n = min(remaining, budget)
            while not append_slots(req, n):
                if self._preempt_tail(req, decodes, prefills, preempted):
                    break
            if req.status is not _RUNNING:
                continue
            prefills.append(ScheduledSeq(req, start, n, True, n == remaining))
            budget -= n

        # 3. New and preempted requests (not in a step that had to preempt: no room anyway).
        if not preempted:
            budget = self._admit(budget, prefills)

        # Counting and output.
        num_prefill_tokens = 0
        for s in prefills:
            num_prefill_tokens += s.num_new_tokens
        if preempted:
            # Victims may have been unscheduled after their tokens were counted: recount.
            num_decode_tokens = sum(s.num_new_tokens for s in decodes)
            spec_total = sum(s.num_spec_tokens for s in decodes)
        else:
            num_decode_tokens = self.max_num_tokens - budget - num_prefill_tokens
        out = SchedulerOutput(prefills + decodes, preempted, self._finished_ids, len(prefills),
                              num_prefill_tokens, num_decode_tokens, spec_total)
        self._finished_ids = []
        if out.scheduled:
            self.num_steps += 1
            self.peak_scheduled = max(self.peak_scheduled, len(out.scheduled))
            self.last_iteration = (len(out.scheduled), len(prefills), num_prefill_tokens, len(decodes),
                                   len(preempted), time.time())
        assert out.num_tokens <= self.max_num_tokens and len(out.scheduled) <= self.max_batch_size
        return out

    def _admit(self, budget: int, prefills: list[ScheduledSeq]) -> int:
        bm = self.block_manager
        running = self.running
        policy = self.policy
        waiting = self.waiting
        if budget > 0 and waiting and len(running) < self.max_batch_size:
            policy.begin(self)
        while budget > 0 and len(running) < self.max_batch_size:
            req = waiting.peek()
            if req is None:
                break
            length = len(req.all_token_ids)
            # A recompute after preemption may be chunked even when chunking is off: its prompt now
            # includes generated tokens and might never fit one step.
            if not self.enable_chunked_prefill and req.num_preemptions == 0:
                if length - bm.lookup(req) > budget:
                    break
            if not policy.admit(self, req):
                break
            cached = bm.allocate_for(req, budget)
            if cached is None:
                break
            waiting.pop()
            req.status = _RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = self.clock()
            bisect.insort(running, req, key=_sort_key)
            policy.admitted(self, req)
            n = req.num_slots - cached
            # The first computation of a request is a prefill even when it is one token long.
            prefills.append(ScheduledSeq(req, cached, n, True, cached + n == length))
            budget -= n
        return budget

    def _preempt_tail(self, needy: Request, decodes: list[ScheduledSeq],
                      prefills: list[ScheduledSeq], preempted: list[Request]) -> bool:
        """Preempt the lowest-priority, latest running request to free blocks for ``needy``.
        Returns True when ``needy`` itself was the victim (the caller stops trying)."""
        victim = self.running.pop()
        for lst in (decodes, prefills):
            for j, s in enumerate(lst):
                if s.request is victim:  # already scheduled this step: unschedule it
                    del lst[j]
                    break
        self.block_manager.free(victim)
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(victim)
        preempted.append(victim)
        return victim is needy

    def stats(self) -> dict:
        out = {"running": len(self.running), "waiting": len(self.waiting),
               "steps": self.num_steps, "peak_scheduled": self.peak_scheduled, "preemptions": self.num_preemptions,
               "prefill_tokens_computed": self.num_prefill_tokens_computed,
               "decode_tokens_computed": self.num_decode_tokens_computed,
               "generated_tokens": self.num_generated_tokens,
               "draft_tokens": self.num_draft_tokens,
               "accepted_draft_tokens": self.num_accepted_draft_tokens,
               "max_batch_size": self.max_batch_size}
        # The last iteration's figures, or zeros once nothing is left to run (the loop then stops
        # scheduling, and the last busy iteration no longer describes the engine).
        busy = bool(self.requests)
        sched, ctx, ctx_tokens, gen, paused, when = self.last_iteration
        out.update({"iter_scheduled": sched if busy else 0, "iter_context_requests": ctx if busy else 0,
                    "iter_context_tokens": ctx_tokens if busy else 0,
                    "iter_generation_requests": gen if busy else 0, "iter_paused": paused if busy else 0,
                    "iter_time": when})
        out.update(self.block_manager.stats())
        return out


__all__ = ["POLICIES", "GuaranteedNoEvict", "MaxUtilization", "ScheduledSeq", "Scheduler",
           "SchedulerOutput", "WaitingQueue"]
