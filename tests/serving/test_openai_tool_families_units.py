"""The Mistral, DeepSeek and harmony (gpt-oss) rows of the tool-call table, without a server: each
parser gives the same answer whole and cut at any point (so no piece of a marker leaks into the
content), reads the older spellings it must, turns what is not a call into content as written,
names a call the answer stopped inside, parses back what its row writes, and its grammar (checked
with xgrammar's matcher) accepts the row's calls and nothing else. The harmony reasoning row is
here too: analysis -> reasoning_content, final -> content, calls left to the tool parser."""
from __future__ import annotations

import random

import pytest

from harness.openai.chat_answer import ChatAnswer
from harness.openai.reasoning import REASONING_PARSERS, choose_reasoning
from harness.openai.tool_answer import ToolAnswer
from harness.openai.tool_guide import tool_grammar
from harness.openai.tool_parsers import FORMATS, choose_format
from harness.openai.tool_prompt import tool_system_prompt
from harness.openai.tools import parse_tools

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now", "description": "the time"}}]
NICE = '{"city": "Nice", "days": 3}'
TRICKY = '{"city": "P}a\\"ris {", "days": 3}'     # braces and an escaped quote inside a string
TWO = [("get_weather", TRICKY), ("now", "{}")]
B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"          # DeepSeek's group of calls
CB, CE, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"   # and each call
HARMONY_CALL = "<|channel|>commentary to=functions.{} <|constrain|>json<|message|>{}<|call|>"


def _answer(fmt: str, pieces: list[str]) -> tuple:
    ta = ToolAnswer(FORMATS[fmt])
    deltas = [d for p in pieces for d in ta.feed(p)] + ta.end()
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in ta.calls()]
    return "".join(d.get("content", "") for d in deltas), calls, ta.cut


def _random_pieces(text: str, seed: int) -> list[str]:
    rng, out, i = random.Random(seed), [], 0
    while i < len(text):
        n = rng.randint(1, 8)
        out.append(text[i:i + n])
        i += n
    return out


def _same_in_any_pieces(fmt: str, text: str, want: tuple) -> None:
    assert _answer(fmt, [text]) == want
    for i in range(len(text) + 1):
        assert _answer(fmt, [text[:i], text[i:]]) == want, i
    for seed in range(10):
        assert _answer(fmt, _random_pieces(text, seed)) == want, seed
    assert _answer(fmt, list(text)) == want


@pytest.mark.parametrize("fmt, text, content, calls", [
    ("mistral", f"Let me check.\n[TOOL_CALLS]get_weather[ARGS]{TRICKY}[TOOL_CALLS]now[ARGS]{{}}", "Let me check.", TWO),
    ("mistral", f"[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{NICE}", "", [("get_weather", NICE)]),
    # the older list, arguments as an object or as JSON text
    ("mistral", f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {TRICKY}}}, {{"name": "now", "arguments": "{{}}"}}]',
     "", TWO),
    ("mistral", "[TOOL_CALLS] [1, 2]", "[TOOL_CALLS] [1, 2]", []),
    ("mistral", "Write [TOOL_CALLS] then a name.", "Write [TOOL_CALLS] then a name.", []),
    ("mistral", "Lists [a] and {b} are text.", "Lists [a] and {b} are text.", []),
    ("deepseek", f"Let me check.\n{B}{CB}function{SEP}get_weather\n```json\n{TRICKY}\n```{CE}\n"
                 f"{CB}function{SEP}now\n```json\n{{}}\n```{CE}{E}", "Let me check.", TWO),
    ("deepseek", f"{B}{CB}get_weather{SEP}{TRICKY}{CE}{CB}now{SEP}{{}}{CE}{E}", "", TWO),     # V3.1
    # arguments that are not an object: the block is text (the group markers around it are dropped)
    ("deepseek", f"{B}{CB}function{SEP}now\n```json\n[1]\n```{CE}{E}", f"{CB}function{SEP}now\n```json\n[1]\n```{CE}", []),
    ("deepseek", "No tools needed: 4.", "No tools needed: 4.", []),
    # without the harmony reasoning row every message that is not a call is content, markers dropped
    ("harmony", "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
                + HARMONY_CALL.format("get_weather", TRICKY), "Need the weather.", [("get_weather", TRICKY)]),
    # the recipient in the role part, a bare json, and no <|call|> (the engine stopped on it)
    ("harmony", f' to=functions.get_weather<|channel|>commentary json<|message|>{TRICKY}', "", [("get_weather", TRICKY)]),
    ("harmony", HARMONY_CALL.format("get_weather", TRICKY) + "<|start|>assistant" + HARMONY_CALL.format("now", "{}"),
     "", TWO),
    ("harmony", "<|channel|>final<|message|>Paris.<|return|>", "Paris.", []),
    ("harmony", HARMONY_CALL.format("now", "not json"), HARMONY_CALL.format("now", "not json"), []),
])
def test_parsers_give_the_same_answer_whole_and_cut_anywhere(fmt, text, content, calls):
    _same_in_any_pieces(fmt, text, (content, calls, None))


