"""The front door's tool pieces without a server: the parsers (whole text and any split of it give
the same answer), the request checks (400s naming the field), the table's choice from a template,
and the grammar (it accepts valid calls and nothing else, checked with xgrammar's matcher). The real
stack runs them in test_openai_tools.py."""
from __future__ import annotations

import json
import random

import pytest

from harness.openai.errors import ApiError
from harness.openai.tool_answer import ToolAnswer
from harness.openai.tool_guide import tool_grammar
from harness.openai.tool_parsers import FORMATS, choose_format, template_has_tools
from harness.openai.tools import parse_tools

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now", "description": "the time"}}]
HERMES_TWO = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "P}a\\"ris {", "days": 3}}\n'
              '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n')


def _answer(fmt: str, pieces: list[str]) -> tuple:
    ta = ToolAnswer(FORMATS[fmt])
    deltas = [d for p in pieces for d in ta.feed(p)] + ta.end()
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in ta.calls()]
    return "".join(d.get("content", "") for d in deltas), calls, ta.cut


def _splits(text: str, seed: int) -> list[str]:
    rng, out, i = random.Random(seed), [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        out.append(text[i:i + n])
        i += n
    return out


@pytest.mark.parametrize("fmt, text, content, calls", [
    ("hermes", HERMES_TWO, "Let me check.", [("get_weather", '{"city": "P}a\\"ris {", "days": 3}'), ("now", "{}")]),
    ("hermes", "Just text, <b>bold</b> and a < sign.", "Just text, <b>bold</b> and a < sign.", []),
    # another key order: checked whole at the closing tag, the arguments re-written
    ("hermes", '<tool_call>{"arguments": {"days": 2}, "name": "now"}</tool_call>', "", [("now", '{"days": 2}')]),
    ("hermes", "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Nice", "days": 1}}; '
                    '{"name": "now", "parameters": {}}', "",
     [("get_weather", '{"city": "Nice", "days": 1}'), ("now", "{}")]),
    ("llama3_json", "The weather is fine.", "The weather is fine.", []),
    ("llama3_json", '{"not": "a call"}', '{"not": "a call"}', []),
])
def test_parsers_give_the_same_answer_whole_and_in_any_pieces(fmt, text, content, calls):
    whole = _answer(fmt, [text])
    assert whole == (content, calls, None)
    for seed in range(20):
        assert _answer(fmt, _splits(text, seed)) == whole, seed
    assert _answer(fmt, list(text)) == whole


def test_a_call_cut_off_is_reported_and_left_out():
    text = HERMES_TWO[:HERMES_TWO.index('{}')]  # inside the second call's arguments
    for pieces in ([text], list(text)):
        content, calls, cut = _answer("hermes", pieces)
        assert cut == 1 and calls == [("get_weather", '{"city": "P}a\\"ris {", "days": 3}')]
    head = HERMES_TWO[:HERMES_TWO.index('"now"')]  # opened, its name not yet complete
    for pieces in ([head], list(head)):
        assert _answer("hermes", pieces) == ("Let me check.", [("get_weather", '{"city": "P}a\\"ris {", "days": 3}')], 1)
    ta = ToolAnswer(FORMATS["hermes"])
    _, calls = ta.message(text)
    assert ta.finish_reason("length") == "length" and len(calls) == 1
    assert ToolAnswer(FORMATS["hermes"]).finish_reason("stop") == "stop"  # no call: a text answer


@pytest.mark.parametrize("body, param", [
    ({"tools": {"a": 1}}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS + [TOOLS[1]]}, "tools[2].function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_malformed_tools_name_their_field(body, param):
    with pytest.raises(ApiError) as e:
        parse_tools(body)
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_tool_choice_modes():
    assert parse_tools({}) is None and parse_tools({"tools": TOOLS, "tool_choice": "none"}) is None
    assert parse_tools({"tools": [], "tool_choice": "auto"}) is None
    assert parse_tools({"tools": TOOLS}).choice == "auto"
    tr = parse_tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "now"}},
                      "parallel_tool_calls": False})
    assert (tr.choice, tr.parallel, tr.tool("now").parameters) == ("now", False, {"type": "object", "properties": {}})


