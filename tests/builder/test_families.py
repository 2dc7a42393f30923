"""builder/families/: each family maps a config.json written by transformers' own config class to the
expected architecture spec and names its layer's tensors as transformers' model does; a field, rope type,
layer type or value the family cannot map is refused in one line naming the file, the field and the value;
the families the runtime does not run yet are refused at build by name."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from backend.arch_spec import ArchSpec, Attention, Rope
from builder import families, sources
from builder.model_spec import model_spec
from builder.stages.base import StageError

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=1024)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 512}
PHI_SHORT, PHI_LONG = [1.0 + i / 10 for i in range(8)], [2.0 + i for i in range(8)]   # head_dim 16: 8 frequencies


def saved(tmp_path: Path, cls: str, **kw) -> tuple[dict, Path]:
    """config.json as transformers' ``save_pretrained`` writes it for this config class."""
    getattr(transformers, cls)(**{**TINY, **kw}).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    return json.loads(path.read_text()), path


def spec_of(tmp_path: Path, cls: str, **kw) -> tuple[str, ArchSpec]:
    hf, path = saved(tmp_path, cls, **kw)
    family, spec = families.read_spec(hf, path)
    assert ArchSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    return family.name, spec


FULL = (Attention("full", Rope()),)
CASES = {
    "llama": ("LlamaConfig", {}, ArchSpec(("full", "full"), FULL)),
    "llama3": ("LlamaConfig", {"rope_parameters": {**LLAMA3, "rope_theta": 500000.0}, "tie_word_embeddings": True},
               ArchSpec(("full", "full"), (Attention("full", Rope(
                   type="llama3", theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=512)),), tie_word_embeddings=True)),
    "llama_bias": ("LlamaConfig", {"attention_bias": True, "mlp_bias": True},
                   ArchSpec(("full", "full"), FULL, qkv_bias=True, o_bias=True, mlp_bias=True)),
    "mistral": ("MistralConfig", {"sliding_window": 16},
                ArchSpec(("sliding", "sliding"), (Attention("sliding", Rope(), window=16),))),
    "mistral_no_window": ("MistralConfig", {"sliding_window": None}, ArchSpec(("full", "full"), FULL)),
    "qwen2": ("Qwen2Config", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
              ArchSpec(("full", "full"), (Attention("full", Rope(theta=1e6)),), qkv_bias=True)),
    "qwen2_window": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
                     ArchSpec(("full", "sliding"), (Attention("full", Rope()), Attention("sliding", Rope(), 8)),
                              qkv_bias=True)),
    "qwen3": ("Qwen3Config", {"head_dim": 32},
              ArchSpec(("full", "full"), FULL, qk_norm=True)),
    "qwen3_yarn": ("Qwen3Config", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                                       "original_max_position_embeddings": 256}},
                   ArchSpec(("full", "full"), (Attention("full", Rope(
                       type="yarn", theta=1e6, factor=4.0, original_max_position_embeddings=256)),), qk_norm=True)),
    "gemma3": ("Gemma3TextConfig", {"num_hidden_layers": 6, "sliding_window": 8, "head_dim": 16,
                                    "query_pre_attn_scalar": 32},
               ArchSpec(("sliding",) * 5 + ("full",),
                        (Attention("sliding", Rope(theta=10000.0), 8), Attention("full", Rope(theta=1e6))),
                        norm="rms_one_plus", norm_placement="pre_post", activation="gelu_tanh", qk_norm=True,
                        tie_word_embeddings=True, embedding_scale="sqrt_hidden", query_pre_attn_scalar=32)),
    "phi3": ("Phi3Config", {"sliding_window": 32},
             ArchSpec(("sliding", "sliding"), (Attention("sliding", Rope(), 32),), qkv="fused", gate_up="fused")),
    "phi3_longrope": ("Phi3Config", {"max_position_embeddings": 8192, "original_max_position_embeddings": 1024,
                                     "rope_parameters": {"rope_type": "longrope", "short_factor": PHI_SHORT,
                                                         "long_factor": PHI_LONG}},
                      ArchSpec(("full", "full"), (Attention("full", Rope(
                          type="longrope", factor=8.0, short_factor=tuple(PHI_SHORT), long_factor=tuple(PHI_LONG),
                          original_max_position_embeddings=1024)),), qkv="fused", gate_up="fused")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_transformers_config_maps_to_the_expected_spec(case, tmp_path):
    cls, kw, expected = CASES[case]
    name, spec = spec_of(tmp_path, cls, **kw)
    assert name == case.split("_")[0].replace("llama3", "llama")
    assert spec == expected


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "dynamic", "factor": 2.0},
    LLAMA3,
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 16.0,
     "beta_slow": 2.0, "attention_factor": 1.2},
])
def test_each_rope_variant_keeps_its_parameters(rope, tmp_path):
    _, spec = spec_of(tmp_path, "LlamaConfig", rope_parameters={**rope, "rope_theta": 10000.0})
    got = spec.layer(0).rope
    assert got.type == rope["rope_type"]
    for key, value in rope.items():
        if key != "rope_type":
            assert getattr(got, key) == value, key
    if got.type == "dynamic":   # transformers scales a dynamic rope from max_position_embeddings
        assert got.original_max_position_embeddings == TINY["max_position_embeddings"]


