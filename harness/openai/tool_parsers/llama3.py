"""Llama 3.1-3.3's JSON calls: the whole answer is one or more ``{"name": ..., "parameters": {...}}``."""
from __future__ import annotations

import json

from harness.openai.tool_parsers.base import Delta

__all__ = ["Llama3JsonParser"]


class Llama3JsonParser:
    """Llama 3.1-3.3's JSON calls: the whole answer is ``{"name": ..., "parameters": {...}}`` (several
    joined by ``; ``), after an optional ``<|python_tag|>``; an answer that does not start with ``{``
    is text. A call is known only once the answer is complete, so calls come at the end, their
    arguments in one piece each."""

    TAG = "<|python_tag|>"

    def __init__(self):
        self.buf, self.mode = "", None   # mode: None until the first visible char, then "text" / "calls"

    def feed(self, s: str) -> list[Delta]:
        if self.mode == "text":
            return [Delta(content=s)] if s else []
        self.buf += s
        head = self.buf.lstrip()
        if head.startswith(self.TAG):
            head = head[len(self.TAG):].lstrip()
        if not head or self.TAG.startswith(head):
            return []
        self.mode = "calls" if head.startswith("{") else "text"
        if self.mode == "text":
            out, self.buf = self.buf, ""
            return [Delta(content=out)]
        return []

    def end(self) -> tuple[list[Delta], int | None]:
        if self.mode != "calls":
            out = [Delta(content=self.buf)] if self.buf else []
            return out, None
        text = self.buf.strip()
        if text.startswith(self.TAG):
            text = text[len(self.TAG):]
        dec, pos, calls = json.JSONDecoder(), 0, []
        try:
            while True:
                while pos < len(text) and text[pos] in " \n\t;":
                    pos += 1
                if pos >= len(text):
                    break
                obj, pos = dec.raw_decode(text, pos)
                args = obj.get("parameters", obj.get("arguments")) if isinstance(obj, dict) else None
                if not isinstance(obj.get("name"), str) or not isinstance(args, dict):
                    raise ValueError("not a call")
                calls.append((obj["name"], args))
        except (ValueError, AttributeError):
            return [Delta(content=self.buf)], None  # not calls after all (or cut off): the text as written
        out = []
        for i, (name, args) in enumerate(calls):
            out += [Delta(index=i, name=name), Delta(index=i, arguments=json.dumps(args, ensure_ascii=False))]
        return out, None
