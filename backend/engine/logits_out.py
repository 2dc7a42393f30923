"""Logits a request asked to get back (TensorRT-LLM's ``return_context_logits`` /
``return_generation_logits``), taken out of a step's logits without touching the other requests.

* Context logits: the step computes the LM head at every prompt position of a prefill chunk that asks
  (``context_rows``: its rows are appended after the sampling rows of ``logits_indices``);
  ``stash_context`` moves them to the host into ``Request.context_logits`` and hands the sampling
  rows on. They leave with the request's first token (``take_context``): ``[prompt, vocab]``.
* Generation logits: the raw logits row each generated token was sampled from (before bias, masks,
  penalties and temperature, as TensorRT-LLM returns them), ``[tokens, vocab]`` per event.
  ``generation_rows`` picks the rows of the requests that ask; speculative drafts are ruled out for
  them (``backend/speculative/accept.py``), so each has exactly one row.

Both are fp32 on the host; only steps that hold such a request pay for the copies.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

__all__ = ["context_rows", "stash_context", "take_context", "generation_rows"]


def context_rows(prefills: Sequence, qsl: np.ndarray):
    """For the prefill chunks whose request wants context logits: ``([(request, first position,
    count)], token rows of the step)``, or None when none does (the common case: one attribute read
    per prefill). Positions already collected (a recompute after preemption) and output tokens
    (recomputed after the prompt) are left out."""
    spans, rows = [], []
    for i, s in enumerate(prefills):
        req = s.request
        if req.context_logits is None:
            continue
        lo = max(s.start_pos, req.num_context_logits)
        hi = min(s.start_pos + s.num_new_tokens, len(req.prompt_token_ids))
        if hi <= lo:
            continue
        base = int(qsl[i]) - s.start_pos
        spans.append((req, lo, hi - lo))
        rows.append(np.arange(base + lo, base + hi, dtype=np.int64))
    if not spans:
        return None
    return spans, np.concatenate(rows)


def stash_context(logits: torch.Tensor, spans: list) -> torch.Tensor:
    """Move the context rows (the last ones of ``logits``) to their requests; return the rest."""
    total = sum(n for _, _, n in spans)
    keep = logits.shape[0] - total
    host = logits[keep:].float().cpu()       # one copy for the step
    off = 0
    for req, lo, n in spans:
        req.context_logits.append(host[off:off + n])
        req.num_context_logits = lo + n
        off += n
    return logits[:keep]


def take_context(req) -> torch.Tensor | None:
    """The request's context logits ``[prompt, vocab]``, once: with its first generated token."""
    chunks = req.context_logits
    if not chunks or req.num_context_logits < len(req.prompt_token_ids):
        return None
    req.context_logits = []
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


def generation_rows(requests: Sequence, counts: Sequence[int] | None) -> list[tuple[int, int]]:
    """``[(index in requests, logits row)]`` of the sampling requests that want generation logits;
    ``counts``: logits rows per request (1 + drafts), None when all are 1."""
    out = []
    row = 0
    for i, req in enumerate(requests):
        if req.params.return_generation_logits:
            out.append((i, row))
        row += 1 if counts is None else counts[i]
    return out
