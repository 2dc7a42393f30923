"""Triton's batch dimension on Kiln's models: NVIDIA's layout (``max_batch_size`` > 0).

NVIDIA's inflight_batcher_llm models declare ``max_batch_size: ${triton_max_batch_size}``, so every
client of theirs sends ``[B, ...]`` tensors (``[1, 1]`` for a scalar, ``[1, L]`` for a prompt) and
reads ``[B, ...]`` outputs (``output_ids`` ``[B, beams, len]``). Kiln declares the same. Triton never
merges requests into one batch here (no dynamic batcher: the engine batches in flight, across
requests), so B is what one client put in one request; Kiln takes B = 1 and refuses more with an
error that says what to do, instead of answering one row and dropping the others.

Pure numpy: the models strip the batch dimension on the way in (:func:`unbatch`) so that the rest
of the serving code reads per-request tensors, and add it on the way out (:func:`batched`).
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from backend.serving.convert import InvalidRequest

__all__ = ["unbatch", "batched", "batched_all"]


def unbatch(tensors: Mapping[str, np.ndarray], model: str) -> dict[str, np.ndarray]:
    """``{name: [1, *dims]}`` -> ``{name: [*dims]}``; a tensor with another batch size is refused."""
    out = {}
    for name, arr in tensors.items():
        a = np.asarray(arr)
        if a.ndim == 0 or a.shape[0] != 1:
            got = "no batch dimension" if a.ndim == 0 else f"batch size {a.shape[0]}"
            raise InvalidRequest(
                f"input '{name}' of model '{model}': {got} (shape {list(a.shape)}); Kiln takes one "
                "sequence per request (batch size 1: shape [1, ...]) and batches requests in flight "
                "itself: send the rows as separate requests")
        out[name] = a[0]
    return out


def batched(arr: np.ndarray | list, dtype=None) -> np.ndarray:
    """One request's output -> ``[1, *dims]``."""
    return np.asarray(arr, dtype=dtype)[None]


def batched_all(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: batched(v) for k, v in tensors.items()}
