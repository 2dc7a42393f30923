"""The recipe table, config checks and calibration data: every user mistake gets one clear line."""

from __future__ import annotations

import json

import pytest

from quant import calibration as C
from quant import recipes as R
from quant.quantize import QuantSettings

# SmolLM2-135M's linears: hidden 576 (q/k/v/gate/up/o inputs), intermediate 1536 (down input)
SMOLLM2_IN = {"model.layers.0.self_attn.q_proj": 576, "model.layers.0.self_attn.o_proj": 576,
              "model.layers.0.mlp.down_proj": 1536}


def test_unknown_format_and_kv_cache_list_allowed_values():
    with pytest.raises(R.QuantConfigError, match="quantization.format: unknown format 'fp4'; allowed: "
                                                  "none \\| fp8 \\| nvfp4 \\| int4_awq \\| int8_sq \\| w4a8_awq"):
        R.get_recipe("fp4")
    with pytest.raises(R.QuantConfigError, match="quantization.kv_cache: unknown KV cache format 'int8'; "
                                                  "allowed: none \\| fp8"):
        R.check_kv_cache("int8")
    with pytest.raises(R.QuantConfigError, match="unknown format 'FP8'"):
        QuantSettings.from_config({"format": "FP8"})


def test_group_size_must_divide_every_input_size():
    # ModelOpt's default 128 does not divide 576 = 2^6 * 9: the error says which linear and what fits
    with pytest.raises(R.QuantConfigError, match="quantization.group_size: 128 does not divide the input features "
                                                  "of model.layers.0.self_attn.q_proj \\(576\\).*allowed: 16 \\| 32 \\| 64$"):
        R.check_group_size("int4_awq", 128, SMOLLM2_IN)
    with pytest.raises(R.QuantConfigError, match="group_size: 0 is not a positive integer"):
        R.check_group_size("w4a8_awq", 0, SMOLLM2_IN)
    assert R.check_group_size("int4_awq", 64, SMOLLM2_IN) == 64
    assert R.check_group_size("fp8", 128, SMOLLM2_IN) is None  # no blocks: group size is not recorded
    assert R.check_group_size("nvfp4", 128, SMOLLM2_IN) == 16  # fixed by the format
    with pytest.raises(R.QuantConfigError, match="nvfp4 needs input features divisible by 16, but x has 40"):
        R.check_group_size("nvfp4", None, {"x": 40})


def test_exclude_patterns_must_match_a_module():
    names = ["model", "model.layers.0", "model.layers.0.mlp.down_proj", "lm_head"]
    assert R.check_exclude(["lm_head", "*.down_proj"], names) == ("lm_head", "*.down_proj")
    with pytest.raises(R.QuantConfigError, match="quantization.exclude: pattern 'lm_heads' matches no module"):
        R.check_exclude(["lm_heads"], names)
    with pytest.raises(R.QuantConfigError, match="quantization.exclude: 'lm_head' is not a list"):
        QuantSettings.from_config({"exclude": "lm_head"})


def test_modelopt_configs_from_the_table():
    import modelopt.torch.quantization as mtq

    cfg = R.modelopt_config("int4_awq", "fp8", 64, ["lm_head", "model.layers.0.*"])
    weight = [e for e in cfg["quant_cfg"] if e.get("quantizer_name") == "*weight_quantizer"][0]
    assert weight["cfg"]["block_sizes"][-1] == 64
    assert mtq.INT4_AWQ_CFG["quant_cfg"][1]["cfg"]["block_sizes"][-1] == 128  # ModelOpt's table untouched
    assert cfg["quant_cfg"][-2:] == [{"quantizer_name": "lm_head.*", "enable": False},
                                     {"quantizer_name": "model.layers.0.*.*", "enable": False}]
    assert any(e.get("quantizer_name") == "*[kv]_bmm_quantizer" for e in cfg["quant_cfg"])
    w4a8 = R.modelopt_config("w4a8_awq", "none", 32, [])
    entry = [e for e in w4a8["quant_cfg"] if e.get("quantizer_name") == "*weight_quantizer"][0]
    assert entry["cfg"][0]["block_sizes"][-1] == 32 and entry["cfg"][1]["num_bits"] == (4, 3)
    assert not any("bmm" in str(e.get("quantizer_name")) for e in w4a8["quant_cfg"])
    kv_only = R.modelopt_config("none", "fp8")
    assert kv_only["quant_cfg"][0] == {"quantizer_name": "*", "enable": False}
    for name, recipe in R.RECIPES.items():
        if recipe.modelopt_cfg:
            assert getattr(mtq, recipe.modelopt_cfg)["quant_cfg"], name


def test_settings_from_builder_style_objects():
    class Calib:
        dataset, num_samples, max_seq_len = "builtin", 8, 64

    class Q:
        format, kv_cache, group_size, exclude, calibration = "nvfp4", "none", 64, ("lm_head",), Calib()

    s = QuantSettings.from_config(Q())
    assert (s.format, s.kv_cache, s.num_samples, s.max_seq_len, s.exclude) == ("nvfp4", "none", 8, 64, ("lm_head",))


