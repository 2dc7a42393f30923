"""The OpenAI front door's structured output on the real stack: response_format json_schema /
json_object and the guided_* extensions reach the engine's grammar masks; answers validate; bad or
conflicting constraints are 400s naming the field."""
from __future__ import annotations

import json
import re

import pytest
import requests

from tests.serving.openai_stack import MODEL

pytestmark = [pytest.mark.slow, pytest.mark.server]


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "sunny", "celsius"],
           "properties": {"city": {"enum": ["Paris", "Lyon", "Nice"]}, "sunny": {"type": "boolean"},
                          "celsius": {"type": "integer", "minimum": -20, "maximum": 45}}}
TAGS = {"type": "object", "additionalProperties": False, "required": ["tags"],
        "properties": {"tags": {"type": "array", "minItems": 1, "maxItems": 3,
                                "items": {"enum": ["red", "green", "blue"]}}}}


def _schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_json_schema_answers_validate_sampled_streamed_and_not(stack):
    import jsonschema
    client, n = stack.client(), 96
    answers = []  # (schema, text, finish_reason)
    for seed in (1, 2):  # chat, not streamed
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Invent a person; answer in JSON."}], max_tokens=n,
            temperature=1.0, seed=seed, response_format=_schema_format("person", PERSON))
        answers.append((PERSON, r.choices[0].message.content, r.choices[0].finish_reason))
        assert r.usage.completion_tokens < n
    chunks = list(client.chat.completions.create(  # chat, streamed
        model=MODEL, messages=[{"role": "user", "content": "The weather in France today, as JSON."}], max_tokens=n,
        temperature=1.0, seed=3, stream=True, response_format=_schema_format("weather", WEATHER)))
    answers.append((WEATHER, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
                    [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][-1]))
    # completions (vLLM accepts response_format there too), streamed; and vLLM's guided_json as text
    pieces = list(client.completions.create(model=MODEL, prompt="Some colours as JSON:", max_tokens=n, temperature=1.0,
                                            seed=4, stream=True, extra_body={"response_format": _schema_format("tags", TAGS)}))
    answers.append((TAGS, "".join(p.choices[0].text for p in pieces), pieces[-1].choices[0].finish_reason))
    r = client.completions.create(model=MODEL, prompt="A person as JSON:", max_tokens=n, temperature=1.0, seed=5,
                                  extra_body={"guided_json": json.dumps(PERSON)})
    answers.append((PERSON, r.choices[0].text, r.choices[0].finish_reason))
    for schema, text, finish in answers:
        assert finish == "stop", (text, finish)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_regex_and_grammar_constrain_the_text(stack):
    client = stack.client()
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe Paris as a JSON object with its country."}],
        max_tokens=96, temperature=0, response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(text), dict), text
    regex = r"[A-Z][a-z]{1,9}( [a-z]{1,9}){1,3}\."
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me about Paris"}],
                                       max_tokens=48, temperature=1.0, seed=6, extra_body={"guided_regex": regex})
    assert r.choices[0].finish_reason == "stop" and re.fullmatch(regex, r.choices[0].message.content), r
    pieces = list(client.completions.create(model=MODEL, prompt="The first three numbers:", max_tokens=24,
                                            temperature=1.0, seed=7, stream=True,
                                            extra_body={"guided_regex": r" [0-9]{1,2}(, [0-9]{1,2}){2}"}))
    text = "".join(p.choices[0].text for p in pieces)
    assert re.fullmatch(r" [0-9]{1,2}(, [0-9]{1,2}){2}", text) and pieces[-1].choices[0].finish_reason == "stop", text
    r = client.completions.create(model=MODEL, prompt="Is Paris in France? Answer:", max_tokens=8, temperature=1.0,
                                  seed=8, extra_body={"guided_grammar": 'root ::= " yes" | " no"'})
    assert r.choices[0].text in (" yes", " no") and r.choices[0].finish_reason == "stop", r


def test_a_guide_the_engine_cannot_compile_is_a_400_naming_its_field(stack):
    import openai
    client = stack.client()
    msgs = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8,
                                       response_format=_schema_format("bad", {"type": "bogus"}))
    assert e.value.param == "response_format" and "bogus" in e.value.message, e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=8, extra_body={"guided_regex": "(a"})
    assert e.value.param == "guided_regex" and "not closed" in e.value.message, e.value.message  # xgrammar's words
    # streamed: still a real 400 (the engine refuses before the first token, before the headers)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 8, "stream": True, "guided_json": {"type": "bogus"}}
    r = requests.post(f"{stack.base}/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_json", r.text
    # and the server goes on serving constrained requests
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=8, extra_body={"guided_regex": "ab"})
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("ab", "stop")


def test_conflicting_constraints_are_refused(stack):
    import openai
    client = stack.client()
    msgs = [{"role": "user", "content": "Hi"}]
    cases = [  # (extra fields, param, words)
        ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex",
         "response_format and guided_regex both constrain"),
        ({"guided_json": PERSON, "guided_grammar": 'root ::= "a"'}, "guided_grammar", "guided_json and guided_grammar"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", "response_format"),
        ({"guided_regex": "a+", "min_tokens": 2}, "min_tokens", "guided_regex"),
    ]
    for extra, param, words in cases:
        for create in (lambda **kw: client.chat.completions.create(messages=msgs, **kw),
                       lambda **kw: client.completions.create(prompt="x", **kw)):
            with pytest.raises(openai.BadRequestError) as e:
                create(model=MODEL, max_tokens=4, extra_body=extra)
            assert e.value.param == param and words in e.value.message, (extra, e.value.message)
    # text is no constraint: with one guide it is fine
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=4,
                                  extra_body={"response_format": {"type": "text"}, "guided_regex": "ab"})
    assert r.choices[0].text == "ab"


# ---- cancellation --------------------------------------------------------------------------------
