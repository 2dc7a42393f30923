"""Postprocessing: one engine response -> text (stateless; see detok.py for why).

The ``postprocessing`` model speaks NVIDIA's names: ``TOKENS_BATCH`` (the engine's ``output_ids``,
``[1, beams, n]``) and ``SEQUENCE_LENGTH`` (``[1, beams]``) in, ``OUTPUT`` out: one string per
beam, 1-D (``[beams]``, as NVIDIA's postprocessing returns it: its clients read ``output[0]`` as the
text), each beam's first ``SEQUENCE_LENGTH`` ids decoded with special tokens skipped. Kiln's ensemble
adds optional inputs: ``context_ids`` (the ids before ``TOKENS_BATCH``, so that a streamed piece
decodes as a continuation: leading spaces, characters split across responses) and ``text_trim``
(characters to cut for a stop string), and passes the engine's log-probabilities and acceptance
figures through (a decoupled ensemble answers once every output exists, so they are always there).
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from backend.serving.acceptance import acceptance_tensors, read_acceptance
from backend.serving.convert import InvalidRequest
from backend.serving.detok import Decoder, decode_piece

__all__ = ["postprocess", "postprocess_tensors", "POSTPROCESSING_INPUTS"]

POSTPROCESSING_INPUTS = ("TOKENS_BATCH", "SEQUENCE_LENGTH", "context_ids", "text_trim", "output_log_probs",
                         "cum_log_probs", "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens")


def postprocess(tok: Decoder, output_ids: list[int], context_ids: list[int], trim: int) -> str:
    piece = decode_piece(tok, context_ids, output_ids)
    if trim > 0:
        piece = piece[: max(len(piece) - trim, 0)]
    return piece


def _ids(arr: np.ndarray | None) -> list[int]:
    return [] if arr is None else [int(t) for t in np.asarray(arr).reshape(-1)]


def _beams(tokens: np.ndarray, lengths: np.ndarray | None) -> list[list[int]]:
    """TOKENS_BATCH [1, beams, n] cut to SEQUENCE_LENGTH [1, beams]."""
    t = np.asarray(tokens)
    if t.ndim != 3 or t.shape[0] != 1:
        raise InvalidRequest(f"input 'TOKENS_BATCH': expected shape [1, beams, tokens] (one sequence per "
                             f"request), got {list(t.shape)}")
    beams = t[0]
    lens = np.asarray(lengths).reshape(-1) if lengths is not None else [beams.shape[1]] * beams.shape[0]
    return [[int(x) for x in beam[: max(0, min(int(n), beams.shape[1]))]] for beam, n in zip(beams, lens)]


def postprocess_tensors(tok: Decoder, t: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Tensors of the ``postprocessing`` model in and out (batch dimension included)."""
    trim = int(np.asarray(t["text_trim"]).reshape(-1)[0]) if t.get("text_trim") is not None else 0
    context = _ids(t.get("context_ids"))
    texts = [postprocess(tok, ids, context, trim) for ids in _beams(t["TOKENS_BATCH"], t.get("SEQUENCE_LENGTH"))]
    lp = t.get("output_log_probs")
    cum = t.get("cum_log_probs")
    out = {
        "OUTPUT": np.array([s.encode("utf-8") for s in texts], dtype=object),
        "OUT_OUTPUT_LOG_PROBS": (np.zeros((1, 1, 0), np.float32) if lp is None
                                 else np.asarray(lp, np.float32).reshape(1, 1, -1)),
        "OUT_CUM_LOG_PROBS": np.zeros((1, 1), np.float32) if cum is None else np.asarray(cum, np.float32).reshape(1, 1),
    }
    # Always present: the ensemble forwards them and cannot answer while an output is missing.
    figures = read_acceptance(t)  # None only when a caller other than the ensemble sent none
    for name, zero in acceptance_tensors(0, 0).items():
        out["out_" + name] = (zero if figures is None else np.array([figures[name]], zero.dtype))[None]
    return out
