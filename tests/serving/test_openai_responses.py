"""``/v1/responses`` on the real stack with the official ``openai`` client: the answer is the chat
path's (same text, same usage), streamed events join to the whole response, function tools give
valid ``function_call`` items, a ``function_call_output`` is answered, ``previous_response_id``
continues what the server kept, and mistakes are 400s naming the Responses field."""
from __future__ import annotations

import json

import pytest

from tests.serving.openai_stack import MODEL, SHORT

pytestmark = [pytest.mark.slow, pytest.mark.server]

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12}}}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER,
          "strict": True}]
NAMED = {"type": "function", "name": "get_weather"}


def test_the_answer_is_the_chat_paths(stack):
    c = stack.client()
    r = c.responses.create(model=MODEL, input=SHORT, instructions="Answer briefly.", temperature=0, max_output_tokens=24)
    chat = c.chat.completions.create(model=MODEL, temperature=0, max_tokens=24, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": SHORT}])
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.status == ("completed" if chat.choices[0].finish_reason == "stop" else "incomplete")


def test_streamed_events_join_to_the_response(stack):
    c = stack.client()
    whole = c.responses.create(model=MODEL, input=SHORT, temperature=0, max_output_tokens=24)
    events = list(c.responses.create(model=MODEL, input=SHORT, temperature=0, max_output_tokens=24, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert kinds.index("response.output_item.added") < kinds.index("response.output_text.delta") \
        < kinds.index("response.output_item.done")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    assert kinds.count("response.output_text.delta") > 1


def _valid_call(item) -> dict:
    import jsonschema
    assert item.type == "function_call" and item.name == "get_weather" and item.call_id.startswith("call_"), item
    args = json.loads(item.arguments)
    jsonschema.validate(args, WEATHER)
    return args


def test_a_function_call_is_valid_streamed_or_not_and_its_output_is_answered(stack):
    c = stack.client()
    ask = "What is the weather in Paris?"
    r = c.responses.create(model=MODEL, input=ask, tools=TOOLS, tool_choice="required", temperature=0,
                           parallel_tool_calls=False, max_output_tokens=48)
    assert r.status == "completed" and [it.type for it in r.output] == ["function_call"], r.output
    _valid_call(r.output[0])
    events = list(c.responses.create(model=MODEL, input=ask, tools=TOOLS, tool_choice=NAMED, temperature=0,
                                     max_output_tokens=48, stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert len(done) == 1 and _valid_call(done[0]) == json.loads(r.output[0].arguments)
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 1 and "".join(pieces) == done[0].arguments
    # the tool's result, continuing the kept response ...
    out = {"type": "function_call_output", "call_id": r.output[0].call_id, "output": "Sunny, 24 C"}
    follow = c.responses.create(model=MODEL, previous_response_id=r.id, input=[out], tools=TOOLS, tool_choice="none",
                                temperature=0, max_output_tokens=24)
    assert follow.previous_response_id == r.id and follow.output[0].type == "message" and follow.output_text
    # ... is the same conversation as sending it whole
    items = [{"role": "user", "content": ask}, r.output[0].model_dump(exclude_none=True), out]
    again = c.responses.create(model=MODEL, input=items, tools=TOOLS, tool_choice="none", temperature=0,
                               max_output_tokens=24)
    assert again.usage.input_tokens == follow.usage.input_tokens and again.output_text == follow.output_text


def test_mistakes_are_400s_naming_the_field_and_the_server_goes_on(stack):
    import openai
    c = stack.client()
    bad = [(dict(input="x", previous_response_id="resp_unknown"), "previous_response_id"),
           (dict(input="x", tools=[{"type": "function", "name": "f", "parameters": {"type": "array"}}]),
            "tools[0].parameters"),
           (dict(input="x", tools=TOOLS, tool_choice={"type": "function", "name": "nope"}), "tool_choice"),
           (dict(input=[{"type": "function_call_output", "output": "x"}]), "input[0].call_id"),
           (dict(input="x", max_output_tokens=5000), "max_output_tokens"),
           (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]),
            "input[0].content[0]")]
    for kw, param in bad:
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(model=MODEL, **kw)
        assert e.value.body["param"] == param, (kw, e.value.body)
    # store false: answered, not kept
    r = c.responses.create(model=MODEL, input=SHORT, temperature=0, max_output_tokens=4, store=False)
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model=MODEL, input="x", previous_response_id=r.id)
    assert r.id in e.value.body["message"]
    assert c.responses.create(model=MODEL, input=SHORT, temperature=0, max_output_tokens=4).usage.output_tokens == 4


def test_text_format_json_schema_is_chats_structured_output(stack):
    import jsonschema
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "population"],
              "properties": {"name": {"type": "string", "maxLength": 20},
                             "population": {"type": "integer", "minimum": 0, "maximum": 99999999}}}
    r = stack.client().responses.create(model=MODEL, input="Invent a city, as JSON", temperature=1.0, extra_body={"seed": 7},
                                        max_output_tokens=64, text={"format": {"type": "json_schema", "name": "city",
                                                                               "schema": schema, "strict": True}})
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), schema)
