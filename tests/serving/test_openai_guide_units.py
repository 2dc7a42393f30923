"""The OpenAI front door's structured-output fields -> the engine's guide, without a server: which
guide each field becomes, the two inputs the engine model is sent, and the engine's refusal of a guide
mapped onto the field it came from. The real stack runs them in test_openai_api.py."""
from __future__ import annotations

import json

import numpy as np
import pytest

from harness.openai.engine_client import engine_inputs
from harness.openai.errors import ApiError, engine_error
from harness.openai.params import Guide, check_unsupported, parse_sampling

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _guide(body: dict) -> Guide | None:
    check_unsupported(body)
    return parse_sampling(body, chat=True).guide


@pytest.mark.parametrize("body, want", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, Guide("json_schema", '{"type": "object"}', "response_format")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}},
     Guide("json_schema", json.dumps(SCHEMA), "response_format")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": None}}},
     Guide("json_schema", json.dumps(SCHEMA), "response_format")),
    ({"guided_json": SCHEMA}, Guide("json_schema", json.dumps(SCHEMA), "guided_json")),
    ({"guided_json": json.dumps(SCHEMA, indent=2)}, Guide("json_schema", json.dumps(SCHEMA), "guided_json")),
    ({"guided_regex": "[0-9]+"}, Guide("regex", "[0-9]+", "guided_regex")),
    ({"guided_grammar": 'root ::= "a"'}, Guide("ebnf_grammar", 'root ::= "a"', "guided_grammar")),
    ({"response_format": {"type": "text"}, "guided_regex": "a"}, Guide("regex", "a", "guided_regex")),
])
def test_each_field_becomes_its_guide(body, want):
    assert _guide(body) == want


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": "json_object"}, "response_format", "expected an object"),
    ({"response_format": {}}, "response_format", "allowed: text, json_object, json_schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs a json_schema object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format",
     "json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": "{}"}}}, "response_format",
     "json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": "yes"}}},
     "response_format", "json_schema.strict"),
    ({"guided_json": "{"}, "guided_json", "not valid JSON"),
    ({"guided_json": [1]}, "guided_json", "JSON Schema object"),
    ({"guided_regex": 5}, "guided_regex", "non-empty string"),
    ({"guided_grammar": ""}, "guided_grammar", "non-empty string"),
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex", "guided_json and guided_regex both"),
    ({"response_format": {"type": "json_object"}, "guided_grammar": "x"}, "guided_grammar",
     "response_format and guided_grammar both"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", "response_format"),
    ({"guided_regex": "a", "min_tokens": 1, "max_tokens": 4}, "min_tokens", "guided_regex"),
    ({"guided_choice": ["a", "b"]}, "guided_choice", "guided_regex"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "compact JSON"),
])
def test_bad_or_conflicting_constraints_are_refused_naming_the_field(body, param, words):
    with pytest.raises(ApiError) as e:
        _guide(body)
    assert (e.value.status, e.value.param) == (400, param) and words in e.value.message, e.value.message


def test_the_engine_gets_nvidias_two_inputs_only_with_a_guide():
    def named(s):
        return {i.name(): i for i in engine_inputs([1, 2, 3], 8, s)}
    plain = named(parse_sampling({}, chat=True))
    assert not {"guided_decoding_guide_type", "guided_decoding_guide"} & set(plain)
    got = named(parse_sampling({"guided_regex": "é+"}, chat=True))
    for name, value in (("guided_decoding_guide_type", b"regex"), ("guided_decoding_guide", "é+".encode())):
        assert (got[name].datatype(), got[name].shape()) == ("BYTES", [1, 1])
        # the serialized tensor: a 4-byte length, then the bytes
        raw = got[name]._raw_content
        assert raw == np.uint32(len(value)).tobytes() + value


def test_a_guide_the_engine_refuses_is_a_400_on_its_field_and_other_errors_are_unchanged():
    msg = "input 'guided_decoding_guide': sampling.guide: regex guide does not compile: unclosed '('"
    e = engine_error(msg, False, "guided_regex")
    assert (e.status, e.param, e.code) == (400, "guided_regex", "invalid_value") and msg in e.message
    assert engine_error(msg, False, None).param is None                       # no guide sent: not the field's
    assert engine_error("the engine is shutting down", False, "guided_regex").status == 503
    assert engine_error("input 'top_k': -3 is out of range", False, "guided_regex").param is None
    assert engine_error("boom", True, "guided_regex").status == 500
