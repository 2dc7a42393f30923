"""Incremental detokenization that never splits a UTF-8 character, with stop words and strings.

Two kinds of stop, one per input name:

* stop words (``stop_ids``; NVIDIA's ``stop_words`` / ``stop_words_list``): token sequences matched
  on the generated token ids, as TensorRT-LLM does; the request ends after the matching token and
  the stop word stays in the output;
* stop strings (Kiln's ``stop_strings`` extension): substrings of the decoded text, whatever the
  tokenization; the text is cut before the first one found.

The work is split so the ensemble's postprocessing model can stay stateless:

* the engine host runs one :class:`StreamDetokenizer` per request. It decides *when* a group of
  tokens may be sent: only when their text is complete (a CJK character or an emoji often spans
  two or three byte-level tokens; decoding the first alone gives U+FFFD) and cannot be the start of
  a stop string. It also finds stop strings and reports how many trailing characters to cut;
* postprocessing turns each sent group back into text with :func:`decode_piece`, given the few
  tokens before the group as context (SentencePiece-style decoders drop a leading space unless the
  previous token is present), and applies the cut.

Both sides call the same :func:`decode_piece`, so they agree character for character.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol

__all__ = ["Decoder", "Chunk", "StreamDetokenizer", "decode_piece", "CONTEXT_TOKENS"]

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 4  # tokens of left context sent with each group; enough for every decoder we know


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


def decode_piece(tok: Decoder, context: list[int], ids: list[int]) -> str:
    """Text that ``ids`` add after ``context``."""
    if not ids:
        return ""
    if not context:
        return tok.decode(ids)
    before = tok.decode(context)
    full = tok.decode(list(context) + list(ids))
    if full.startswith(before):
        return full[len(before):]
    # A decoder that rewrote the context once more text followed (rare clean-up rules): the piece
    # decoded alone is the best available answer and still never splits a character.
    return tok.decode(ids)


@dataclasses.dataclass
class Chunk:
    ids: list[int]          # tokens this response carries
    context: list[int]      # tokens before them, for decode_piece
    text: str               # decode_piece(context, ids) with the stop-string cut applied
    trim: int = 0           # characters cut from the end of the decoded piece (stop string)
    finished: bool = False
    stop: str | None = None  # the stop string, or the decoded stop word, that ended the request


class StreamDetokenizer:
    """Feeds generated tokens, returns the chunks that are ready to send.

    ``interval`` groups at least that many tokens per chunk (the config's ``stream_interval``).
    After a stop string is found the detokenizer is finished and ignores further tokens.
    """

    def __init__(self, tok: Decoder, prompt_ids: list[int], stop_strings: tuple[str, ...] | list[str] = (),
                 interval: int = 1, stop_ids: tuple[tuple[int, ...], ...] | list[list[int]] = ()):
        assert interval >= 1
        self.tok = tok
        self.stop_ids = tuple(tuple(w) for w in stop_ids if len(w))
        self._longest = max((len(w) for w in self.stop_ids), default=0)
        self._tail: list[int] = []  # the last generated ids, enough to match the longest stop word
        self.context = list(prompt_ids[-CONTEXT_TOKENS:])
        self.stops = tuple(s for s in stop_strings if s)
        self.interval = interval
        self.pending: list[int] = []
        self.finished = False

    def _stop_at(self, text: str) -> tuple[int, str] | None:
        best = None
        for s in self.stops:
            i = text.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def _may_start_stop(self, text: str) -> bool:
        # text ending with a proper prefix of a stop string: the next token may complete it
        return any(text.endswith(s[:k]) for s in self.stops for k in range(1, len(s)))

    def push(self, ids: list[int], finished: bool = False) -> Chunk | None:
        """Add tokens; return a chunk to send, or None to wait. ``finished`` always yields a chunk."""
        if self.finished:
            return None
        word = None
        if self.stop_ids:
            for j, t in enumerate(ids):
                self._tail = (self._tail + [t])[-self._longest:]
                word = next((w for w in self.stop_ids if tuple(self._tail[-len(w):]) == w), None)
                if word is not None:  # keep the stop word; drop what came after it
                    ids, finished = list(ids[: j + 1]), True
                    break
        self.pending.extend(ids)
        piece = decode_piece(self.tok, self.context, self.pending)
        hit = self._stop_at(piece) if self.stops else None
        if hit is not None:
            i, s = hit
            chunk = Chunk(list(self.pending), list(self.context), piece[:i], trim=len(piece) - i,
                          finished=True, stop=s)
            self.finished = True
            self.pending = []
            return chunk
        if not finished:
            if len(self.pending) < self.interval or piece.endswith(REPLACEMENT):
                return None
            if self.stops and self._may_start_stop(piece):
                return None
        trim = 0
        if finished:  # generation ended inside a character (length limit): drop the broken tail
            trim = len(piece) - len(piece.rstrip(REPLACEMENT))
        chunk = Chunk(list(self.pending), list(self.context), piece[: len(piece) - trim], trim=trim,
                      finished=finished, stop=None if word is None else (self.tok.decode(list(word)) or str(list(word))))
        if self.pending:
            self.context = (self.context + self.pending)[-CONTEXT_TOKENS:]
        self.pending = []
        self.finished = finished
        return chunk
