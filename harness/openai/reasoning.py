"""Reasoning output: the part of an answer a model thinks in, split from what it answers.

``REASONING_PARSERS`` is the table (``--reasoning-parser NAME`` picks a row; ``auto`` asks
``choose_reasoning`` with the bundle's chat template; ``none`` splits nothing). A row knows the
markers its models think between (``think``: ``<think>...</think>``, DeepSeek-R1 and Qwen3), and
makes, per answer, a ``ReasoningSplitter`` that turns the engine's text pieces into
``("reasoning", text)`` and ``("content", text)`` parts.

Where the thinking starts is read from the rendered prompt, not guessed from the answer: Qwen3's and
DeepSeek-R1's newer templates end the prompt with ``<think>`` already written (the model's first
token is its reasoning), Qwen3's ``enable_thinking: false`` writes an empty ``<think></think>``
(the answer is all content), and a template that writes neither leaves it to the model, whose
answer is reasoning only if it opens with ``<think>``. The content after ``</think>`` starts at its
first non-blank character (the models put a blank line there). Like the tool parsers, feeding the
whole text at once gives the same parts joined as feeding it piece by piece.

gpt-oss thinks in harmony messages instead (``harmony``): its ``analysis`` channel is the reasoning,
the ``final`` channel (and a ``commentary`` preamble) the content, without their markers; a message
to a function is left to the tool parser as written (``harmony_messages`` reads them); a message to
one of gpt-oss's built-in tools (``browser``, ``python``), which a request cannot offer, is reasoning.

The tool grammar (``tool_guide``) needs to know this too: an answer that must be a call, from a
model that thinks first, is allowed its reasoning before the call (``grammar_prefix``), else the
grammar would force a call inside the reasoning and the parser would find none.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from harness.openai import harmony_messages as hm

__all__ = ["ReasoningFormat", "ReasoningSplitter", "REASONING_PARSERS", "choose_reasoning"]


@dataclasses.dataclass(frozen=True)
class ReasoningFormat:
    name: str
    open: str
    close: str
    template_markers: tuple[str, ...]   # a chat template that spells one of these makes its model think
    after: str = "\n\n"     # what the models write after the block, before the answer (or a call)
    # the answer's splitter, given the row and the rendered prompt (default: the open/close one)
    make_splitter: Callable[["ReasoningFormat", str], object] | None = None

    def markers(self) -> tuple[str, ...]:
        """Every fixed text of the syntax (where the vocabulary's special tokens may hide)."""
        return (self.open, self.close, *self.template_markers)

    def opened_in(self, prompt_text: str) -> bool:
        """The prompt leaves a reasoning block open: the answer starts inside it."""
        i = prompt_text.rfind(self.open)
        return i >= 0 and prompt_text.find(self.close, i) < 0

    def splitter(self, prompt_text: str):
        """A splitter for one answer: ``feed(text) -> [(kind, text)]``, ``end()``, and ``state``
        ("reasoning" while the model is thinking)."""
        if self.make_splitter is not None:
            return self.make_splitter(self, prompt_text)
        return ReasoningSplitter(self, self.opened_in(prompt_text))

    def grammar_prefix(self, opened: bool) -> dict:
        """An xgrammar structural-tag element for the reasoning before a forced tool call: required
        when the prompt opened the block (the model is in it), else allowed."""
        block = {"type": "tag", "begin": "" if opened else self.open, "content": {"type": "any_text"},
                 "end": self.close}
        # what the models write after the block (a blank line; harmony: the next message's start);
        # without it they are forced off their habit
        after = {"type": "const_string", "value": self.after}
        element = {"type": "sequence", "elements": [block, after]}
        return element if opened else {"type": "optional", "content": element}


class ReasoningSplitter:
    """One answer's text -> ``[(kind, text)]``, kind ``"reasoning"`` or ``"content"``."""

    def __init__(self, fmt: ReasoningFormat, opened: bool):
        self.fmt = fmt
        self.state = "reasoning" if opened else "start"
        self.buf = ""

    def feed(self, s: str) -> list[tuple[str, str]]:
        self.buf += s
        out: list[tuple[str, str]] = []
        while self.buf:
            step = getattr(self, f"_{self.state}")()
            if step is None:
                break
            out += step
        return _merged(out)

    def _start(self) -> list[tuple[str, str]] | None:
        head = self.buf.lstrip()
        if not head or (self.fmt.open.startswith(head) and head != self.fmt.open):
            return None  # blank so far, or maybe the opening tag: wait for more
        if head.startswith(self.fmt.open):
            self.buf, self.state = head[len(self.fmt.open):], "reasoning"
            return []
        self.state = "content"  # the model answered without thinking: all of it is content
        return []

    def _reasoning(self) -> list[tuple[str, str]] | None:
        close = self.fmt.close
        i = self.buf.find(close)
        if i >= 0:
            text, self.buf, self.state = self.buf[:i], self.buf[i + len(close):], "after"
            return [("reasoning", text)] if text else []
        # keep a tail that may be the start of the closing tag
        keep = next((k for k in range(min(len(close) - 1, len(self.buf)), 0, -1) if close.startswith(self.buf[-k:])), 0)
        text, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return [("reasoning", text)] if text else None

    def _after(self) -> list[tuple[str, str]] | None:
        self.buf = self.buf.lstrip()
        if not self.buf:
            return None
        self.state = "content"
        return []

    def _content(self) -> list[tuple[str, str]] | None:
        text, self.buf = self.buf, ""
        return [("content", text)]

    def end(self) -> list[tuple[str, str]]:
        """What was held back: a tail that turned out not to be a tag (a cut-off block stays reasoning)."""
        text, self.buf = self.buf, ""
        if not text or self.state == "after":
            return []
        return [("reasoning" if self.state == "reasoning" else "content", text)]


def _merged(parts: list[tuple[str, str]]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for kind, text in parts:
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))
    return out


