"""Postprocessing: one engine response -> text (stateless; see detok.py for why).

The ``postprocessing`` model speaks NVIDIA's names: ``TOKENS_BATCH`` (the engine's ``output_ids``,
``[1, beams, n]``) and ``SEQUENCE_LENGTH`` (``[1, beams]``) in, ``OUTPUT`` out: one string per
beam, 1-D (``[beams]``, as NVIDIA's postprocessing returns it: its clients read ``output[0]`` as the
text), each beam's first ``SEQUENCE_LENGTH`` ids decoded with special tokens skipped. Kiln's ensemble
adds optional inputs: ``output_text`` (the engine's text of ``TOKENS_BATCH``, stop-string cut
applied: taken as it is, so the ensemble decodes each token once), or, for a caller with only the
ids, ``context_ids`` (the ids before ``TOKENS_BATCH``, so that a streamed piece decodes as a
continuation: leading spaces, characters split across responses) and ``text_trim`` (characters to
cut for a stop string); and it passes the engine's log-probabilities and acceptance
figures through (a decoupled ensemble answers once every output exists, so they are always there).
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from backend.serving.metrics.acceptance import acceptance_tensors, read_acceptance
from backend.serving.conversion.convert import InvalidRequest
from backend.serving.conversion.detok import Decoder, decode_piece

__all__ = ["engine_text", "postprocess", "postprocess_tensors", "POSTPROCESSING_INPUTS"]

POSTPROCESSING_INPUTS = ("TOKENS_BATCH", "SEQUENCE_LENGTH", "output_text", "context_ids", "text_trim",
                         "output_log_probs",
                         "cum_log_probs", "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens",
                         "CONTEXT_LOGITS", "GENERATION_LOGITS", "OUTPUT_LOG_PROBS", "CUM_LOG_PROBS", "BATCH_INDEX")


def postprocess(tok: Decoder, output_ids: list[int], context_ids: list[int], trim: int) -> str:
    piece = decode_piece(tok, context_ids, output_ids)
    if trim > 0:
        piece = piece[: max(len(piece) - trim, 0)]
    return piece


def engine_text(arr: np.ndarray | None) -> str | None:
    """The engine's ``output_text`` of one response (``[1, 1]`` BYTES), or None when absent."""
    if arr is None:
        return None
    v = np.asarray(arr, dtype=object).reshape(-1)[0]
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)


def _ids(arr: np.ndarray | None) -> list[int]:
    return [] if arr is None else [int(t) for t in np.asarray(arr).reshape(-1)]


def _sequences(tokens: np.ndarray, lengths: np.ndarray | None) -> list[list[list[int]]]:
    """TOKENS_BATCH [B, beams, n] cut to SEQUENCE_LENGTH [B, beams]: [row][beam] -> ids."""
    t = np.asarray(tokens)
    if t.ndim != 3:
        raise InvalidRequest(f"input 'TOKENS_BATCH': expected shape [batch, beams, tokens], got {list(t.shape)}")
    if lengths is None:
        lens = np.full(t.shape[:2], t.shape[2])
    else:
        lens = np.asarray(lengths)
        if lens.size != t.shape[0] * t.shape[1]:
            raise InvalidRequest(f"input 'SEQUENCE_LENGTH': shape {list(lens.shape)} does not match "
                                 f"TOKENS_BATCH {list(t.shape)} (one length per row and beam)")
        lens = lens.reshape(t.shape[:2])
    return [[[int(x) for x in beam[: max(0, min(int(n), t.shape[2]))]] for beam, n in zip(row, row_lens)]
            for row, row_lens in zip(t, lens)]


def _floats(arr: np.ndarray | None, empty: tuple[int, ...]) -> np.ndarray:
    return np.zeros(empty, np.float32) if arr is None else np.asarray(arr, np.float32)


def _per_row(arr: np.ndarray | None, b: int) -> list[np.ndarray | None]:
    return [None] * b if arr is None else [np.asarray(arr)[i] for i in range(b)]


def postprocess_tensors(tok: Decoder, t: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Tensors of the ``postprocessing`` model in and out (batch dimension included; ``OUTPUT`` is
    1-D, row by row and beam by beam, as NVIDIA's)."""
    seqs = _sequences(t["TOKENS_BATCH"], t.get("SEQUENCE_LENGTH"))
    if t.get("output_text") is not None:  # the engine's (Kiln's ensemble): one sequence per row
        texts = [engine_text(x) for x in _per_row(t["output_text"], len(seqs))]
    else:
        contexts, trims = _per_row(t.get("context_ids"), len(seqs)), _per_row(t.get("text_trim"), len(seqs))
        texts = [postprocess(tok, ids, _ids(ctx), int(trim.reshape(-1)[0]) if trim is not None else 0)
                 for row, ctx, trim in zip(seqs, contexts, trims) for ids in row]
    # Kiln's ensemble sends the lower-case names; NVIDIA's postprocessing takes the upper-case ones
    lp = t.get("output_log_probs", t.get("OUTPUT_LOG_PROBS"))
    cum = t.get("cum_log_probs", t.get("CUM_LOG_PROBS"))
    row = t.get("BATCH_INDEX")
    b = len(seqs)
    out = {
        "OUTPUT": np.array([x.encode("utf-8") for x in texts], dtype=object),
        # passed through as the engine sent them (one response: [1, beams, ...])
        "OUT_OUTPUT_LOG_PROBS": np.zeros((b, 1, 0), np.float32) if lp is None else np.asarray(lp, np.float32),
        "OUT_CUM_LOG_PROBS": np.zeros((b, 1), np.float32) if cum is None else np.asarray(cum, np.float32),
        # zero-sized unless the request asked for logits (NVIDIA's names; engine_outputs.py)
        "OUT_CONTEXT_LOGITS": _floats(t.get("CONTEXT_LOGITS"), (b, 0, 0)),
        "OUT_GENERATION_LOGITS": _floats(t.get("GENERATION_LOGITS"), (b, 1, 0, 0)),
        "OUT_BATCH_INDEX": np.zeros((b, 1), np.int32) if row is None else np.asarray(row, np.int32).reshape(b, 1),
    }
    # Always present: the ensemble forwards them and cannot answer while an output is missing.
    figures = read_acceptance(t)  # None only when a caller other than the ensemble sent none
    for name, zero in acceptance_tensors(0, 0).items():
        out["out_" + name] = (np.zeros((b, 1), zero.dtype) if figures is None
                              else np.array([[figures[name]]], zero.dtype))
    return out
