"""Rendering the Triton model repository templates (Triton's own parser checks them in test_server)."""
from __future__ import annotations

import shutil

import pytest

from builder.config import BuildConfig
from builder.stages.package import (MODELS, TEMPLATE_ROOT, RenderError, render_repository, render_text,
                                    template_values)


def values(**serving):
    cfg = BuildConfig.from_dict({"serving": serving} if serving else {})
    return template_values(cfg.serving, "../engine")


def test_renders_every_model_with_config_values(tmp_path):
    names = render_repository(values(model_names={"ensemble": "smollm2"}, engine_instances=2, stream_interval=4,
                                     response_thread=False, coalesce_responses=False), tmp_path)
    assert sorted(names) == sorted(["preprocessing", "tensorrt_llm", "postprocessing", "smollm2", "tensorrt_llm_bls"])
    for name in names:
        cfg = (tmp_path / name / "config.pbtxt").read_text()
        assert "${" not in cfg
        assert (tmp_path / name / "1").is_dir()
    engine = (tmp_path / "tensorrt_llm" / "config.pbtxt").read_text()
    assert "count: 2 kind: KIND_CPU" in engine
    assert 'key: "stream_interval" value: { string_value: "4" }' in engine
    assert 'key: "response_thread" value: { string_value: "false" }' in engine
    assert 'key: "coalesce_responses" value: { string_value: "false" }' in engine
    render_repository(values(), tmp_path / "default")
    default = (tmp_path / "default" / "tensorrt_llm" / "config.pbtxt").read_text()
    assert 'key: "response_thread" value: { string_value: "true" }' in default
    assert 'key: "coalesce_responses" value: { string_value: "true" }' in default
    assert 'string_value: "../engine"' in engine and "decoupled: true" in engine
    assert 'name: "smollm2"' in (tmp_path / "smollm2" / "config.pbtxt").read_text()
    assert (tmp_path / "tensorrt_llm" / "1" / "model.py").read_text() == (TEMPLATE_ROOT / "engine/1/model.py").read_text()
    assert 'string_value: "tensorrt_llm" }' in (tmp_path / "tensorrt_llm_bls" / "config.pbtxt").read_text()


def test_every_model_name_is_configurable_and_threaded_through(tmp_path):
    custom = {"preprocessing": "pre", "engine": "gen", "postprocessing": "post", "ensemble": "llm", "bls": "llm_bls"}
    names = render_repository(values(model_names=custom, decoupled=False), tmp_path)
    assert sorted(names) == sorted(custom.values())
    ensemble = (tmp_path / "llm" / "config.pbtxt").read_text()
    steps = [line.split('"')[1] for line in ensemble.splitlines() if line.strip().startswith("model_name:")]
    assert steps == ["pre", "gen", "post"]
    for role, name in custom.items():
        assert f'name: "{name}"' in (tmp_path / name / "config.pbtxt").read_text(), role
    bls = (tmp_path / "llm_bls" / "config.pbtxt").read_text()
    assert 'key: "engine_model" value: { string_value: "gen" }' in bls
    # non-decoupled (NVIDIA's decoupled_mode=false): the engine and bls answer one response per request
    assert "decoupled: false" in bls and "decoupled: false" in (tmp_path / "gen" / "config.pbtxt").read_text()
    from harness.model_names import repository_names
    assert repository_names(tmp_path).as_dict() == custom


def test_unknown_placeholder_fails_naming_file_and_name():
    with pytest.raises(RenderError, match=r"x.pbtxt: unknown placeholder \$\{engine_dri\}; known: "):
        render_text('engine: "${engine_dri}"', {"engine_dir": "e"}, "x.pbtxt")


@pytest.mark.parametrize("text", ["count: ${ engine_instances }", "count: ${engine-instances}", "a ${"])
def test_malformed_or_unfilled_placeholder_fails(text):
    with pytest.raises(RenderError, match="line 1: unfilled or malformed placeholder"):
        render_text(text, {"engine_instances": 1}, "x.pbtxt")


def test_template_with_unknown_placeholder_leaves_nothing_behind(tmp_path):
    templates = tmp_path / "templates"
    shutil.copytree(TEMPLATE_ROOT, templates, ignore=shutil.ignore_patterns("__pycache__"))
    cfg = templates / "bls" / "config.pbtxt.tmpl"
    cfg.write_text(cfg.read_text() + '\nparameters: { key: "x" value: { string_value: "${max_lora_rank}" } }\n')
    out = tmp_path / "out"
    with pytest.raises(RenderError, match=r"bls/config.pbtxt.tmpl: unknown placeholder \$\{max_lora_rank\}"):
        render_repository(values(), out, templates)
    assert not out.exists()


def test_value_used_by_no_template_fails(tmp_path):
    v = values()
    v["max_lora_rank"] = 8
    with pytest.raises(RenderError, match="value\\(s\\) max_lora_rank are used by no template"):
        render_repository(v, tmp_path)


@pytest.mark.parametrize("clash", ["tensorrt_llm", "tensorrt_llm_bls", "preprocessing"])
def test_ensemble_name_may_not_clash_with_another_model(tmp_path, clash):
    v = values()
    v["ensemble_name"] = clash  # the config refuses this already; rendering checks again
    with pytest.raises(RenderError, match="model names must differ"):
        render_repository(v, tmp_path)


def test_every_template_folder_is_listed():
    assert sorted(p.name for p in TEMPLATE_ROOT.iterdir() if p.is_dir()) == sorted(MODELS)
