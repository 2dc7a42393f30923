"""Postprocessing: one engine response -> ``text_output`` (stateless; see detok.py for why)."""
from __future__ import annotations

from typing import Mapping

import numpy as np

from backend.serving.acceptance import acceptance_tensors, read_acceptance
from backend.serving.convert import decode_text
from backend.serving.detok import Decoder, decode_piece

__all__ = ["postprocess", "postprocess_tensors"]


def postprocess(tok: Decoder, output_ids: list[int], context_ids: list[int], trim: int,
                echo_text: str = "") -> str:
    piece = decode_piece(tok, context_ids, output_ids)
    if trim > 0:
        piece = piece[: max(len(piece) - trim, 0)]
    return echo_text + piece


def _ids(arr: np.ndarray | None) -> list[int]:
    return [] if arr is None else [int(t) for t in np.asarray(arr).reshape(-1)]


def postprocess_tensors(tok: Decoder, t: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Tensors of the ``postprocessing`` model in and out."""
    trim = int(np.asarray(t["text_trim"]).reshape(-1)[0]) if t.get("text_trim") is not None else 0
    echo = t.get("echo_text")
    echo_text = decode_text("echo_text", np.asarray(echo).reshape(-1)[0]) if echo is not None else ""
    text = postprocess(tok, _ids(t.get("output_ids")), _ids(t.get("context_ids")), trim, echo_text)
    lp = t.get("output_log_probs")
    out = {
        "text_output": np.array([text.encode("utf-8")], dtype=object),
        "out_log_probs": np.zeros(0, np.float32) if lp is None else np.asarray(lp, np.float32).reshape(-1),
    }
    # Always present: the ensemble forwards them and cannot answer while an output is missing.
    figures = read_acceptance(t)  # None only when a caller other than the ensemble sent none
    for name, zero in acceptance_tensors(0, 0).items():
        out["out_" + name] = zero if figures is None else np.array([figures[name]], zero.dtype)
    return out