def test_gemma3_layers_are_five_sliding_to_one_full_with_two_rope_bases(tmp_path):
    _, spec = spec_of(tmp_path, "Gemma3TextConfig", num_hidden_layers=18, sliding_window=512, head_dim=16)
    kinds = spec.layer_types
    assert kinds.count("sliding") == 15 and kinds.count("full") == 3
    assert [i for i, k in enumerate(kinds) if k == "full"] == [5, 11, 17]
    assert (spec.layer(0).window, spec.layer(0).rope.theta) == (512, 10000.0)
    assert (spec.layer(5).window, spec.layer(5).rope.theta) == (None, 1e6)


def test_gemma3_older_config_form_maps_the_same(tmp_path):
    """Hub configs written before transformers 5: rope_theta / rope_local_base_freq / sliding_window_pattern."""
    hf, path = saved(tmp_path, "Gemma3TextConfig", num_hidden_layers=6, sliding_window=8)
    for key in ("rope_parameters", "layer_types", "_sliding_window_pattern"):
        hf.pop(key)
    hf.update(rope_theta=1e6, rope_local_base_freq=10000.0, rope_scaling=None, sliding_window_pattern=3)
    _, spec = families.read_spec(hf, path)
    assert spec.layer_types == ("sliding", "sliding", "full") * 2
    assert (spec.layer(0).rope.theta, spec.layer(2).rope.theta) == (10000.0, 1e6)


MODELS = {"llama": ("LlamaConfig", "LlamaForCausalLM", {}), "mistral": ("MistralConfig", "MistralForCausalLM", {}),
          "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
          "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16}),
          "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0})}   # its default 32000 > vocab


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_tensor_table_names_transformers_modules(name):
    cfg_cls, model_cls, kw = MODELS[name]
    with torch.device("meta"):
        model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**{**TINY, **kw}))
    modules = {n for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))}
    family = families.BY_NAME[name]
    assert family.architectures == (model_cls,)
    layer1 = {n for n in modules if n.startswith("model.layers.1.")}
    assert set(family.layer_tensor_names(1).values()) == layer1
    assert {families.base.GLOBAL_TENSORS[k] for k in ("embed", "final_norm")} <= modules