class HarmonySplitter:
    """One harmony answer -> ``[(kind, text)]``: analysis bodies are reasoning, other bodies content
    (markers dropped), a message to a function content as written, for the tool parser."""

    def __init__(self, fmt: ReasoningFormat, prompt_text: str):
        inside = hm.open_body(prompt_text)
        self.scanner = hm.MessageScanner(inside)
        self.kind = _harmony_kind(inside) if inside is not None else None
        self.state = "reasoning" if self.kind == "reasoning" else "start"

    def _parts(self, events) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for event, v in events:
            if event == "text":
                out.append(("content", v))
            elif event == "header":
                self.kind = _harmony_kind(v)
                self.state = "reasoning" if self.kind == "reasoning" else "content"
                if self.kind == "call":
                    out.append(("content", v.raw + hm.MESSAGE))
            elif event == "body":
                out.append(("reasoning" if self.kind == "reasoning" else "content", v))
            elif event == "stop":
                if self.kind == "call" and v:
                    out.append(("content", v))
                self.kind = None
            elif event == "cut" and v.function is not None:   # a call's header, cut: the tool parser says so
                out.append(("content", v.raw))
        return _merged(out)

    def feed(self, s: str) -> list[tuple[str, str]]:
        return self._parts(self.scanner.feed(s))

    def end(self) -> list[tuple[str, str]]:
        return self._parts(self.scanner.end())


def _harmony_kind(h: hm.Header) -> str:
    if h.function is not None:
        return "call"
    return "reasoning" if h.channel == "analysis" or h.recipient else "content"


REASONING_PARSERS: dict[str, ReasoningFormat] = {f.name: f for f in (
    ReasoningFormat("think", "<think>", "</think>", ("<think>",)),
    # gpt-oss: a forced call may follow one analysis message, then the call's own <|start|>assistant
    ReasoningFormat("harmony", hm.CHANNEL + "analysis" + hm.MESSAGE, hm.END, (hm.CHANNEL,),
                    after=hm.START + "assistant", make_splitter=HarmonySplitter),
)}


def choose_reasoning(setting: str, template: str | None) -> ReasoningFormat | None:
    """``--reasoning-parser``: a row's name, ``none``, or ``auto``: the row whose markers the bundle's
    chat template spells (a template that never writes ``<think>`` belongs to a model that does not
    think in it, SmolLM2's), else none."""
    if setting == "none":
        return None
    if setting != "auto":
        return REASONING_PARSERS[setting]
    return next((f for f in REASONING_PARSERS.values() if template and any(m in template for m in f.template_markers)),
                None)
