"""Reasoning output without a server: the ``<think>`` splitter (any split of a text gives the same
parts), where the thinking starts (the prompt, not a guess), the parser table, tool calls parsed
from the content only, the grammar that lets a thinking model reason before a forced call, and the
template variables (``chat_template_kwargs``, ``reasoning_effort``). The server test is
test_openai_reasoning.py."""
from __future__ import annotations

import random

import pytest

from harness.openai.chat_answer import ChatAnswer
from harness.openai.errors import ApiError
from harness.openai.prompts import template_kwargs
from harness.openai.reasoning import REASONING_PARSERS, choose_reasoning
from harness.openai.tool_guide import tool_grammar
from harness.openai.tool_parsers import FORMATS
from harness.openai.tools import parse_tools
from tests.serving.think_template import THINK_TEMPLATE

THINK = REASONING_PARSERS["think"]


def _joined(parts):
    out = {"reasoning": "", "content": ""}
    for kind, text in parts:
        out[kind] += text
    return out


def _split(text: str, opened: bool, cuts: list[int]):
    sp = THINK.splitter("<think>\n" if opened else "")
    parts, last = [], 0
    for c in cuts + [len(text)]:
        parts += sp.feed(text[last:c])
        last = c
    return _joined(parts + sp.end())


@pytest.mark.parametrize("text,opened,reasoning,content", [
    ("I should add 2 and 2.</think>\n\nIt is 4.", True, "I should add 2 and 2.", "It is 4."),
    ("<think>hmm</think>Paris.", False, "hmm", "Paris."),
    ("  <think>a < b</think>  done", False, "a < b", "done"),
    ("Paris, of course.", False, "", "Paris, of course."),
    ("thinking until cut off </thi", True, "thinking until cut off </thi", ""),   # max_tokens inside it
    ("<thinking is a word>", False, "", "<thinking is a word>"),
    ("x</think>", True, "x", ""),
])
def test_the_split_is_the_same_whole_and_in_any_pieces(text, opened, reasoning, content):
    want = {"reasoning": reasoning, "content": content}
    assert _split(text, opened, []) == want
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(1, min(6, len(text)))))
        assert _split(text, opened, cuts) == want, cuts
    assert _split(text, opened, list(range(len(text)))) == want   # a character at a time


def test_where_thinking_starts_is_read_from_the_prompt():
    assert THINK.opened_in("<|im_start|>assistant\n<think>\n")
    assert not THINK.opened_in("<|im_start|>assistant\n<think>\n\n</think>\n\n")   # enable_thinking false
    assert not THINK.opened_in("<|im_start|>assistant\n")


def test_the_parser_is_chosen_from_the_template(text_tokenizer):
    assert choose_reasoning("auto", THINK_TEMPLATE) is THINK
    assert choose_reasoning("auto", text_tokenizer.chat_template) is None   # SmolLM2 does not think
    assert choose_reasoning("auto", None) is None
    assert choose_reasoning("none", THINK_TEMPLATE) is None
    assert choose_reasoning("think", text_tokenizer.chat_template) is THINK


def test_tool_calls_are_parsed_from_the_content_only():
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Nice"}}\n</tool_call>'
    # a call the model only thinks about is reasoning, not a call
    msg = ChatAnswer(FORMATS["hermes"], THINK.splitter("<think>\n")).message(f"maybe {call}?</think>\n\nNo call.")
    assert "tool_calls" not in msg
    assert msg["content"] == "No call." and call in msg["reasoning_content"]
    ans = ChatAnswer(FORMATS["hermes"], THINK.splitter("<think>\n"))
    msg = ans.message(f"Nice is a city.</think>\n\n{call}")
    assert msg["reasoning_content"] == "Nice is a city." and msg["content"] is None
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"]
    assert ans.finish_reason("stop") == "tool_calls"
    # streamed: reasoning deltas first, then the call's; they join to the message
    ans = ChatAnswer(FORMATS["hermes"], THINK.splitter("<think>\n"))
    text = f"Nice is a city.</think>\n\n{call}"
    deltas = [d for i in range(0, len(text), 3) for d in ans.feed(text[i:i + 3])] + ans.end()
    kinds = [next(iter(d)) for d in deltas]
    assert kinds[0] == "reasoning_content" and "tool_calls" in kinds
    assert kinds.index("tool_calls") > max(i for i, k in enumerate(kinds) if k == "reasoning_content")
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Nice is a city."