@pytest.mark.parametrize("fmt", ["mistral", "deepseek", "harmony"])
def test_a_call_cut_off_is_named_and_left_out(fmt):
    text = "Let me check.\n" + FORMATS[fmt].calls_text(TWO)
    inside_args = text[:text.rindex("{}") + 1]          # the second call's arguments opened, not closed
    inside_head = text[:text.rindex("now") + 1]         # the second call opened, its name not complete
    for cut_text in (inside_args, inside_head):
        for pieces in ([cut_text], list(cut_text)):
            assert _answer(fmt, pieces) == ("Let me check.", [("get_weather", TRICKY)], 1), (cut_text, pieces)
    ta = ToolAnswer(FORMATS[fmt])
    ta.message(inside_args)
    assert ta.finish_reason("length") == "length" and len(ta.calls()) == 1


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_row_parses_back_what_it_writes(fmt):
    row = FORMATS[fmt]
    assert _answer(fmt, [row.call_text("get_weather", NICE)]) == ("", [("get_weather", NICE)], None)
    assert _answer(fmt, [row.calls_text(TWO)]) == ("", TWO, None)
    # the built-in tool prompt shows the row's own syntax
    example = row.call_text("<function-name>", "<arguments-as-a-JSON-object>")
    assert example in tool_system_prompt(parse_tools({"tools": TOOLS}), row)


def _accepts(ebnf: str, text: str) -> bool:
    from xgrammar.testing import _is_grammar_accept_string
    return _is_grammar_accept_string(ebnf, text)


@pytest.mark.parametrize("fmt", ["mistral", "deepseek", "harmony"])
def test_the_grammar_accepts_the_rows_calls_and_nothing_else(fmt):
    row = FORMATS[fmt]
    one, two = row.call_text("get_weather", NICE), row.calls_text([("get_weather", NICE), ("now", "{}")])
    required = tool_grammar(parse_tools({"tools": TOOLS, "tool_choice": "required"}), row)
    assert _accepts(required, one) and _accepts(required, two)
    wrong = (one.replace("3", "9"), one.replace('"days"', '"day"'), one.replace("get_weather", "get_wether"),
             "Sure!", f"text {one}", row.call_text("get_weather", '{"city":"Nice","days":3}'))   # not compact
    for bad in wrong:
        assert not _accepts(required, bad), bad
    single = tool_grammar(parse_tools({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}), row)
    assert _accepts(single, one) and not _accepts(single, two)
    named = tool_grammar(parse_tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "now"}}}),
                         row)
    assert _accepts(named, row.call_text("now", "{}")) and not _accepts(named, one)
    auto = tool_grammar(parse_tools({"tools": TOOLS}), row)
    assert _accepts(auto, "Just text.") and _accepts(auto, f"Let me look. {one}")
    assert not _accepts(auto, "Let me look. " + row.call_text("get_weather", "{}"))


def test_the_format_is_chosen_from_the_template():
    mistral = "{% for m in messages %}{{ m.content }}{% for c in m.tool_calls or [] %}[TOOL_CALLS]{{ c.function.name }}"
    deepseek = "{% for m in messages %}{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + m.content }}{% endfor %}"
    gpt_oss = "{% if tools %}namespace functions{% endif %}<|start|>assistant<|channel|>final<|message|>"
    assert [choose_format("auto", t).name for t in (mistral, deepseek, gpt_oss)] == ["mistral", "deepseek", "harmony"]
    assert choose_reasoning("auto", gpt_oss) is REASONING_PARSERS["harmony"]
    assert choose_reasoning("auto", mistral) is None and choose_reasoning("auto", deepseek) is None
    for name in ("mistral", "deepseek", "harmony"):
        assert choose_format(name, None).name == name


HARMONY = REASONING_PARSERS["harmony"]
PROMPT = "<|start|>user<|message|>Weather in Nice?<|end|><|start|>assistant"


