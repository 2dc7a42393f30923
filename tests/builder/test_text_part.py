"""A multimodal Gemma 3 checkpoint (``Gemma3ForConditionalGeneration``, as Gemma 3 4B, 12B and 27B are
published) builds as its language model: transformers' own class with random tiny weights (a SigLIP
tower of one layer, a projector, a 4-layer text decoder with sliding and full layers), saved by
``save_pretrained``; the import writes a ``Gemma3ForCausalLM`` folder that transformers loads with
the same logits, and Kiln's greedy tokens are the multimodal model's for text-only prompts."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from builder.stages.base import StageError
from builder.text_part import TEXT_PARTS, renamed
from tests.runtime.hf_reference import assert_teacher_forced_greedy

pytestmark = pytest.mark.slow

TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, vocab_size=300, sliding_window=16, max_position_embeddings=1024, query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"])
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory, smollm2_hf_dir):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    root = tmp_path_factory.mktemp("gemma3-mm")
    cfg = Gemma3Config(text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4, image_token_index=299,
                       boi_token_index=297, eoi_token_index=298)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(cfg).float().eval()
    with torch.no_grad():        # norms at 1 hide a missing one: perturb them
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    src = root / "src"
    model.save_pretrained(src)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(Path(smollm2_hf_dir) / f, src / f)
    return model, src, root


@pytest.fixture(scope="module")
def built(multimodal):
    from builder.config import BuildConfig
    from builder.pipeline import run_pipeline

    model, src, root = multimodal
    cfg = BuildConfig.from_dict({}, "gemma3-mm.yaml", [
        f"model.source={src}", "model.dtype=float32", "quantization.format=none", "quantization.kv_cache=none",
        "verify.enabled=false", "engine.max_seq_len=256", "engine.max_input_len=128", "engine.max_kv_tokens=2048"])
    return run_pipeline(cfg, root / "out", until="compile", log=lambda m: None)


def test_the_import_is_the_language_model_as_a_causal_checkpoint(multimodal, built):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model, src, _ = multimodal
    imported = built.results["import"].path
    config = json.loads((imported / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["model_type"] == "gemma3_text"
    assert config["num_hidden_layers"] == 4 and config["sliding_window"] == 16
    with safe_open(str(next(imported.glob("*.safetensors"))), "pt") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" in names and not any("vision" in n or "projector" in n for n in names)
    info = built.results["import"].info
    assert info["kind"] == "hf-text-part" and info["architecture"] == "gemma3"
    assert info["text_part"]["text_part_of"] == "Gemma3ForConditionalGeneration"
    assert info["text_part"]["tensors_kept"] == len(names) and info["text_part"]["tensors_left_out"] > 0
    causal = AutoModelForCausalLM.from_pretrained(imported, dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(causal(ids).logits, model(input_ids=ids).logits, rtol=0, atol=1e-5)


def test_greedy_tokens_are_the_multimodal_models_for_text(multimodal, built):
    from backend.engine.executor import Executor
    from backend.engine.sampling_params import SamplingParams

    model, _, _ = multimodal
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 23, 41)]
    ex = Executor(built.bundle, dtype="float32", start=False, verify_hashes=False)
    try:
        got = [r.token_ids for r in ex.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0,
                                                                       ignore_eos=True))]
    finally:
        ex.shutdown()
    for p, toks in zip(prompts, got):
        assert len(toks) == 32
        assert_teacher_forced_greedy(model, p, toks)


def test_a_tensor_of_no_known_part_is_refused_by_name(tmp_path):
    part = TEXT_PARTS["Gemma3ForConditionalGeneration"]
    assert renamed("language_model.model.layers.0.mlp.up_proj.weight", part, tmp_path) == \
        "model.layers.0.mlp.up_proj.weight"
    assert renamed("model.language_model.norm.weight", part, tmp_path) == "model.norm.weight"
    assert renamed("vision_tower.head.probe", part, tmp_path) is None
    with pytest.raises(StageError, match=r"tensor 'audio_tower.conv.weight' is neither the language model's"):
        renamed("audio_tower.conv.weight", part, tmp_path / "model.safetensors")


def test_a_multimodal_config_without_its_text_config_is_refused(multimodal, tmp_path):
    from builder.text_part import text_config

    _, src, _ = multimodal
    hf = json.loads((src / "config.json").read_text())
    text = text_config(hf, TEXT_PARTS["Gemma3ForConditionalGeneration"], src / "config.json")
    assert text["tie_word_embeddings"] is True and text["architectures"] == ["Gemma3ForCausalLM"]
    del hf["text_config"]
    with pytest.raises(StageError, match=r"config.json: text_config: missing or not an object"):
        text_config(hf, TEXT_PARTS["Gemma3ForConditionalGeneration"], src / "config.json")
