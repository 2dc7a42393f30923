"""One engine request's state in the engine model (``engine_host.py``), and small helpers it uses.

A :class:`Stream` is one sequence: a Triton request with batch size 1, or one row of a request with
batch size B > 1 (then ``group`` ties the rows together, ``row_group.py``). Its fields are read and
written under its ``lock``: by the executor's thread (events), the poller (cancellation, shutdown)
and ``execute()`` (stop requests).
"""
from __future__ import annotations

import dataclasses
import json
import threading
from typing import Any

import numpy as np

from backend.serving.metrics.acceptance import acceptance_tensors
from backend.serving.conversion.detok import StreamDetokenizer
from backend.serving.engine_model.engine_outputs import response_tensors
from backend.serving.engine_model.engine_request import EngineRequest
from backend.serving.metrics.perf_metrics import perf_tensors
from backend.serving.engine_model.row_group import RowGroup

__all__ = ["Stream", "chosen_logprobs", "inband_errors", "INBAND_ERRORS"]

INBAND_ERRORS = "kiln_inband_errors"  # request parameter: end with a data response, never an error one


def chosen_logprobs(event: Any) -> list[float]:
    """Log-probability of each generated token of an executor event, whatever shape it has."""
    lps = getattr(event, "logprobs", None)
    if not lps:
        return []
    out = []
    for tok, lp in zip(event.token_ids, lps):
        if isinstance(lp, (int, float)):
            out.append(float(lp))
        elif isinstance(lp, dict):
            out.append(float(lp.get(tok, next(iter(lp.values())))))
        elif isinstance(lp, (list, tuple)) and lp:
            first = lp[0]
            out.append(float(first[1] if isinstance(first, (list, tuple)) else first))
        else:
            out.append(float(getattr(lp, "logprob", np.nan)))
    return out


