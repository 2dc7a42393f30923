"""Triton's batch dimension on Kiln's models: NVIDIA's layout (``max_batch_size`` > 0).

NVIDIA's inflight_batcher_llm models declare ``max_batch_size: ${triton_max_batch_size}``, so every
client of theirs sends ``[B, ...]`` tensors (``[1, 1]`` for a scalar, ``[1, L]`` for a prompt) and
reads ``[B, ...]`` outputs (``output_ids`` ``[B, beams, len]``). Kiln declares the same. Triton never
merges requests into one batch here (no dynamic batcher: the engine batches in flight, across
requests), so B is what one client put in one request (NVIDIA's ``--batch-inputs``).

Pure numpy: the models split a request into its rows on the way in (:func:`rows`; :func:`unbatch`
where only one row makes sense) so that the rest of the serving code reads one sequence's tensors,
and add the batch dimension on the way out (:func:`batched`, :func:`stack_rows`).
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from backend.serving.conversion.convert import InvalidRequest

__all__ = ["rows", "unbatch", "batched", "batched_all", "stack_rows"]


def rows(tensors: Mapping[str, np.ndarray], model: str) -> list[dict[str, np.ndarray]]:
    """``{name: [B, *dims]}`` -> B dicts ``{name: [*dims]}``; every tensor must have the same B."""
    sizes = {}
    for name, arr in tensors.items():
        a = np.asarray(arr)
        if a.ndim == 0:
            raise InvalidRequest(f"input '{name}' of model '{model}': no batch dimension (shape []); "
                                 "send [1, ...] for one sequence")
        sizes[name] = a.shape[0]
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"'{n}' {b}" for n, b in sizes.items())
        raise InvalidRequest(f"model '{model}': the inputs disagree on the batch size ({listed}); "
                             "every input needs one row per sequence")
    b = next(iter(sizes.values()), 1)
    if b == 0:
        raise InvalidRequest(f"model '{model}': batch size 0; send at least one row")
    return [{n: np.asarray(a)[i] for n, a in tensors.items()} for i in range(b)]


def stack_rows(per_row: list[Mapping[str, np.ndarray]], pad: Mapping[str, int | float] | None = None
               ) -> dict[str, np.ndarray]:
    """B dicts of one sequence's outputs -> ``{name: [B, *dims]}``, ragged last dimensions padded at
    the end with ``pad[name]`` (default 0; NVIDIA pads ``INPUT_ID`` with the pad id and word lists'
    offsets with -1; the lengths beside them say where each row ends)."""
    out = {}
    for name in per_row[0]:
        arrs = [np.asarray(r[name]) for r in per_row]
        width = max((a.shape[-1] if a.ndim else 0) for a in arrs)
        fill = (pad or {}).get(name, 0)
        padded = []
        for a in arrs:
            if a.ndim and a.shape[-1] < width:
                widths = [(0, 0)] * (a.ndim - 1) + [(0, width - a.shape[-1])]
                a = np.pad(a, widths, constant_values=fill) if a.dtype != object else \
                    np.concatenate([a, np.full(a.shape[:-1] + (width - a.shape[-1],), fill, dtype=object)], -1)
            padded.append(a)
        out[name] = np.stack(padded)
    return out


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
