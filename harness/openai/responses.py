"""OpenAI's response objects: chat completions, legacy completions, their stream chunks, usage.

Plain dicts in OpenAI's field order, built from the front door's own counts: ``prompt_tokens`` is
the number of ids sent to the engine, ``completion_tokens`` the number of ids it generated (stop
strings included: those tokens were generated even though their text is cut).
"""
from __future__ import annotations

import time
import uuid
from typing import Any

from backend.serving.conversion.tokenizer import TextTokenizer
from harness.openai.engine_client import Piece
from harness.openai.params import Sampling

__all__ = ["Completion", "Collected", "usage", "chat_logprobs", "completion_logprobs", "new_id"]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _token_text(tok: TextTokenizer, tid: int) -> str:
    # a token alone; one that holds part of a UTF-8 character decodes to U+FFFD, as in OpenAI's
    # own logprobs, whose ``bytes`` field is the way to join such tokens
    return tok.tokenizer.decode([tid], skip_special_tokens=False)


def _entry(tok: TextTokenizer, tid: int, lp: float) -> dict[str, Any]:
    text = _token_text(tok, tid)
    return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tok: TextTokenizer, ids: list[int], lps: list[float], top: int,
                  tops: list[list[tuple[int, float]]]) -> list[dict[str, Any]]:
    """Chat's ``logprobs.content`` entries; ``tops``: each token's most likely alternatives (the
    engine's, most likely first), of which the first ``top`` are listed."""
    out = []
    for i, (tid, lp) in enumerate(zip(ids, lps)):
        entry = _entry(tok, tid, lp)
        alts = tops[i][:top] if top and i < len(tops) else []
        entry["top_logprobs"] = [_entry(tok, t, v) for t, v in alts]
        out.append(entry)
    return out


def completion_logprobs(tok: TextTokenizer, ids: list[int], lps: list[float], top: int,
                        offset: int, tops: list[list[tuple[int, float]]]) -> dict[str, Any]:
    """Completions' ``logprobs`` object; ``offset`` is the text length before these tokens."""
    tokens = [_token_text(tok, t) for t in ids]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": list(lps),
            "top_logprobs": [{_token_text(tok, t): v for t, v in (tops[i][:top] if i < len(tops) else [])}
                             for i in range(len(tokens))] if top else None,
            "text_offset": offsets}


class Collected:
    """One answer's pieces as they come: text, generated ids, log-probabilities, finish reason."""

    def __init__(self, tok: TextTokenizer, sampling: Sampling, chat: bool):
        self.tok, self.s, self.chat = tok, sampling, chat
        self.text, self.n_tokens, self.finish = "", 0, None
        self.lp_entries: list = []
        self.lp_tokens: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def logprobs_of(self, p: Piece) -> Any:
        if not self.s.logprobs:
            return None
        if self.chat:
            return {"content": chat_logprobs(self.tok, p.ids, p.logprobs, self.s.top_logprobs, p.tops)}
        return completion_logprobs(self.tok, p.ids, p.logprobs, self.s.top_logprobs, len(self.text), p.tops)

    def add(self, p: Piece) -> Any:
        """-> the piece's own log-probabilities (None unless asked for)."""
        lp = self.logprobs_of(p)
        if lp is not None and self.chat:
            self.lp_entries.extend(lp["content"])
        elif lp is not None:
            for k in self.lp_tokens:
                self.lp_tokens[k].extend(lp[k] or [])
        self.text += p.text
        self.n_tokens += len(p.ids)
        self.finish = p.finish_reason or self.finish
        return lp

    def logprobs(self) -> Any:
        if not self.s.logprobs:
            return None
        if self.chat:
            return {"content": self.lp_entries}
        return {**self.lp_tokens, "top_logprobs": self.lp_tokens["top_logprobs"] if self.s.top_logprobs else None}


class Completion:
    """One answer's objects, chat or not: the full response, or its stream chunks."""

    def __init__(self, model: str, chat: bool):
        self.chat = chat
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.model = model
        self.object = "chat.completion" if chat else "text_completion"

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, answer: str | dict[str, Any], finish_reason: str | None, logprobs: Any,
                 use: dict[str, int]) -> dict[str, Any]:
        """``answer``: chat's message (``ChatAnswer.message``: content, reasoning, tool calls), or
        a completion's text."""
        if self.chat:
            choice = {"index": 0, "message": answer, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": answer, "logprobs": logprobs, "finish_reason": finish_reason}
        return {**self._head(self.object), "choices": [choice], "usage": use}

    def chunk(self, *, text: str | None = None, role: bool = False, finish_reason: str | None = None,
              logprobs: Any = None, with_usage: bool = False, delta: dict | None = None) -> dict[str, Any]:
        """A stream chunk of one choice. With ``stream_options.include_usage`` every chunk carries
        ``usage: null`` and a last one (``usage_chunk``) the totals, as OpenAI streams them."""
        if self.chat:
            delta = dict(delta or {})   # a tool answer's delta (content or tool_calls), made by the caller
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
            out = {**self._head("text_completion"), "choices": [choice]}
        if with_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, use: dict[str, int]) -> dict[str, Any]:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": use}
