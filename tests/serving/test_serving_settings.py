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
                  coalesce_responses=False)
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