def test_without_a_reasoning_parser_the_answer_is_all_content():
    msg = ChatAnswer(None, None).message("<think>x</think>y")
    assert msg == {"role": "assistant", "content": "<think>x</think>y"}


def _accepts(ebnf: str, text: str) -> bool:
    from xgrammar.testing import _is_grammar_accept_string
    return _is_grammar_accept_string(ebnf, text)


def test_a_forced_call_from_a_thinking_model_comes_after_its_reasoning():
    tr = parse_tools({"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}}}], "tool_choice": "required", "parallel_tool_calls": False})
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Nice"}}\n</tool_call>'
    opened = tool_grammar(tr, FORMATS["hermes"], THINK.grammar_prefix(True))
    assert _accepts(opened, f"The user wants Nice.</think>\n\n{call}")
    assert not _accepts(opened, call)                           # the prompt opened the block: close it first
    assert not _accepts(opened, "Nice.</think>\n\nNo call.")    # and then the call is still required
    optional = tool_grammar(tr, FORMATS["hermes"], THINK.grammar_prefix(False))
    assert _accepts(optional, call) and _accepts(optional, f"<think>hm</think>\n\n{call}")
    assert not _accepts(optional, "<think>hm</think>\n\nNo call.")


def test_template_kwargs_and_reasoning_effort():
    assert template_kwargs({"enable_thinking": False}) == {"enable_thinking": False}
    assert template_kwargs(None, "low") == {"reasoning_effort": "low"}
    assert template_kwargs({"reasoning_effort": "low"}, "low") == {"reasoning_effort": "low"}
    for kw, effort, param in [([1], None, "chat_template_kwargs"), ({"messages": []}, None, "chat_template_kwargs"),
                              ({"a b": 1}, None, "chat_template_kwargs"), (None, "extreme", "reasoning_effort"),
                              ({"reasoning_effort": "high"}, "low", "reasoning_effort")]:
        with pytest.raises(ApiError) as e:
            template_kwargs(kw, effort)
        assert e.value.status == 400 and e.value.param == param, (kw, effort)


def test_the_template_sees_the_kwargs(text_tokenizer):
    from backend.serving.conversion.tokenizer import TextTokenizer
    from harness.openai.prompts import chat_prompt
    from harness.openai.served_model import ServedModel
    tok = TextTokenizer(text_tokenizer.tokenizer, THINK_TEMPLATE, text_tokenizer.special)
    model = ServedModel("m", "tensorrt_llm", None, tok, 4096, 8192, tok.vocab_size, 0, None, THINK)
    msgs = [{"role": "user", "content": "Hi"}]
    _, on = chat_prompt(model, msgs)
    _, off = chat_prompt(model, msgs, None, {"enable_thinking": False})
    _, effort = chat_prompt(model, msgs, None, {"reasoning_effort": "high"})
    assert on.endswith("<|im_start|>assistant\n<think>\n") and THINK.opened_in(on)
    assert off.endswith("<think>\n\n</think>\n\n") and not THINK.opened_in(off)
    assert effort.startswith("<|im_start|>system\nReasoning effort: high<|im_end|>")


def test_the_command_line_reads_the_template_and_the_parser(tmp_path, capsys):
    from harness.openai.__main__ import parse_args
    (tmp_path / "repo").mkdir()
    (tmp_path / "t.jinja").write_text(THINK_TEMPLATE)
    a = parse_args(["--model-repository", str(tmp_path / "repo"), "--chat-template", str(tmp_path / "t.jinja"),
                    "--reasoning-parser", "none"])
    assert a.chat_template == THINK_TEMPLATE and a.reasoning_parser == "none"
    # no flag: the bundle's serving.reasoning_parser decides (load_served_model reads it)
    assert parse_args(["--model-repository", str(tmp_path / "repo")]).reasoning_parser is None
    for bad in (["--chat-template", str(tmp_path / "missing.jinja")], ["--reasoning-parser", "qwen3"]):
        with pytest.raises(SystemExit):
            parse_args(["--model-repository", str(tmp_path / "repo"), *bad])
    err = capsys.readouterr().err
    assert "--chat-template" in err and "--reasoning-parser" in err
