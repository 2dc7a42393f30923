"""Five JSON schemas of different shapes (nested objects, arrays, enums, bounded numbers, required
fields), each with a prompt that invites it and one valid document (one line, ", " and ": " between
items, as the engine's grammar writes JSON): shared by the structured-output
tests (tests/runtime/test_guided.py) and the mask benchmark (harness/perf/grammar/mask.py)."""
from __future__ import annotations

SCHEMAS: dict[str, dict] = {
    "person": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False,
    },
    "order": {  # nested object and an array of objects
        "type": "object",
        "properties": {
            "customer": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999},
                                                          "vip": {"type": "boolean"}},
                         "required": ["id", "vip"], "additionalProperties": False},
            "items": {"type": "array", "minItems": 1, "maxItems": 3,
                      "items": {"type": "object",
                                "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                                               "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                                "required": ["sku", "qty"], "additionalProperties": False}},
        },
        "required": ["customer", "items"], "additionalProperties": False,
    },
    "weather": {  # enum and a bounded number
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 24},
                       "sky": {"type": "string", "enum": ["sunny", "cloudy", "rain", "snow"]},
                       "celsius": {"type": "number", "minimum": -50, "maximum": 60}},
        "required": ["city", "sky", "celsius"], "additionalProperties": False,
    },
    "tags": {  # array of enums, unique
        "type": "object",
        "properties": {"tags": {"type": "array", "minItems": 2, "maxItems": 4,
                                "items": {"type": "string", "enum": ["red", "green", "blue", "black"]}},
                       "count": {"type": "integer", "minimum": 2, "maximum": 4}},
        "required": ["tags", "count"], "additionalProperties": False,
    },
    "point": {  # numbers only, all required, nested array of numbers
        "type": "object",
        "properties": {"x": {"type": "number", "minimum": -1, "maximum": 1},
                       "y": {"type": "number", "minimum": -1, "maximum": 1},
                       "history": {"type": "array", "maxItems": 3,
                                   "items": {"type": "integer", "minimum": 0, "maximum": 99}}},
        "required": ["x", "y", "history"], "additionalProperties": False,
    },
}

PROMPTS: dict[str, str] = {
    "person": "Describe a person as JSON with a name and an age:",
    "order": "Write a shop order as JSON (customer id and vip flag, a list of items with sku and qty):",
    "weather": "Give today's weather in a city as JSON (city, sky, celsius):",
    "tags": "List a few colours as JSON tags with their count:",
    "point": "A point in the unit square as JSON with a short history:",
}

EXAMPLES: dict[str, str] = {
    "person": '{"name": "Ada", "age": 36}',
    "order": '{"customer": {"id": 7, "vip": true}, "items": [{"sku": "ABC12", "qty": 2}]}',
    "weather": '{"city": "Paris", "sky": "rain", "celsius": 12.5}',
    "tags": '{"tags": ["red", "blue"], "count": 2}',
    "point": '{"x": 0.25, "y": -0.5, "history": [3, 14]}',
}
