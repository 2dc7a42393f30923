"""Tool-call syntaxes, one row per model family: how a call is written, parsed and constrained.

``FORMATS`` is the table (``--tool-parser NAME`` picks a row; ``auto`` asks ``choose_format`` with
the bundle's chat template). Each row knows

* how a call is spelled (``call_text``, ``calls_text``): the built-in tool prompt shows it and
  renders past calls;
* how the answer's text is parsed, streamed (``parser()``: feed text pieces, get deltas);
* the structural tag that makes a call valid by construction (``harness.openai.tool_guide``): the
  text a call opens with up to its arguments (``head``), the text that closes it (``tail``), what
  separates two calls, the markers around a group of calls where the family writes them
  (``calls_open`` / ``calls_close``, DeepSeek's), and the trigger that starts calls inside free
  text (``tool_choice`` auto).

A parser turns text into ``Delta``s: ``Delta(content=...)`` for plain text, and per call a first
``Delta(index, name=...)`` then ``Delta(index, arguments=...)`` pieces that join to the call's
arguments. Feeding the whole text at once gives the same deltas joined as feeding it piece by
piece, which is what makes a streamed answer assemble to the non-streamed one. A marker is never
sent as content in pieces: a tail that may be the start of one is held until it is known. What
looks like a call but is not one (its arguments are not a JSON object) is content, as written;
``end()`` also names a call the answer stopped inside, which the message then leaves out.

The parsers live one family to a module: ``hermes``, ``llama3``, ``mistral``, ``deepseek``,
``harmony`` (gpt-oss), on the pieces of ``base``.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable

from harness.openai.tool_parsers.base import Delta
from harness.openai.tool_parsers.deepseek import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP, DeepSeekParser
from harness.openai.tool_parsers.harmony import HarmonyParser
from harness.openai.tool_parsers.hermes import HermesParser
from harness.openai.tool_parsers.llama3 import Llama3JsonParser
from harness.openai.tool_parsers.mistral import ARGS, TOOL_CALLS, MistralParser

__all__ = ["Delta", "ToolFormat", "FORMATS", "DEFAULT_FORMAT", "choose_format", "template_has_tools",
           "HermesParser", "Llama3JsonParser", "MistralParser", "DeepSeekParser", "HarmonyParser"]


@dataclasses.dataclass(frozen=True)
class ToolFormat:
    name: str
    parser: Callable[[], object]
    head: str               # a call up to its arguments, "{name}" where the function's name goes
    tail: str               # what closes a call after its arguments
    separator: str          # between two calls
    trigger: str            # the text that opens calls (auto: free text until then)
    template_markers: tuple[str, ...]   # a chat template that spells one of these writes this format
    calls_open: str = ""    # written once before a group of calls (the trigger then)
    calls_close: str = ""   # and once after it

    def markers(self) -> tuple[str, ...]:
        """Every fixed text of the syntax (where the vocabulary's special tokens may hide)."""
        return (self.head.replace("{name}", ""), self.tail, self.separator, self.trigger, self.calls_open,
                self.calls_close, *self.template_markers)

    def call_text(self, name: str, arguments: str) -> str:
        """One call, as the model writes it (a group of one where the family groups calls)."""
        return self.calls_text([(name, arguments)])

    def calls_text(self, calls: list[tuple[str, str]]) -> str:
        """A turn's calls, (name, arguments as JSON text) each, as the model writes them."""
        body = self.separator.join(self.head.replace("{name}", n) + a + self.tail for n, a in calls)
        return self.calls_open + body + self.calls_close


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (
    ToolFormat("hermes", HermesParser, '<tool_call>\n{"name": "{name}", "arguments": ', "}\n</tool_call>", "\n",
               "<tool_call>", ("<tool_call>",)),
    ToolFormat("llama3_json", Llama3JsonParser, '{"name": "{name}", "parameters": ', "}", "; ",
               '{"name": "', ("<|python_tag|>", "ipython")),
    # the v11+ spelling; the parser also reads the older [TOOL_CALLS] [{...}] list
    ToolFormat("mistral", MistralParser, TOOL_CALLS + "{name}" + ARGS, "", "", TOOL_CALLS, (TOOL_CALLS,)),
    # V3 / R1's spelling; the parser also reads V3.1's NAME<｜tool▁sep｜>{...}
    ToolFormat("deepseek", DeepSeekParser, f"{CALL_BEGIN}function{SEP}{{name}}\n```json\n", f"\n```{CALL_END}", "\n",
               CALLS_BEGIN, (CALLS_BEGIN,), calls_open=CALLS_BEGIN, calls_close=CALLS_END),
    # gpt-oss: the prompt ends with <|start|>assistant, so a first call starts at its channel
    ToolFormat("harmony", HarmonyParser, "<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>",
               "<|call|>", "<|start|>assistant", "<|channel|>commentary to=functions.", ("<|channel|>",)),
)}
DEFAULT_FORMAT = "hermes"   # the built-in tool prompt's syntax (templates without tools or markers)


def template_has_tools(template: str | None) -> bool:
    """A chat template renders tools itself if it reads the ``tools`` variable."""
    return bool(template) and re.search(r"\btools\b", template) is not None


def choose_format(setting: str, template: str | None) -> ToolFormat | None:
    """``--tool-parser``: a row's name, ``none`` (tools refused), or ``auto``: the row whose markers
    the bundle's template spells, else Hermes (also the built-in prompt's syntax). The markers count
    also in a template that does not render the tools itself (DeepSeek-V3's writes past calls, not
    the tool list): the built-in prompt then describes the tools in that family's syntax."""
    if setting == "none":
        return None
    if setting != "auto":
        return FORMATS[setting]
    for f in FORMATS.values():
        if template and any(m in template for m in f.template_markers):
            return f
    return FORMATS[DEFAULT_FORMAT]