def test_builtin_and_heldout_sets_are_real_and_disjoint():
    calib = C.read_jsonl_texts(C.BUILTIN)
    held = C.heldout_prompts()
    assert len(calib) >= 64 and len(held) >= 16
    assert len(set(calib)) == len(calib) and not set(calib) & set(held)
    assert any("def " in t for t in calib) and any(ord(c) > 0x3000 for t in calib for c in t)  # code, CJK
    assert C.heldout_prompts(4) == held[:4]


@pytest.mark.parametrize("content, message", [
    ('{"text": "ok"}\n{"text": "fine"\n', ":2: not valid JSON"),
    ('{"text": "ok"}\n\n{"prompt": "x"}\n', ":3: record has no \"text\" field"),
    ('["text"]\n', ":1: record has no \"text\" field"),
    ('{"text": 5}\n', ":1: \"text\" is int, expected a string"),
    ('{"text": "   "}\n\n', "no non-empty \"text\" records"),
])
def test_malformed_calibration_file(tmp_path, content, message):
    path = tmp_path / "calib.jsonl"
    path.write_text(content)
    with pytest.raises(C.CalibrationDataError) as e:
        C.read_jsonl_texts(path)
    assert str(e.value).startswith(str(path)) and message in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_calibration_file(tmp_path):
    with pytest.raises(C.CalibrationDataError, match="calibration file not found.*allowed: builtin"):
        C.load_texts(str(tmp_path / "nope.jsonl"))
    with pytest.raises(C.CalibrationDataError, match="calibration file not found"):
        C.dataset_fingerprint(str(tmp_path / "nope.jsonl"))


def test_dataset_fingerprint_follows_content(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "a"}\n')
    first = C.dataset_fingerprint(str(path))
    path.write_text('{"text": "b"}\n')
    assert C.dataset_fingerprint(str(path)) != first
    assert len(C.dataset_fingerprint("builtin")) == 64


def test_calibration_set_tokenizes_and_truncates(tmp_path, smollm2_hf_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_hf_dir))
    path = tmp_path / "user.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}) for t in ["short one", "word " * 400, "third"]) + "\n")
    cs = C.build_calibration_set(tok, str(path), num_samples=2, max_seq_len=16)
    st = cs.stats()
    assert st["num_samples"] == 2 and st["requested_samples"] == 2 and st["max_len"] == 16
    assert cs.samples[0][0].tolist() == tok("short one")["input_ids"]
    # asking for more samples than the file has uses them all, and says so
    st = C.build_calibration_set(tok, str(path), num_samples=10, max_seq_len=16).stats()
    assert st["num_samples"] == 3 and st["requested_samples"] == 10
    with pytest.raises(C.CalibrationDataError, match="num_samples: 0"):
        C.build_calibration_set(tok, str(path), num_samples=0)


def test_calibration_batches_are_packed_without_padding():
    import torch

    lens = [5, 9, 7, 30, 8, 6]
    samples = [torch.arange(n).reshape(1, n) + 100 * (i + 1) for i, n in enumerate(lens)]
    cs = C.CalibrationSet(samples, "test", "x", len(lens), 16, sep_id=0)
    stream = torch.cat([torch.cat([s[0], torch.tensor([0])]) for s in samples])  # 71 tokens
    batches = cs.batches(max_batch_tokens=40)
    # 4 full rows of 16 (the 7-token tail dropped), 2 rows per batch (2 * 16 <= 40)
    assert [tuple(b.shape) for b in batches] == [(2, 16), (2, 16)]
    assert torch.equal(torch.cat(batches).reshape(-1), stream[:64])
    st = cs.stats(batches)
    assert st["num_batches"] == 2 and st["tokens_used"] == 64 and st["tokens"] == sum(lens)
    # fewer tokens than one row: a single shorter row, nothing dropped
    small = C.CalibrationSet(samples[:2], "test", "x", 2, 256)
    assert [tuple(b.shape) for b in small.batches()] == [(1, 14)]


def test_calibration_token_bound_holds_and_is_tight_for_short_texts(smollm2_hf_dir):
    """quant.memory's calibration-token count bounds what the real tokenizer produces (a memory
    estimate must not undercount) while staying near it for the builtin set's short texts, where
    num_samples x max_seq_len counted 200x too many for a 70B config."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(smollm2_hf_dir))
    for n, limit in ((8, 256), (85, 4096), (3, 8)):
        real = sum(int(s.shape[-1]) for s in C.build_calibration_set(tok, "builtin", n, limit).samples)
        bound = C.token_upper_bound("builtin", n, limit)
        assert real <= bound <= 6 * real, (n, limit, real, bound)
    assert C.token_upper_bound("/nonexistent.jsonl", 4, 100) == 400