@pytest.mark.parametrize("cls, change, fragment", [
    ("LlamaConfig", {"logit_scale": 0.5}, "logit_scale: 0.5 is a field the llama family does not understand"),
    ("Qwen3Config", {"rope_parameters": {"rope_type": "ntk", "rope_theta": 1e6}},
     "rope_parameters.rope_type: 'ntk' is not supported; allowed: default | linear | dynamic | llama3 | yarn"),
    ("LlamaConfig", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0}},
     "rope_parameters.low_freq_factor: 1.0 is not a parameter of a linear rope; allowed: factor"),
    ("LlamaConfig", {"rope_parameters": {"rope_type": "linear"}},
     "rope_parameters.factor: missing; a linear rope needs it"),
    ("LlamaConfig", {"hidden_act": "relu"}, "hidden_act: 'relu' is not supported by the llama family; allowed: silu"),
    ("Gemma3TextConfig", {"layer_types": ["sliding_attention", "chunked_attention"]},
     "layer_types[1]: 'chunked_attention' is not supported; allowed: full_attention | sliding_attention"),
    ("Gemma3TextConfig", {"final_logit_softcapping": 30.0},
     "final_logit_softcapping: 30.0: logit softcapping is not supported; allowed: null"),
    ("Gemma3TextConfig", {"attn_logit_softcapping": 50.0},
     "attn_logit_softcapping: 50.0: attention softcapping is not supported; allowed: null"),
    ("Phi3Config", {"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 3},
                    "original_max_position_embeddings": 512},
     "rope_parameters.short_factor: 3 values for 8 rotary frequencies"),
    ("Qwen2Config", {"use_sliding_window": "yes"}, "use_sliding_window: 'yes' is not a boolean; allowed: true | false"),
    ("Qwen2Config", {"layer_types": ["full_attention", "sliding_attention"]},
     "use_sliding_window: False gives no window, but layer_types has sliding layers"),
    ("MistralConfig", {"sliding_window": 0}, "sliding_window: 0 is not a positive integer"),
])
def test_what_a_family_cannot_map_is_refused_in_one_line(cls, change, fragment, tmp_path):
    hf, path = saved(tmp_path, cls, head_dim=16) if cls == "Gemma3TextConfig" else saved(tmp_path, cls)
    hf.update(change)
    with pytest.raises(StageError) as exc:
        families.read_spec(hf, path)
    text = str(exc.value)
    assert "\n" not in text and text.startswith(f"{path}: {fragment}"), text


def test_runtime_tables_come_from_the_families():
    assert sources.SUPPORTED_HF_ARCHITECTURES == {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                                                  "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                                                  "Gemma3ForCausalLM": "gemma3", "Phi3ForCausalLM": "phi3",
                                                  "MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe",
                                                  "Qwen2MoeForCausalLM": "qwen2_moe"}
    assert sources.SUPPORTED_GGUF_ARCHITECTURES == {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2",
                                                    "qwen3": "qwen3", "gemma3": "gemma3", "phi3": "phi3"}
    assert families.BY_GGUF["gemma3"].name == "gemma3" and families.BY_MODEL_TYPE["gemma3_text"].name == "gemma3"


def test_a_family_the_runtime_does_not_run_yet_is_refused_at_build(tmp_path, monkeypatch):
    """Every family the tables know runs today; the next one lands mapped first (``runtime=False``) and
    must be refused at build in one line: phi3 held back stands in for it."""
    import dataclasses

    held = dataclasses.replace(families.BY_NAME["phi3"], runtime=False)
    monkeypatch.setattr(families, "FAMILIES", tuple(held if f.name == "phi3" else f for f in families.FAMILIES))
    monkeypatch.setitem(families.BY_ARCHITECTURE, "Phi3ForCausalLM", held)
    monkeypatch.setitem(families.BY_MODEL_TYPE, "phi3", held)
    monkeypatch.setattr(sources, "SUPPORTED_HF_ARCHITECTURES", families.runtime_table(families.BY_ARCHITECTURE))
    config = transformers.Phi3Config(**TINY)
    config.architectures = ["Phi3ForCausalLM"]
    config.save_pretrained(tmp_path)
    line = f"{tmp_path / 'config.json'}: architectures: phi3 is a known family but the runtime does not run it " \
           f"yet; allowed: llama, mistral, qwen2, qwen3, gemma3, mixtral, " \
           f"qwen3_moe, qwen2_moe"
    with pytest.raises(StageError) as exc:
        sources.resolve(str(tmp_path), "x.yaml")
    assert str(exc.value) == line
    with pytest.raises(StageError) as exc:
        model_spec(tmp_path, "bfloat16")
    assert str(exc.value) == line


def test_the_model_section_keeps_its_keys_and_gains_arch(tmp_path):
    config = transformers.MistralConfig(**TINY, sliding_window=16, rope_theta=1e6)
    config.architectures = ["MistralForCausalLM"]
    config.save_pretrained(tmp_path)
    m = model_spec(tmp_path, "bfloat16")
    assert m == {
        "architecture": "mistral", "hidden_size": 64, "intermediate_size": 96, "num_layers": 2, "num_heads": 4,
        "num_kv_heads": 2, "head_dim": 16, "vocab_size": 256, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "rope_scaling": None, "max_position_embeddings": 1024, "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "sliding_window": 16, "bos_token_id": 1, "eos_token_ids": [2],
        "pad_token_id": 2, "dtype": "bfloat16", "arch": families.read_spec(config.to_dict(), "-")[1].to_dict()}
    assert ArchSpec.from_dict(m["arch"]).layer(1) == Attention("sliding", Rope(theta=1e6), 16)


