"""Config schema: shipped configs validate, every kind of mistake is one clear line."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from builder.config import QUANT_FORMATS, BuildConfig, ConfigError
from builder.config_model import check_against_model

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "configs").glob("*.yaml"))
SMOLLM2_SHAPE = {"num_kv_heads": 3, "num_heads": 9, "head_dim": 64, "hidden_size": 576,
                 "intermediate_size": 1536, "num_layers": 30, "max_position_embeddings": 8192,
                 "vocab_size": 49152}


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def error_of(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_configs_validate(path):
    cfg = BuildConfig.from_yaml(path)
    assert cfg.file == str(path)
    assert cfg.stem == path.stem


def test_expected_configs_are_shipped():
    names = {p.name for p in SHIPPED}
    for name in ("smollm2-135m-fp8.yaml", "smollm2-135m-bf16.yaml", "smollm2-135m-nvfp4.yaml",
                 "smollm2-135m-int4-awq.yaml", "llama3.1-8b-fp8.yaml", "llama3.1-8b-nvfp4.yaml", "llama70b-fp8.yaml",
                 "qwen3-8b-fp8.yaml", "qwen3-32b-fp8.yaml"):
        assert name in names


def test_defaults_match_contract():
    cfg = BuildConfig.from_dict({})
    assert cfg.quantization.format == "fp8" and cfg.quantization.kv_cache == "fp8"
    assert cfg.quantization.exclude == ("lm_head",)
    assert cfg.engine.kv_block_size == 16 and cfg.engine.target_sms == (90, 100)
    assert cfg.speculative.train.steps == 200
    assert cfg.output_dir() == Path("build/engine")


def test_missing_file(tmp_path):
    msg = error_of(BuildConfig.from_yaml, tmp_path / "nope.yaml")
    assert "nope.yaml" in msg and "not found" in msg


def test_invalid_yaml_names_line(tmp_path):
    p = write(tmp_path, "engine:\n  max_batch_size: [1, 2\n")
    msg = error_of(BuildConfig.from_yaml, p)
    assert str(p) in msg and "invalid YAML" in msg and "line" in msg


def test_unknown_key_suggests_closest(tmp_path):
    p = write(tmp_path, "engine:\n  max_batch_sise: 8\n")
    msg = error_of(BuildConfig.from_yaml, p)
    assert msg.startswith(f"{p}: engine.max_batch_sise: unknown key")
    assert "did you mean 'engine.max_batch_size'" in msg


def test_unknown_section(tmp_path):
    msg = error_of(BuildConfig.from_yaml, write(tmp_path, "quantisation:\n  format: fp8\n"))
    assert "did you mean 'quantization'" in msg


def test_wrong_type(tmp_path):
    msg = error_of(BuildConfig.from_yaml, write(tmp_path, "engine:\n  max_batch_size: lots\n"))
    assert "engine.max_batch_size: expected an integer, got 'lots'" in msg and "allowed:" in msg
    # booleans are not integers, even though Python says so
    assert "expected an integer" in error_of(BuildConfig.from_dict, {"engine": {"tp_size": True}})


def test_unknown_quantization_format(tmp_path):
    msg = error_of(BuildConfig.from_yaml, write(tmp_path, "quantization:\n  format: fp4\n"))
    assert "quantization.format: invalid value 'fp4'" in msg
    assert "allowed: none | fp8 | nvfp4 | int4_awq | int8_sq | w4a8_awq" in msg


@pytest.mark.parametrize("overrides, key, fragment", [
    (["engine.kv_block_size=24"], "engine.kv_block_size", "not a power of two"),
    (["engine.max_input_len=2048"], "engine.max_input_len", "must be below engine.max_seq_len"),
    (["engine.enable_chunked_prefill=false", "engine.max_num_tokens=512"], "engine.max_num_tokens",
     "without chunked prefill"),
    (["engine.max_num_tokens=16", "engine.max_batch_size=32"], "engine.max_num_tokens", "below engine.max_batch_size"),
    (["engine.max_kv_tokens=100"], "engine.max_kv_tokens", "cannot hold one sequence"),
    (["engine.target_sms=[]"], "engine.target_sms", "at least one"),
    (["engine.tp_size=65"], "engine.tp_size", "65 is too large; allowed: an integer in 1..64"),
    (["engine.tp_size=3", "speculative.method=eagle3"], "engine.tp_size",
     "3 cannot run with speculative.method=eagle3"),
    (["model.max_position_embeddings=1024"], "engine.max_seq_len", "exceeds the model's context"),
    (["speculative.tree=static"], "speculative.tree_choices", "required when speculative.tree=static"),
    (["speculative.tree_choices=[[0]]"], "speculative.tree_choices", "only used with speculative.tree=static"),
    (["speculative.tree=dynamic", "speculative.min_draft_prob=0.3"], "speculative.min_draft_prob",
     "only used with speculative.tree=chain"),
    (["serving.grpc_port=8000"], "serving", "ports must differ"),
    (["quantization.calibration.num_samples=0"], "quantization.calibration.num_samples", "too small"),
    (["model.source="], "model.source", "expected a string"),
])
def test_impossible_values_and_combinations(overrides, key, fragment):
    msg = error_of(BuildConfig.from_dict, {}, "x.yaml", overrides)
    assert msg.startswith(f"x.yaml: {key}: "), msg
    assert fragment in msg


def test_overrides_parse_yaml_scalars():
    cfg = BuildConfig.from_dict({}, "x.yaml", ["engine.max_batch_size=8", "engine.enable_prefix_caching=false",
                                             "engine.target_sms=[90]", "verify.max_mean_kl=0.5",
                                             "speculative.train={steps: 3}", "model.source=/a=b"])
    assert cfg.engine.max_batch_size == 8 and cfg.engine.enable_prefix_caching is False
    assert cfg.engine.target_sms == (90,) and cfg.verify.max_mean_kl == 0.5
    assert cfg.speculative.train.steps == 3 and cfg.speculative.train.seq_len == 128
    assert cfg.model.source == "/a=b"


def test_override_mistakes():
    assert "did you mean 'engine.max_batch_size'" in error_of(BuildConfig.from_dict, {}, "x", ["engin.max_batch_size=2"])
    assert "must look like key.path=value" in error_of(BuildConfig.from_dict, {}, "x", ["engine.max_batch_size"])


def test_section_hash_is_stable_and_specific(tmp_path):
    a = BuildConfig.from_yaml(write(tmp_path, "engine: {max_batch_size: 8, kv_block_size: 32}\n", "a.yaml"))
    b = BuildConfig.from_yaml(write(tmp_path, "engine:\n  kv_block_size: 32\n  max_batch_size: 8\n", "b.yaml"))
    c = BuildConfig.from_dict({}, "c.yaml", ["engine.max_batch_size=9", "engine.kv_block_size=32"])
    assert a.section_hash("engine") == b.section_hash("engine") != c.section_hash("engine")
    assert a.section_hash("quantization") == c.section_hash("quantization")
    assert a.config_hash() == b.config_hash()
    assert len(a.section_hash("model")) == 64
    with pytest.raises(KeyError):
        a.section_hash("nope")
    with pytest.raises(KeyError):
        a.section_hash("speculative.nope")


def test_draft_stage_key_ignores_tree_settings():
    # Trying another tree shape or threshold must not train the draft again; its data must.
    from builder.pipeline import stage_key
    from builder.stages import get

    cfg = REPO / "configs" / "smollm2-135m-bf16-eagle3.yaml"
    key = lambda *o: stage_key(get("draft"), BuildConfig.from_yaml(cfg, list(o)), {}, "")  # noqa: E731
    base = key()
    assert key("speculative.tree=dynamic", "speculative.min_draft_prob=0") == base
    assert key("speculative.max_draft_len=6", "speculative.min_draft_prob=0.5") == base
    assert key("speculative.train.steps=7") != base and key("speculative.aux_layers=[2,15,27]") != base
    assert stage_key(get("compile"), BuildConfig.from_yaml(cfg, ["speculative.max_draft_len=6"]), {}, "") != \
        stage_key(get("compile"), BuildConfig.from_yaml(cfg), {}, "")   # engine.json gets the new settings


def test_config_is_frozen():
    cfg = BuildConfig.from_dict({})
    with pytest.raises(AttributeError):
        cfg.engine.max_batch_size = 3


@pytest.mark.parametrize("overrides, model, key, fragment", [
    # the runtime's own rules (backend/runtime/tp_rules.py): every split dimension must divide
    (["engine.tp_size=2"], {}, "engine.tp_size", "2 does not divide the model's 9 attention heads"),
    # fewer KV heads than ranks are replicated, but only when the ranks are a multiple of them
    (["engine.tp_size=3"], {"num_heads": 6, "num_kv_heads": 2}, "engine.tp_size",
     "3 neither divides the model's 2 KV heads nor is a multiple of them (num_key_value_heads=2, tp_size=3): "
     "each rank holds its share of them, or one replicated; allowed: 1 | 2 | 6"),
    (["engine.tp_size=3"], {"intermediate_size": 1544}, "engine.tp_size",
     "3 does not divide the model's 1544 intermediate_size"),
    (["engine.tp_size=3"], {"vocab_size": 49153}, "engine.tp_size", "3 does not divide the model's 49153 vocab_size"),
    (["engine.max_seq_len=9000", "engine.max_num_tokens=9000"], {}, "engine.max_seq_len", "exceeds the model's context of 8192"),
    (["quantization.format=int4_awq", "quantization.group_size=128"], {}, "quantization.group_size",
     "does not divide the model's hidden_size"),
    (["quantization.format=nvfp4"], {"intermediate_size": 1544}, "quantization.format", "divisible by 16"),
    # a row-parallel split must leave each rank whole scale groups (o's and down's input features)
    (["engine.tp_size=4", "quantization.format=nvfp4"], {"num_heads": 12, "num_kv_heads": 4, "intermediate_size": 1568},
     "engine.tp_size", "4 gives each rank 392 of the 1568 input features of down (intermediate_size), not a "
     "multiple of nvfp4's block 16: a rank would hold part of a scale group; allowed: 1 | 2"),
    (["engine.tp_size=2", "quantization.format=int4_awq", "quantization.group_size=64"],
     {"num_heads": 12, "num_kv_heads": 4, "intermediate_size": 1600}, "engine.tp_size",
     "2 gives each rank 800 of the 1600 input features of down (intermediate_size), not a multiple of "
     "int4_awq's group_size 64: a rank would hold part of a scale group; allowed: 1"),
    (["speculative.method=eagle3", "speculative.aux_layers=[1, 40]"], {}, "speculative.aux_layers", "layer 40"),
])
def test_model_shape_checks(overrides, model, key, fragment):
    cfg = BuildConfig.from_dict({}, "x.yaml", overrides)
    msg = error_of(check_against_model, cfg, {**SMOLLM2_SHAPE, **model})
    assert msg.startswith(f"x.yaml: {key}: ") and fragment in msg
    if key == "engine.tp_size" and "allowed" not in fragment:   # the tp sizes that would work for this model
        assert msg.endswith("allowed: 1 | 3" if not model else "allowed: 1")


def test_tp_size_is_built_when_the_model_splits():
    """SmolLM2 (9 heads, 3 KV heads, intermediate 1536, vocab 49152) splits 3 ways in every format: o's
    576 and down's 1536 input features give each rank 192 and 512, whole groups of 64 and blocks of 16.
    With one KV head (multi-query attention) it splits 3 ways too: each rank holds that head."""
    for fmt in QUANT_FORMATS:
        for kv in (3, 1):
            check_against_model(BuildConfig.from_dict({}, "x.yaml", ["engine.tp_size=3", f"quantization.format={fmt}"]),
                                {**SMOLLM2_SHAPE, "num_kv_heads": kv})
    assert BuildConfig.from_dict({}, "x.yaml", ["engine.tp_size=64"]).engine.tp_size == 64


def test_model_shape_ok_for_shipped_smollm2_configs():
    for path in SHIPPED:
        if path.name.startswith("smollm2"):
            check_against_model(BuildConfig.from_yaml(path), SMOLLM2_SHAPE)


def _cli(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "builder", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_cli_validate(tmp_path):
    ok = _cli("validate", *map(str, SHIPPED))
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.count("ok: ") == len(SHIPPED)
    bad = write(tmp_path, "engine:\n  kv_block_size: 12\n")
    res = _cli("validate", str(SHIPPED[0]), str(bad))
    assert res.returncode != 0
    assert res.stderr.strip().splitlines() == [f"error: {bad}: engine.kv_block_size: 12 is not a power of two; "
                                                 f"allowed: a power of two, 1..1024"]


def test_cli_help_explains_options():
    top = _cli("--help")
    assert top.returncode == 0 and all(c in top.stdout for c in ("build", "validate", "inspect"))
    build = _cli("build", "--help")
    assert build.returncode == 0
    for option in ("--output", "--force", "--debug", "--until", "key=value", "overrides", "stages"):
        assert option in build.stdout


def test_exponent_floats_without_a_dot_are_numbers():
    # PyYAML (YAML 1.1) reads 1e-3 as a string; users write it that way in files and overrides
    from builder.config import BuildConfig
    cfg = BuildConfig.from_yaml(REPO / "configs" / "smollm2-135m-bf16-eagle3.yaml",
                                ["speculative.train.learning_rate=1e-3"])
    assert cfg.speculative.train.learning_rate == 0.001
    with pytest.raises(ConfigError, match=r"speculative.train.learning_rate: expected a number, got '1e-3x'"):
        BuildConfig.from_yaml(REPO / "configs" / "smollm2-135m-bf16-eagle3.yaml",
                              ["speculative.train.learning_rate=1e-3x"])


def test_build_summary_states_verify_figures():
    from builder.report import verify_line
    line = verify_line({"top1_agreement": 0.91, "mean_kl": 0.058, "passed": True,
                        "speculative": {"mean_acceptance_length": 1.35, "tokens_per_target_pass": 1.2,
                                        "tree": "dynamic"}})
    assert "top-1 agreement 0.910" in line and "(passed)" in line
    assert "draft: 1.20 tokens per target pass (dynamic, acceptance length 1.35 per verifying step)" in line
    assert "FAILED" in verify_line({"top1_agreement": 0.5, "mean_kl": 0.9, "passed": False})
    assert verify_line({}) == ""


@pytest.mark.parametrize("name", ["../../escaped_model", "/tmp/abs_model", "a b/c", "a/b", "..", ".", "a\\b",
                                  "caf\u00e9", "x\ny"])
@pytest.mark.parametrize("role", ["preprocessing", "engine", "postprocessing", "ensemble", "bls"])
def test_model_name_must_be_one_plain_folder_name(tmp_path, name, role):
    # serving.model_names.<role> becomes <output>/model_repository/<name>: a path must never escape
    msg = error_of(BuildConfig.from_dict, {"serving": {"model_names": {role: name}}}, "x.yaml")
    assert msg.startswith(f"x.yaml: serving.model_names.{role}: "), msg
    assert "not a plain folder name" in msg and "allowed: one folder name of letters, digits" in msg
    p = write(tmp_path, "serving: {}\n")
    assert f"serving.model_names.{role}" in error_of(BuildConfig.from_yaml, p,
                                                     [f"serving.model_names.{role}={name!r}"])


def test_model_names_default_to_nvidias_and_plain_names_pass():
    names = BuildConfig.from_dict({}).serving.model_names
    assert names.as_dict() == {"preprocessing": "preprocessing", "engine": "tensorrt_llm",
                               "postprocessing": "postprocessing", "ensemble": "ensemble",
                               "bls": "tensorrt_llm_bls"}
    for name in ("ensemble", "llama-3.1_8b", "v2.0"):
        assert BuildConfig.from_dict({"serving": {"model_names": {"ensemble": name}}}).serving.model_names.ensemble == name


def test_model_names_must_differ():
    msg = error_of(BuildConfig.from_dict, {"serving": {"model_names": {"ensemble": "tensorrt_llm"}}}, "x.yaml")
    assert msg.startswith("x.yaml: serving.model_names: model names must differ"), msg


def test_removed_model_name_key_says_what_to_use(tmp_path):
    msg = error_of(BuildConfig.from_dict, {"serving": {"model_name": "smollm2"}}, "x.yaml")
    assert msg.startswith("x.yaml: serving.model_name: replaced by serving.model_names.ensemble"), msg
    assert "model_names: {ensemble: smollm2}" in msg


@pytest.mark.parametrize("key", ["decoupled", "response_thread", "coalesce_responses"])
def test_serving_switches_are_bools_defaulting_to_true(key):
    assert getattr(BuildConfig.from_dict({}).serving, key) is True
    assert getattr(BuildConfig.from_dict({"serving": {key: False}}).serving, key) is False
    assert f"serving.{key}" in error_of(BuildConfig.from_dict, {"serving": {key: "yes"}}, "x.yaml")


def test_render_repository_refuses_escaping_model_names(tmp_path):
    from builder.stages.package import RenderError, render_repository, template_values
    serving = BuildConfig.from_dict({}).serving
    values = {**template_values(serving, "../engine"), "ensemble_name": "../escaped"}
    with pytest.raises(RenderError, match="not a plain folder name"):
        render_repository(values, tmp_path / "repo")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("override, key", [
    ("engine.kv_cache_free_mem_fraction=.nan", "engine.kv_cache_free_mem_fraction"),
    ("verify.min_top1_agreement=.nan", "verify.min_top1_agreement"),   # float | None
    ("verify.max_mean_kl=.inf", "verify.max_mean_kl"),
    ("speculative.train.learning_rate=-.inf", "speculative.train.learning_rate"),
    ("speculative.min_draft_prob=.NaN", "speculative.min_draft_prob"),
    ("verify.max_mean_kl=1e999", "verify.max_mean_kl"),                # exponent string that overflows
    ("verify.max_mean_kl=1" + "0" * 400, "verify.max_mean_kl"),        # integer beyond float range
])
def test_floats_refuse_nan_and_infinity(override, key):
    # NaN passes every min/max comparison: it used to build and land in engine.json, or fail late
    msg = error_of(BuildConfig.from_dict, {}, "x.yaml", [override])
    assert msg.startswith(f"x.yaml: {key}: "), msg
    assert "is not a finite number" in msg and "(not NaN or infinity)" in msg


def test_floats_refuse_nan_in_yaml_files(tmp_path):
    p = write(tmp_path, "engine:\n  kv_cache_free_mem_fraction: .nan\n")
    msg = error_of(BuildConfig.from_yaml, p)
    assert msg == (f"{p}: engine.kv_cache_free_mem_fraction: nan is not a finite number; "
                   "allowed: a number in 0.01..1.0 (not NaN or infinity)")


@pytest.mark.parametrize("value, parsed", [("auto", "auto"), ("true", True), ("false", False)])
def test_cuda_graphs_is_a_config_key_written_into_the_bundle(value, parsed):
    from builder.stages.compile import _engine_section
    cfg = BuildConfig.from_yaml(REPO / "configs" / "smollm2-135m-fp8.yaml", [f"engine.cuda_graphs={value}"])
    assert cfg.engine.cuda_graphs == parsed
    assert _engine_section(cfg)["cuda_graphs"] == parsed


def test_cuda_graphs_refuses_other_values():
    with pytest.raises(ConfigError, match=r"engine\.cuda_graphs.*allowed: auto \| true \| false"):
        BuildConfig.from_yaml(REPO / "configs" / "smollm2-135m-fp8.yaml", ["engine.cuda_graphs=maybe"])


@pytest.mark.parametrize("value, parsed", [("auto", "auto"), ("true", True), ("false", False)])
def test_overlap_scheduling_is_a_config_key_written_into_the_bundle(value, parsed):
    from builder.stages.compile import _engine_section
    cfg = BuildConfig.from_yaml(REPO / "configs" / "smollm2-135m-fp8.yaml", [f"engine.overlap_scheduling={value}"])
    assert cfg.engine.overlap_scheduling == parsed
    assert _engine_section(cfg)["overlap_scheduling"] == parsed


def test_overlap_scheduling_default_keeps_existing_build_hashes():
    """Left out of the hashes while auto (bundles built before the key keep theirs); any other value
    rebuilds the engine."""
    base = BuildConfig.from_yaml(REPO / "configs" / "smollm2-135m-fp8.yaml")
    d = base.to_dict()
    del d["engine"]["overlap_scheduling"]
    del d["engine"]["cpu_dtype"]   # the other keys added since, neutral the same way
    del d["engine"]["runtime"]
    from builder.config import _sha256_json
    assert base.section_hash("engine") == _sha256_json(d["engine"])
    on = BuildConfig.from_yaml(REPO / "configs" / "smollm2-135m-fp8.yaml", ["engine.overlap_scheduling=false"])
    assert on.config_hash() != base.config_hash() and on.section_hash("engine") != base.section_hash("engine")


def test_overlap_scheduling_refuses_other_values_and_speculation():
    with pytest.raises(ConfigError, match=r"engine\.overlap_scheduling.*allowed: auto \| true \| false"):
        BuildConfig.from_yaml(REPO / "configs" / "smollm2-135m-fp8.yaml", ["engine.overlap_scheduling=maybe"])
    with pytest.raises(ConfigError, match=r"engine\.overlap_scheduling: true cannot run with speculative"):
        BuildConfig.from_yaml(REPO / "configs" / "smollm2-135m-bf16-eagle3.yaml", ["engine.overlap_scheduling=true"])


@pytest.mark.parametrize("value", ["auto", "float32", "bfloat16"])
def test_cpu_dtype_is_a_config_key_written_into_the_bundle(value):
    from builder.stages.compile import _engine_section
    cfg = BuildConfig.from_yaml(REPO / "configs" / "smollm2-135m-fp8.yaml", [f"engine.cpu_dtype={value}"])
    assert cfg.engine.cpu_dtype == value and _engine_section(cfg)["cpu_dtype"] == value
    base = BuildConfig.from_yaml(REPO / "configs" / "smollm2-135m-fp8.yaml")
    # auto keeps every existing build's hash; a pinned dtype is another engine
    assert (cfg.config_hash() == base.config_hash()) == (value == "auto")


def test_cpu_dtype_refuses_other_values():
    with pytest.raises(ConfigError, match=r"engine\.cpu_dtype: invalid value 'fp16'; allowed: auto \| float32 \| bfloat16"):
        BuildConfig.from_yaml(REPO / "configs" / "smollm2-135m-fp8.yaml", ["engine.cpu_dtype=fp16"])