@dataclasses.dataclass
class Stream:
    rid: str
    triton_id: str          # the Triton request id (a stop request names it)
    request: Any
    sender: Any
    req: EngineRequest
    detok: StreamDetokenizer
    arrival: float
    first: float | None = None
    last: float | None = None
    n_tokens: int = 0
    ids: list[int] = dataclasses.field(default_factory=list)       # non-streaming: all sent ids
    text: str = ""          # non-streaming: their text (the detokenizer's chunks, joined)
    logprobs: list[float] = dataclasses.field(default_factory=list)  # not yet sent
    cum_logprob: float = 0.0  # of every generated token so far (NVIDIA's cum_log_probs)
    context_logits: Any = None  # [prompt, vocab] numpy, until the response that carries it
    gen_logits: list = dataclasses.field(default_factory=list)  # [n, vocab] numpy chunks not yet sent
    top: list = dataclasses.field(default_factory=list)  # per token not yet sent: [(id, logprob)] * k
    trim: int = 0
    cancel_asked: bool = False
    cancel_by: str = ""     # "client" (went away), "stop" (a stop_request), "text" (a stop string)
    inband: bool = False    # errors as a final data response (INBAND_ERRORS)
    engine_req: Any = None  # the executor's Request, from its events (perf figures; executor thread only)
    done: bool = False
    sent: bool = False      # a response went out (an ensemble may be running a later step on it)
    group: RowGroup | None = None  # the rows of a request with batch size > 1 (row_group.py)
    row: int = 0            # this stream's row in it (NVIDIA's batch_index)
    wanted: frozenset | None = None  # the outputs its request asked for (None: all): engine_outputs.requested_outputs
    # reentrant: a failed inline send (no responder thread) calls back under the lock its caller holds
    lock: threading.RLock = dataclasses.field(default_factory=threading.RLock)

    def record(self, ev: Any, now: float) -> int:
        """Keep what an executor event brings (its tokens' times, log-probs, top alternatives and
        logits, until a response takes them); returns the number of new tokens."""
        if getattr(ev, "request", None) is not None:
            self.engine_req = ev.request
        if ev.token_ids:
            self.first = self.first or now
            self.last = now
            self.n_tokens += len(ev.token_ids)
            if self.req.return_log_probs:
                self.logprobs.extend(chosen_logprobs(ev))
            if self.req.top_logprobs:
                self.keep_top(ev)
        self.keep_logits(ev)
        return len(ev.token_ids)

    def outputs(self, ids, context, trim: int, reason: str, text: str = "",
                draft: tuple[int, int] | None = None) -> dict[str, np.ndarray]:
        """The tensors of the response carrying ``ids`` (``engine_outputs.response_tensors``): it
        takes every pending log-prob, top alternative and logits row (chunks take every pending
        token), plus the counts and figures the request asked for; ``draft``: the executor's
        (proposed, accepted) draft-token counts, for ``return_perf_metrics``."""
        lp, self.logprobs = self.logprobs, []
        self.cum_logprob += float(sum(lp))
        req, extra = self.req, {}
        if req.top_logprobs:
            extra.update(self.take_top())
        if req.return_num_input_tokens:
            extra["num_input_tokens"] = np.array([len(req.prompt_ids)], np.int32)
        if req.return_num_output_tokens:  # generated ids only (a non-streamed output_ids starts with the prompt)
            echoed = not req.streaming and not req.exclude_input_in_output
            extra["num_output_tokens"] = np.array([len(ids) - (len(req.prompt_ids) if echoed else 0)], np.int32)
        if req.return_perf_metrics:  # cumulative on every response, as tensorrtllm_backend does
            extra.update(acceptance_tensors(*(draft or (0, 0))))
            extra.update(perf_tensors(self.engine_req))
        return response_tensors(ids, context, trim, lp, self.cum_logprob, reason, text, extra, self.row,
                                *self.take_logits())

    def keep_top(self, ev: Any) -> None:
        """The top alternatives of each token of an event (``top_logprobs`` requests)."""
        k = self.req.top_logprobs
        for lp in (getattr(ev, "logprobs", None) or [None] * len(ev.token_ids)):
            alts = lp[1] if isinstance(lp, (list, tuple)) and len(lp) == 2 and isinstance(lp[1], list) else []
            self.top.append(list(alts[:k]) + [(-1, float("-inf"))] * (k - len(alts[:k])))

    def take_top(self) -> dict[str, np.ndarray]:
        """``output_top_ids`` INT32 / ``output_top_logprobs`` FP32, ``[1, n, k]`` (batch added later)."""
        k = self.req.top_logprobs
        top, self.top = self.top, []
        ids = np.array([[t for t, _ in row] for row in top], np.int32).reshape(1, len(top), k)
        vals = np.array([[v for _, v in row] for row in top], np.float32).reshape(1, len(top), k)
        return {"output_top_ids": ids, "output_top_logprobs": vals}

    def keep_logits(self, ev: Any) -> None:
        """An executor event's logits (present only when the request asked), until they are sent."""
        if getattr(ev, "generation_logits", None) is not None:
            self.gen_logits.append(ev.generation_logits.numpy())
        if getattr(ev, "context_logits", None) is not None:
            self.context_logits = ev.context_logits.numpy()

    def take_logits(self) -> tuple[Any, Any]:
        """(context logits, generation logits) for the response going out: like the log-probs, it
        takes every pending token's row (the detokenizer may have held tokens back)."""
        ctx, self.context_logits = self.context_logits, None
        gen = None
        if self.gen_logits:
            gen = self.gen_logits[0] if len(self.gen_logits) == 1 else np.concatenate(self.gen_logits)
            self.gen_logits = []
        return ctx, gen


def inband_errors(request) -> bool:
    """Whether the request's parameters ask for in-band errors (INBAND_ERRORS: true)."""
    try:
        return json.loads(request.parameters() or "{}").get(INBAND_ERRORS) is True
    except Exception:  # noqa: BLE001 - unreadable parameters: the default
        return False
