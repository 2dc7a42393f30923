"""HF safetensors checkpoints of each supported family (Llama, Mistral, Qwen2) import and compile.

The checkpoints are tiny real transformers models (random weights, written by save_pretrained) with
SmolLM2's real tokenizer, so each family's config fields and tensor names are the genuine ones.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from builder.config import BuildConfig
from builder.pipeline import run_pipeline

pytestmark = pytest.mark.slow
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def tiny_checkpoint(family: str, out: Path, tokenizer_src: Path) -> Path:
    import transformers

    cls_cfg, cls_model = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                          "mistral": ("MistralConfig", "MistralForCausalLM"),
                          "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}[family]
    config = getattr(transformers, cls_cfg)(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                            max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = getattr(transformers, cls_model)(config).to(torch.bfloat16)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy2(tokenizer_src / name, out / name)
    return out


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_family_imports_and_fuses(family, tmp_path, smollm2_hf_dir):
    src = tiny_checkpoint(family, tmp_path / family, smollm2_hf_dir)
    cfg = BuildConfig.from_dict({}, f"{family}.yaml", [f"model.source={src}", "quantization.format=none",
                                                       "quantization.kv_cache=none", "verify.enabled=false",
                                                       "engine.max_seq_len=1024", "engine.max_input_len=512",
                                                       "engine.max_kv_tokens=2048"])
    result = run_pipeline(cfg, tmp_path / "out", until="compile", log=lambda m: None)
    engine = json.loads((result.bundle / "engine.json").read_text())
    m = engine["model"]
    assert m["architecture"] == family and m["num_layers"] == 2 and m["head_dim"] == 16
    assert m["attention_bias"] is (family == "qwen2") and m["tie_word_embeddings"] is False
    hf = safe_open(str(src / "model.safetensors"), "pt")
    ours = safe_open(str(result.bundle / "weights.safetensors"), "pt")
    assert torch.equal(ours.get_tensor("lm_head.weight"), hf.get_tensor("lm_head.weight"))
    for i in range(2):
        base = f"model.layers.{i}.self_attn"
        qkv = torch.cat([hf.get_tensor(f"{base}.{p}_proj.weight") for p in "qkv"])
        assert torch.equal(ours.get_tensor(f"layers.{i}.qkv.weight"), qkv)
        if family == "qwen2":
            bias = torch.cat([hf.get_tensor(f"{base}.{p}_proj.bias") for p in "qkv"])
            assert torch.equal(ours.get_tensor(f"layers.{i}.qkv.bias"), bias)
        else:
            assert f"layers.{i}.qkv.bias" not in ours.keys()