def _chat(text: str, pieces: list[str] | None, prompt: str = PROMPT, tools: bool = True) -> dict:
    ans = ChatAnswer(FORMATS["harmony"] if tools else None, HARMONY.splitter(prompt))
    if pieces is None:
        msg = ans.message(text)
    else:
        deltas = [d for p in pieces for d in ans.feed(p)] + ans.end()
        assert not any(k in d for d in deltas for k in ("content", "reasoning_content") if "<|" in (d.get(k) or ""))
        msg = {"role": "assistant", "content": ans.content or None, "reasoning_content": ans.reasoning_content}
        if ans.calls():
            msg["tool_calls"] = ans.calls()
    for c in msg.get("tool_calls", []):
        c.pop("id")
    return msg


@pytest.mark.parametrize("text, prompt, reasoning, content, calls", [
    ("<|channel|>analysis<|message|>User wants Nice.<|end|><|start|>assistant<|channel|>commentary<|message|>"
     "Looking it up.<|end|><|start|>assistant" + HARMONY_CALL.format("get_weather", NICE), PROMPT,
     "User wants Nice.", "Looking it up.", [("get_weather", NICE)]),
    ("<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.<|return|>", PROMPT,
     "Easy.", "Sunny.", []),
    # a template that opens the final channel itself: the answer is its body
    ("Sunny.", PROMPT + "<|channel|>final<|message|>", None, "Sunny.", []),
    # a built-in tool's call (not a function the request offers) is reasoning
    ("<|channel|>analysis to=browser.search <|constrain|>json<|message|>{\"q\": \"Nice\"}<|call|>", PROMPT,
     '{"q": "Nice"}', None, []),
])
def test_harmony_channels_split_into_reasoning_content_and_calls(text, prompt, reasoning, content, calls):
    whole = _chat(text, None, prompt)
    assert (whole["reasoning_content"], whole["content"]) == (reasoning, content if calls or content else "")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole.get("tool_calls", [])] == calls
    for pieces in ([text[:i], text[i:]] for i in range(len(text) + 1)):
        streamed = _chat(text, pieces, prompt)
        assert streamed == {**whole, "content": whole["content"] or None}, pieces
    assert _chat(text, list(text), prompt) == {**whole, "content": whole["content"] or None}


def test_harmony_reasoning_without_tools_and_its_grammar_prefix():
    text = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>"
    assert _chat(text, None, tools=False) == {"role": "assistant", "content": "4", "reasoning_content": "Easy."}
    sp = HARMONY.splitter(PROMPT)
    sp.feed("<|channel|>analysis<|message|>Hm")
    assert sp.state == "reasoning"      # what the Responses API counts reasoning tokens by
    tr = parse_tools({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False})
    grammar = tool_grammar(tr, FORMATS["harmony"], HARMONY.grammar_prefix(HARMONY.opened_in(PROMPT)))
    call = FORMATS["harmony"].call_text("get_weather", NICE)
    assert _accepts(grammar, call)
    assert _accepts(grammar, f"<|channel|>analysis<|message|>Nice, 3 days.<|end|><|start|>assistant{call}")
    assert not _accepts(grammar, "<|channel|>analysis<|message|>Nice.<|end|><|start|>assistant<|channel|>final<|message|>x")


def test_the_command_line_offers_every_row_and_refuses_others(tmp_path, capsys):
    from harness.openai.__main__ import parse_args
    (tmp_path / "repo").mkdir()
    base = ["--model-repository", str(tmp_path / "repo")]
    for name in ("auto", "hermes", "llama3_json", "mistral", "harmony", "deepseek", "none"):
        assert parse_args([*base, "--tool-parser", name]).tool_parser == name
    assert parse_args([*base, "--reasoning-parser", "harmony"]).reasoning_parser == "harmony"
    with pytest.raises(SystemExit):
        parse_args([*base, "--tool-parser", "qwen"])
    err = capsys.readouterr().err
    assert "--tool-parser" in err and "mistral" in err and "deepseek" in err and "harmony" in err
    # harness.serve checks the names it hands to the front door before it starts Triton
    from harness.serve import parse_args as serve_args
    a = serve_args([*base, "--openai-tool-parser", "deepseek", "--openai-reasoning-parser", "harmony"])
    assert a.openai_args == ("--tool-parser", "deepseek", "--reasoning-parser", "harmony")
    with pytest.raises(SystemExit):
        serve_args([*base, "--openai-tool-parser", "qwen"])
    assert "harmony" in capsys.readouterr().err
