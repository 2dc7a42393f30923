"""The serving keys a Triton model reads at run time, typed, each with its one default.

``serving:`` in a build config (``builder/config.py``) takes its defaults for these keys from here;
the package stage renders them into the engine model's ``config.pbtxt`` parameters with
``parameters()``; the engine's ``model.py`` reads them back with ``from_parameters`` and hands the
object to ``EngineHost``. So a key's default, its text in config.pbtxt and its type are stated once.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

__all__ = ["ServingSettings", "DEFAULTS", "TOOL_PARSERS", "REASONING_PARSERS"]

# The OpenAI front door's parser tables' names (harness/openai/tool_parsers, reasoning.py; a test
# holds these to them): auto picks by the chat template's markers, none turns the feature off
TOOL_PARSERS = ("auto", "hermes", "llama3_json", "mistral", "deepseek", "harmony", "none")
REASONING_PARSERS = ("auto", "think", "harmony", "none")

_BOOL_TEXT = {"true": True, "false": False}


@dataclasses.dataclass(frozen=True)
class ServingSettings:
    # where the engine runs: auto (the GPU when one is visible), cpu or cuda (backend/serving/engine_model/placement.py)
    device: str = "auto"
    # tokens per streamed response, at least
    stream_interval: int = 1
    # a step running longer is a hung device: its requests end with an error and the engine's stub
    # exits; 0 turns the watchdog off
    step_timeout_s: float = 300.0
    # a thread of its own makes and sends the engine's responses (backend/serving/engine_model/responder.py)
    response_thread: bool = True
    # tokens that come while a stream's previous response still waits join that response
    coalesce_responses: bool = True
    # how the OpenAI front door writes and parses tool calls, and splits reasoning from the answer
    # (its --tool-parser / --reasoning-parser beat them); read from this model's config.pbtxt
    tool_parser: str = "auto"
    reasoning_parser: str = "auto"

    def parameters(self) -> dict[str, str]:
        """Each key as its config.pbtxt ``string_value``."""
        return {f.name: _text(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_parameters(cls, cfg: Mapping[str, Any]) -> "ServingSettings":
        """From a Triton model config (``json.loads(args["model_config"])``): each key its
        ``string_value``, the default when it is absent or empty. A value of the wrong type is
        refused naming the model, the key and what is allowed."""
        params = cfg.get("parameters", {})
        values = {}
        for f in dataclasses.fields(cls):
            text = params.get(f.name, {}).get("string_value")
            if text is None or text == "":
                continue
            values[f.name] = _parse(cfg.get("name"), f.name, text, type(getattr(DEFAULTS, f.name)))
        return cls(**values)


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _parse(model: str | None, key: str, text: str, kind: type) -> Any:
    if kind is bool:
        if text not in _BOOL_TEXT:
            raise ValueError(f"model '{model}': config.pbtxt parameter '{key}': {text!r}; allowed: true, false")
        return _BOOL_TEXT[text]
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"model '{model}': config.pbtxt parameter '{key}': {text!r}; allowed: "
                         f"{'an integer' if kind is int else 'a number' if kind is float else 'a string'}") from None


DEFAULTS = ServingSettings()