def test_quantization_config_is_read_only_beside_modelopts_own_file(tmp_path):
    config = transformers.LlamaConfig(**TINY)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(StageError, match=r"config.json: quantization_config: .* llama family does not understand"):
        model_spec(tmp_path, "bfloat16")
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8"}}))
    assert model_spec(tmp_path, "bfloat16")["arch"]["layer_types"] == ["full", "full"]


@pytest.mark.slow
def test_a_built_bundle_carries_the_spec(tmp_path, smollm2_hf_dir):
    """The import stage's spec reaches engine.json's model.arch through compile, and reads back typed."""
    import shutil

    from backend import bundle
    from builder.config import BuildConfig
    from builder.pipeline import run_pipeline

    src = tmp_path / "qwen2"
    config = transformers.Qwen2Config(**TINY, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(src)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(smollm2_hf_dir / name, src / name)
    cfg = BuildConfig.from_dict({}, "qwen2.yaml", [f"model.source={src}", "quantization.format=none",
                                                   "quantization.kv_cache=none", "verify.enabled=false",
                                                   "engine.max_seq_len=1024", "engine.max_input_len=512",
                                                   "engine.max_kv_tokens=2048"])
    out = run_pipeline(cfg, tmp_path / "out", until="compile", log=lambda m: None).bundle
    expected = families.read_spec(json.loads((src / "config.json").read_text()), src / "config.json")[1]
    assert json.loads((out / "engine.json").read_text())["model"]["arch"] == expected.to_dict()
    assert bundle.read(out).model.arch_spec == expected and expected.qkv_bias


@pytest.mark.parametrize("case", ["llama", "llama3", "mistral", "mistral_no_window", "qwen2", "qwen2_window"])
def test_the_spec_agrees_with_the_model_sections_own_keys(case, tmp_path):
    """For the families the runtime runs, the keys it reads today and the spec say the same thing."""
    cls, kw, _ = CASES[case]
    config = getattr(transformers, cls)(**{**TINY, **kw})
    config.architectures = [cls.replace("Config", "ForCausalLM")]
    config.save_pretrained(tmp_path)
    m = model_spec(tmp_path, "bfloat16")
    spec = ArchSpec.from_dict(m["arch"])
    windows = {a.window for a in spec.attention if a.kind == "sliding"}
    assert m["sliding_window"] == (windows.pop() if windows else None)
    rope = spec.layer(0).rope
    assert m["rope_theta"] == rope.theta and (m["rope_scaling"] is None) == (rope.type == "default")
    assert (m["tie_word_embeddings"], m["attention_bias"], m["mlp_bias"]) == \
        (spec.tie_word_embeddings, spec.qkv_bias, spec.mlp_bias)


@pytest.mark.parametrize("window", [None, 32])
def test_a_phi3_window_reaches_the_model_section_the_runtime_checks(window, tmp_path):
    """Phi-3 has no use_sliding_window switch: its window comes from the spec, so a max_seq_len above it is
    refused at load (backend/runtime/native.py) instead of attending past the window."""
    config = transformers.Phi3Config(**TINY, sliding_window=window, pad_token_id=0)
    config.architectures = ["Phi3ForCausalLM"]
    config.save_pretrained(tmp_path)
    assert model_spec(tmp_path, "float32")["sliding_window"] == window


def test_gemma3_chat_turns_for_a_checkpoint_without_a_template():
    # the base Gemma 3 GGUF carries no chat template; the family's writes Gemma 3's documented turns
    from backend.serving.conversion.tokenizer import TextTokenizer
    from builder.families import BY_NAME

    class _Tok:   # render_messages needs no vocabulary
        pass

    tok = TextTokenizer(_Tok(), BY_NAME["gemma3"].chat_template, {"bos_token": "<bos>", "eos_token": "<eos>"})
    assert tok.render_messages([{"role": "user", "content": "Hi?"}]) == \
        "<bos><start_of_turn>user\nHi?<end_of_turn>\n<start_of_turn>model\n"
    # no system role in Gemma 3: the system text opens the first user turn; assistant turns are "model";
    # OpenAI's text parts are joined
    assert tok.render_messages([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