def test_the_format_is_chosen_from_the_template():
    qwen = "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools> <tool_call>{% endif %}"
    llama = "{% if tools %}{{ tools }}{% endif %}<|python_tag|> ipython"
    smol = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    assert not template_has_tools(smol) and template_has_tools(qwen)
    assert choose_format("auto", qwen).name == "hermes" and choose_format("auto", llama).name == "llama3_json"
    assert choose_format("auto", smol).name == "hermes" and choose_format("auto", None).name == "hermes"
    assert choose_format("none", qwen) is None and choose_format("llama3_json", smol).name == "llama3_json"


def _accepts(ebnf: str, text: str) -> bool:
    from xgrammar.testing import _is_grammar_accept_string
    return _is_grammar_accept_string(ebnf, text)


def test_the_grammar_accepts_valid_calls_and_nothing_else():
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Nice", "days": 3}}\n</tool_call>'
    now = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    required = tool_grammar(parse_tools({"tools": TOOLS, "tool_choice": "required"}), FORMATS["hermes"])
    assert _accepts(required, call) and _accepts(required, f"{call}\n{now}")
    for bad in ("Sure!", call.replace("3", "9"), call.replace('"days": 3', '"day": 3'), "<tool_call>\n{}</tool_call>",
                call.replace("get_weather", "get_wether"), f"text {call}"):
        assert not _accepts(required, bad), bad
    single = tool_grammar(parse_tools({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}),
                          FORMATS["hermes"])
    assert _accepts(single, call) and not _accepts(single, f"{call}\n{now}")
    named = tool_grammar(parse_tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "now"}}}),
                         FORMATS["hermes"])
    assert _accepts(named, now) and not _accepts(named, call)
    auto = tool_grammar(parse_tools({"tools": TOOLS}), FORMATS["hermes"])
    assert _accepts(auto, "Just text.") and _accepts(auto, f"Let me look. {call}")
    assert not _accepts(auto, "Let me look. <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool_call>")
    llama = tool_grammar(parse_tools({"tools": TOOLS, "tool_choice": "required"}), FORMATS["llama3_json"])
    assert _accepts(llama, '{"name": "get_weather", "parameters": {"city": "Nice", "days": 3}}; '
                           '{"name": "now", "parameters": {}}')
    # every grammar parses back: the engine compiles the text, not the object
    json.dumps(required)


QWEN_LIKE = ("{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n"
             "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
             "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
             "{% if m.role == 'tool' %}[{{ m.tool_call_id }}]{% endif %}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONVERSATION = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": '{"city": "Nice", "days": 2}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


def _model(text_tokenizer, template: str | None):
    """The real SmolLM2 tokenizer, with ``template`` as its chat template."""
    from backend.serving.conversion.tokenizer import TextTokenizer
    from harness.openai.served_model import ServedModel
    tok = TextTokenizer(text_tokenizer.tokenizer, template, text_tokenizer.special)
    return ServedModel("m", "tensorrt_llm", None, tok, 4096, 8192, tok.vocab_size, 0, choose_format("auto", template))


def _rendered(model, messages, body) -> str:
    from harness.openai.prompts import chat_prompt_ids
    return model.tokenizer.tokenizer.decode(chat_prompt_ids(model, messages, parse_tools(body)), skip_special_tokens=False)


def test_a_template_with_tools_renders_them_itself(text_tokenizer):
    """transformers' convention: tools as OpenAI objects, past arguments as an object, tool turns with their id."""
    text = _rendered(_model(text_tokenizer, QWEN_LIKE), CONVERSATION, {"tools": TOOLS})
    assert '"name": "get_weather"' in text.split("</tools>")[0]
    assert '<tool_call>{"arguments": {"city": "Nice", "days": 2}, "name": "get_weather"}</tool_call>' in text, text
    assert "<|im_start|>tool\nsunny[call_1]" in text and "# Tools" not in text


def test_a_template_without_tools_gets_the_builtin_prompt(text_tokenizer):
    model = _model(text_tokenizer, text_tokenizer.chat_template)   # SmolLM2's: no tools
    assert not template_has_tools(text_tokenizer.chat_template)
    text = _rendered(model, CONVERSATION, {"tools": TOOLS, "tool_choice": "required"})
    assert text.startswith("<|im_start|>system\n# Tools") and "You must call at least one" in text
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather", "parameters": ' in text
    # the past call in the parser's own syntax, the result as a user turn
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Nice", "days": 2}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>" in text
    # tool_choice none: no tools offered, the past turns still rendered
    text = _rendered(model, CONVERSATION, {"tools": TOOLS, "tool_choice": "none"})
    assert "# Tools" not in text and "<tool_response>" in text
