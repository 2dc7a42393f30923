"""Per-request speculative-decoding figures as Triton tensors (tensorrtllm_backend's names).

The engine model adds ``acceptance_rate`` (FP32), ``total_accepted_draft_tokens`` (INT32) and
``total_draft_tokens`` (INT32), each shape ``[1]``, to EVERY response of a request that sets
``return_perf_metrics``: cumulative counts so far, so the final response carries the request's
totals (tensorrtllm_backend fills its perf-metric outputs the same way). A request that did not
speculate (no draft in the bundle, a per-request opt-out, sampling options that rule drafts out,
or too few tokens to draft) reports zeros, and a rate of 0.0 rather than a division by zero.

Pure numpy: no Triton, no torch.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

__all__ = ["ACCEPTANCE_OUTPUTS", "acceptance_tensors", "draft_counts", "read_acceptance"]

ACCEPTANCE_OUTPUTS = ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens")


def draft_counts(executor: Any, request_id: str) -> tuple[int, int]:
    """(draft tokens the target scored, draft tokens it kept) for one request so far.

    Read from the executor's speculator, which keeps them per request after the request ends
    (``backend/speculative/speculator.py`` ``request_stats``). Call it from the executor's thread (the
    event callback) so the numbers belong to the step whose tokens are being sent.
    """
    spec = getattr(executor, "speculator", None)
    if spec is None:
        return 0, 0
    # No assert here: this runs in the executor's callback, where an exception would cost the
    # request its final response; the scheduler already checks accepted <= proposed per step.
    s = spec.request_stats(request_id)
    return int(s.get("draft_tokens_proposed", 0)), int(s.get("draft_tokens_accepted", 0))


def acceptance_tensors(proposed: int, accepted: int) -> dict[str, np.ndarray]:
    """The three output tensors for the given counts."""
    rate = accepted / proposed if proposed else 0.0
    return {
        "acceptance_rate": np.array([rate], dtype=np.float32),
        "total_accepted_draft_tokens": np.array([accepted], dtype=np.int32),
        "total_draft_tokens": np.array([proposed], dtype=np.int32),
    }


def read_acceptance(tensors: Mapping[str, Any], prefix: str = "") -> dict[str, float | int] | None:
    """The figures from a response's tensors (``prefix`` + name), or None when it has none of them.

    Accepts numpy arrays of any shape with one element (clients may add a batch dimension)."""
    got = {n: tensors.get(prefix + n) for n in ACCEPTANCE_OUTPUTS}
    if all(v is None for v in got.values()):
        return None
    missing = [n for n, v in got.items() if v is None]
    if missing:
        raise ValueError(f"response has {', '.join(n for n in got if n not in missing)} but not "
                         f"{', '.join(missing)}; the three acceptance outputs travel together")
    one = {n: np.asarray(v).reshape(-1) for n, v in got.items()}
    bad = [n for n, v in one.items() if v.size != 1]
    if bad:
        raise ValueError(f"output '{prefix + bad[0]}': expected one value, got shape {list(np.shape(got[bad[0]]))}")
    return {"acceptance_rate": float(one["acceptance_rate"][0]),
            "total_accepted_draft_tokens": int(one["total_accepted_draft_tokens"][0]),
            "total_draft_tokens": int(one["total_draft_tokens"][0])}
