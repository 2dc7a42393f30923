"""Request state for in-flight batching (pure Python, no torch).

Life cycle::

    WAITING --schedule--> RUNNING --update--> FINISHED_STOPPED | FINISHED_LENGTH
       ^                     |
       +----PREEMPTED <------+   (blocks ran out: KV dropped, recomputed on re-admission)
    any state --abort--> FINISHED_ABORTED ; executor failure --> FINISHED_ERROR

Token accounting: ``all_token_ids`` = prompt + accepted output tokens. ``num_computed_tokens`` is
how many of them have their KV in the cache. A request needs ``num_tokens - num_computed_tokens``
tokens computed next: many while prefilling, exactly one while decoding (the last sampled token),
plus ``spec_token_ids`` (draft tokens proposed by a speculative method, scored tentatively).
After preemption ``num_computed_tokens`` drops to 0 and the prompt to recompute is the whole
``all_token_ids`` (outputs are kept; prefix-cache hits usually make that cheap).
"""
from __future__ import annotations

import enum
import time

from backend.engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


# Statuses from here on are final: ``status >= FINAL`` is the hot loops' form of ``is_finished`` (an int
# comparison per request per step, not a property call)
FINAL = RequestStatus.FINISHED_STOPPED

# The finish_reason strings of the executor contract (docs/contracts.md section 4).
FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "cancelled",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    # __slots__: the scheduler touches hundreds of these per step; attribute access is the hot path.
    __slots__ = (
        "request_id", "prompt_token_ids", "params", "arrival_time", "arrival_seq", "priority",
        "all_token_ids", "output_token_ids", "output_logprobs", "status", "num_computed_tokens",
        "num_cached_tokens", "block_ids", "block_hashes", "num_committed_blocks", "num_slots",
        "num_tentative_tokens",
        "spec_token_ids", "num_draft_tokens", "num_accepted_draft_tokens", "stop_ids",
        "first_scheduled_time", "first_token_time", "last_token_time", "finished_time",
        "num_preemptions", "error", "stop_token", "token_limit", "sched_seq", "num_new_blocks",
        "num_reused_blocks", "context_logits", "num_context_logits", "sample_row", "slot_room",
        "num_released_blocks", "window_kv",
    )

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float | None = None) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: prompt_token_ids is empty; "
                             "allowed: at least one token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.arrival_seq = -1              # set by the scheduler: FCFS tie-break among equal priority
        self.priority = params.priority
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.output_logprobs: list = []    # filled by the executor when params.logprobs > 0
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0         # prompt tokens served from the prefix cache (last admission)
        # KV bookkeeping owned by the BlockManager (stored here so the hot path avoids dict lookups).
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hash of each FULL block of all_token_ids
        self.num_committed_blocks = 0      # leading blocks whose hash is registered in the cache
        self.num_released_blocks = 0       # leading blocks given back: behind every layer's window
        self.window_kv = None              # the sliding layers' blocks when they have a pool of their own
        self.num_slots = 0                 # KV slots reserved (computed + in flight + tentative)
        self.num_tentative_tokens = 0      # slots reserved for unverified speculative tokens
        self.slot_room = 0                 # tokens the scheduler may reserve without the manager
        # Speculative decoding: drafts to score next step, and acceptance statistics.
        self.spec_token_ids: list[int] = []
        self.num_draft_tokens = 0
        self.num_accepted_draft_tokens = 0
        # KV blocks over the request's life, re-admissions after preemption included (the
        # per-request figures of tensorrtllm_backend's return_perf_metrics): blocks taken from the
        # pool, and prefix-cache blocks reused instead of computed
        self.num_new_blocks = 0
        self.num_reused_blocks = 0
        self.stop_ids: frozenset[int] = frozenset(params.stop_token_ids)  # scheduler adds eos
        # ``token_limit``, the most tokens (prompt + output) it may reach, is set once by
        # ``Scheduler.add``, which knows max_seq_len: min(prompt + max_tokens, max_seq_len).
        self.sched_seq = None              # the scheduler's reusable ScheduledSeq for decode steps
        self.sample_row = None             # the executor's SampleRow, made at the first sample
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None
        self.num_preemptions = 0
        self.error: str | None = None
        self.stop_token: int | None = None  # the stop/eos token that ended generation, if any
        # params.return_context_logits: host fp32 chunks [n, vocab] of prompt positions 0.. collected
        # so far (a recompute after preemption does not collect them again), sent with the first token
        self.context_logits: list | None = [] if params.return_context_logits else None
        self.num_context_logits = 0

    # -- sizes ------------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """The next step is (part of) a prefill: more than the last token lacks KV, or nothing has
        been sampled yet (a prompt's last token is still prefill). Same rule as the scheduler."""
        return len(self.all_token_ids) - self.num_computed_tokens > 1 or not self.output_token_ids

    # -- status -----------------------------------------------------------------------------
    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    # -- latency metrics ----------------------------------------------------------------------
    @property
    def ttft(self) -> float | None:
        """Time to first token (seconds since arrival)."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (seconds)."""
        n = len(self.output_token_ids)
        if n < 2 or self.first_token_time is None or self.last_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (n - 1)

    @property
    def acceptance_rate(self) -> float:
        if self.num_draft_tokens == 0:
            return 0.0
        return self.num_accepted_draft_tokens / self.num_draft_tokens

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={len(self.block_ids)})")


__all__ = ["FINAL", "FINISH_REASONS", "Request", "RequestStatus"]
