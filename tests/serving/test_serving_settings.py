"""The engine model's run-time serving settings (backend/serving/engine_model/settings.py): one default per key,
shared by the build config, the rendered config.pbtxt and what the engine's model.py reads back."""
from __future__ import annotations

import dataclasses
import json

import pytest
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from backend.serving.engine_model.settings import DEFAULTS, ServingSettings
from builder.config import BuildConfig, ServingConfig
from builder.stages.package import render_repository, template_values


def _rendered_engine_config(tmp_path, **serving) -> dict:
    """The engine's config.pbtxt as the Python backend hands it to model.py (``args["model_config"]``)."""
    cfg = BuildConfig.from_dict({"serving": serving})
    render_repository(template_values(cfg.serving, "../engine"), tmp_path)
    pb = text_format.Parse((tmp_path / "tensorrt_llm" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    return json.loads(json_format.MessageToJson(pb, preserving_proto_field_name=True))


def test_the_build_config_takes_its_defaults_from_the_settings():
    serving = ServingConfig()
    for f in dataclasses.fields(ServingSettings):
        assert getattr(serving, f.name) == getattr(DEFAULTS, f.name), f.name


def test_what_the_build_renders_reads_back_as_the_same_settings(tmp_path):
    assert ServingSettings.from_parameters(_rendered_engine_config(tmp_path / "a")) == DEFAULTS
    chosen = dict(device="cpu", stream_interval=4, step_timeout_s=0.5, response_thread=False,
                  coalesce_responses=False, tool_parser="mistral", reasoning_parser="harmony")
    assert ServingSettings.from_parameters(_rendered_engine_config(tmp_path / "b", **chosen)) == \
        ServingSettings(**chosen)


def test_absent_or_empty_parameters_take_the_default():
    cfg = {"name": "tensorrt_llm", "parameters": {"step_timeout_s": {"string_value": ""}}}
    assert ServingSettings.from_parameters(cfg) == DEFAULTS
    assert DEFAULTS.step_timeout_s == 300.0 and DEFAULTS.parameters()["step_timeout_s"] == "300.0"


@pytest.mark.parametrize("key, text, allowed", [
    ("response_thread", "yes", "allowed: true, false"),
    ("stream_interval", "two", "allowed: an integer"),
    ("step_timeout_s", "5m", "allowed: a number"),
])
def test_a_value_of_the_wrong_type_is_refused_naming_the_key(key, text, allowed):
    cfg = {"name": "tensorrt_llm", "parameters": {key: {"string_value": text}}}
    with pytest.raises(ValueError, match=rf"model 'tensorrt_llm': config.pbtxt parameter '{key}': '{text}'; {allowed}"):
        ServingSettings.from_parameters(cfg)


def test_the_parser_names_are_the_front_doors_tables_and_the_front_door_reads_them(tmp_path):
    """serving.tool_parser / reasoning_parser: the names the build accepts are the rows of the OpenAI
    front door's tables, and the front door takes the bundle's choice unless told otherwise."""
    from backend.serving.engine_model.settings import REASONING_PARSERS, TOOL_PARSERS
    from builder.schema import ConfigError
    from harness.openai.reasoning import REASONING_PARSERS as REASONING_ROWS
    from harness.openai.served_model import bundle_parsers
    from harness.openai.tool_parsers import FORMATS
    assert set(TOOL_PARSERS) == {"auto", "none", *FORMATS}
    assert set(REASONING_PARSERS) == {"auto", "none", *REASONING_ROWS}
    _rendered_engine_config(tmp_path / "a", tool_parser="deepseek", reasoning_parser="think")
    assert bundle_parsers(tmp_path / "a", "tensorrt_llm") == ("deepseek", "think")
    _rendered_engine_config(tmp_path / "b")
    assert bundle_parsers(tmp_path / "b", "tensorrt_llm") == ("auto", "auto")
    with pytest.raises(ConfigError, match="serving.tool_parser.*hermes"):
        BuildConfig.from_dict({"serving": {"tool_parser": "qwen"}})
