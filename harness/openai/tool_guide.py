"""Tool calls valid by construction: the grammar the engine masks every token with.

The engine's guide path takes a JSON schema, a regex or an EBNF grammar (``backend/engine/guided.py``),
not xgrammar's structural tags; so the structural tag is built and turned into EBNF text here, with
xgrammar (the engine's own grammar library, imported only for tool requests), and the engine
compiles that text like any ``guided_grammar``. One call is the format's ``head`` (the function's
name written out), the function's ``parameters`` as compact JSON (xgrammar's JSON Schema grammar,
no free whitespace: with it a sampled model can pad with newlines until max_tokens) and the
format's ``tail``:

* ``required`` / a named function: calls only (``tags_with_separator``, at least one; exactly one
  for a named function or with ``parallel_tool_calls`` false), so the answer is nothing but calls
  whose arguments validate against their schemas, and it ends with the end token after the last;
* ``auto``: free text until the model writes the format's trigger (``<tool_call>``), then the call
  is forced to be valid (``triggered_tags``), then free text again;
* a family that writes a group of calls between two markers (DeepSeek's ``<｜tool▁calls▁begin｜>``
  ... ``<｜tool▁calls▁end｜>``): the group is one tag whose content is the calls, triggered in free
  text by its opening marker, and the answer ends after it.

For a model that thinks first (``reasoning``), the calls come after its reasoning block, which the
grammar then allows (required when the prompt opened it): forcing a call at once would put it
inside the reasoning, where the reasoning parser keeps it from the tool parser.

What this cannot promise: a call cut off by ``max_tokens`` is incomplete (finish_reason "length").
"""
from __future__ import annotations

import collections
import json
import threading

from harness.openai.errors import bad_request
from harness.openai.tool_parsers import ToolFormat
from harness.openai.tools import ToolRequest

__all__ = ["tool_grammar"]

_CACHE: "collections.OrderedDict[tuple, str]" = collections.OrderedDict()
_LOCK = threading.Lock()
_CACHE_SIZE = 64


def _params_grammar(xgr, tr: ToolRequest, i: int) -> str:
    tool = tr.tools[i]
    try:
        return str(xgr.Grammar.from_json_schema(json.dumps(tool.parameters), any_whitespace=False))
    except Exception as e:  # noqa: BLE001 - xgrammar's own message says what it cannot take
        raise bad_request(f"tools[{i}].function.parameters",
                          f"the schema cannot be turned into a grammar: {str(e).splitlines()[0][:300]}") from None


def _structural_tag(xgr, tr: ToolRequest, fmt: ToolFormat, prefix: dict | None) -> dict:
    chosen = [i for i, t in enumerate(tr.tools) if tr.choice in ("auto", "required") or t.name == tr.choice]
    tags = [{"type": "tag", "begin": fmt.head.replace("{name}", tr.tools[i].name),
             "content": {"type": "grammar", "grammar": _params_grammar(xgr, tr, i)}, "end": fmt.tail}
            for i in chosen]
    one = tr.choice not in ("auto", "required") or not tr.parallel
    calls = {"type": "tags_with_separator", "tags": tags, "separator": fmt.separator, "at_least_one": True,
             "stop_after_first": one}
    if fmt.calls_open:
        # a family that writes its calls as one group (DeepSeek): the group is one tag around them,
        # and in free text it is the group's opening marker that triggers it; after it the answer ends
        group = {"type": "tag", "begin": fmt.calls_open, "content": calls, "end": fmt.calls_close}
        body = group if tr.choice != "auto" else {
            "type": "triggered_tags", "triggers": [fmt.trigger], "tags": [group], "at_least_one": False,
            "stop_after_first": True}
    elif tr.choice == "auto":
        # free text until the trigger; every tag's begin starts with it, as triggered_tags requires
        assert all(t["begin"].startswith(fmt.trigger) for t in tags), fmt
        body = {"type": "triggered_tags", "triggers": [fmt.trigger], "tags": tags, "at_least_one": False,
                "stop_after_first": one}
    else:
        body = calls
    if prefix is not None:
        body = {"type": "sequence", "elements": [prefix, body]}
    return {"type": "structural_tag", "format": body}


def tool_grammar(tr: ToolRequest, fmt: ToolFormat, prefix: dict | None = None) -> str:
    """EBNF text (xgrammar's dialect, what the engine's ``ebnf_grammar`` guide compiles). ``prefix``:
    a structural-tag element the answer starts with (a reasoning block, ``ReasoningFormat.grammar_prefix``)."""
    key = (fmt.name, tr.choice, tr.parallel, tuple((t.name, json.dumps(t.parameters, sort_keys=True)) for t in tr.tools),
           json.dumps(prefix, sort_keys=True))
    with _LOCK:
        if key in _CACHE:
            _CACHE.move_to_end(key)
            return _CACHE[key]
    import xgrammar as xgr
    tag = _structural_tag(xgr, tr, fmt, prefix)
    try:
        text = str(xgr.Grammar.from_structural_tag(json.dumps(tag)))
    except Exception as e:  # noqa: BLE001
        raise bad_request("tools", f"the tools cannot be turned into a grammar: {str(e).splitlines()[0][:300]}") from None
    with _LOCK:
        _CACHE[key] = text
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return text
