"""Kiln's GGUF importer on a qwen3 file written here with the gguf package's writer, named by gguf's own
tensor name map (not by Kiln's table): transformers' own random Qwen3ForCausalLM (fp32, per-head q/k
norms, a head size that is not hidden / heads) and SmolLM2's byte-level BPE tokenizer from its GGUF. The
import gives back transformers' tensors bit for bit, agrees with transformers' own GGUF loader, and the
build from the file generates transformers' greedy tokens."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from backend.engine.sampling_params import SamplingParams
from builder.gguf_import import convert, read_header
from builder.stages.base import StageError
from tests.runtime.hf_reference import hf_greedy

HIDDEN, FF, HEADS, KV, HEAD_DIM, LAYERS = 64, 96, 4, 2, 32, 2
NEW_TOKENS = 24


def _model():
    import transformers

    from builder.sources import smollm2_gguf
    vocab = len(read_header(smollm2_gguf())[0]["tokenizer.ggml.tokens"])
    config = transformers.Qwen3Config(hidden_size=HIDDEN, intermediate_size=FF, num_hidden_layers=LAYERS,
                                      num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HEAD_DIM,
                                      vocab_size=vocab, max_position_embeddings=512, tie_word_embeddings=False,
                                      rms_norm_eps=1e-6, rope_theta=1_000_000.0)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).float().eval()
    with torch.no_grad():   # norms start at 1: perturb them so a dropped or misplaced norm shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return model


def write_qwen3(path, model, key_length=HEAD_DIM, value_length=HEAD_DIM):
    """The model as llama.cpp's converter lays a Qwen3 out (no q/k permutation for qwen), every tensor F32."""
    import gguf

    from builder.sources import smollm2_gguf
    meta = read_header(smollm2_gguf())[0]
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_key_length(key_length)
    w.add_value_length(value_length)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1_000_000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(meta.get("tokenizer.ggml.pre", "smollm"))
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, LAYERS)
    for hf_name, t in model.state_dict().items():
        name = names.get_name(hf_name.removesuffix(".weight")) + ".weight"
        w.add_tensor(name, t.numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3-gguf")
    model = _model()
    path = write_qwen3(d / "tiny-qwen3.gguf", model)
    out = d / "hf"
    out.mkdir()
    info = convert(path, "qwen3", out, torch.float32)
    return model, path, out, info


def test_every_tensor_comes_back_bit_for_bit(qwen3):
    from safetensors.torch import load_file

    model, _, out, info = qwen3
    want = model.state_dict()
    state = load_file(out / "model.safetensors")
    assert info == {"tensors": len(want), "gguf_architecture": "qwen3"} and set(state) == set(want)
    for name, t in want.items():
        assert torch.equal(state[name], t), name
    assert state["model.layers.1.self_attn.q_norm.weight"].shape == (HEAD_DIM,)


def test_config_and_tokenizer(qwen3):
    from tokenizers import Tokenizer
    from transformers import AutoConfig

    model, path, out, _ = qwen3
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3ForCausalLM"] and raw["model_type"] == "qwen3"
    cfg = AutoConfig.from_pretrained(out)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim) == (HIDDEN, FF, LAYERS, HEADS, KV, HEAD_DIM)
    assert cfg.head_dim != HIDDEN // HEADS and not cfg.tie_word_embeddings
    # the tokenizer as the GGUF has it: SmolLM2's own tokenization of a sentence
    from builder.sources import smollm2_gguf
    meta = read_header(smollm2_gguf())[0]
    ids = Tokenizer.from_file(str(out / "tokenizer.json")).encode("Hello world, again", add_special_tokens=False).ids
    assert [meta["tokenizer.ggml.tokens"][i] for i in ids] == ["Hello", "Ġworld", ",", "Ġagain"]


def test_transformers_own_gguf_loader_reads_the_same_tensors(qwen3):
    # an independent reading of the same file (its GGUF name map; no accelerate needed at this level)
    from safetensors.torch import load_file
    from transformers import AutoConfig, Qwen3ForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    _, path, out, _ = qwen3
    ref = load_gguf_checkpoint(str(path))["config"]
    # transformers' qwen3 key table has no attention.key_length: it would take Qwen3Config's default head
    # size (128), wrong for this file; Kiln reads the file's
    assert "head_dim" not in ref
    ref_cfg = AutoConfig.for_model(**ref, head_dim=HEAD_DIM)
    with torch.device("meta"):
        skeleton = Qwen3ForCausalLM(ref_cfg)
    theirs = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton,
                                  torch_dtype=torch.float32)["tensors"]
    ours = load_file(out / "model.safetensors")
    assert sorted(theirs) == sorted(ours)
    for name, t in theirs.items():
        assert torch.equal(t.float(), ours[name]), name
    mine = AutoConfig.from_pretrained(out)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "max_position_embeddings"):
        assert getattr(mine, key) == getattr(ref_cfg, key), key


def test_a_head_size_the_file_does_not_state_is_refused(tmp_path):
    path = write_qwen3(tmp_path / "bad.gguf", _model(), key_length=HEAD_DIM, value_length=HEAD_DIM * 2)
    out = tmp_path / "hf"
    out.mkdir()
    with pytest.raises(StageError, match=r"qwen3.attention.value_length = 64 differs from qwen3.attention."
                                         r"key_length 32; allowed: equal"):
        convert(path, "qwen3", out, torch.float32)


def test_the_build_from_the_file_generates_transformers_greedy_tokens(qwen3, tmp_path):
    from backend.engine.executor import Executor
    from builder.config import BuildConfig
    from builder.pipeline import run_pipeline

    model, path, _, _ = qwen3
    cfg = BuildConfig.from_dict({}, "qwen3-gguf.yaml", [
        f"model.source={path}", "model.dtype=float32", "quantization.format=none", "quantization.kv_cache=none",
        "verify.enabled=false", "engine.max_seq_len=256", "engine.max_input_len=128", "engine.max_kv_tokens=2048",
        "engine.cpu_dtype=float32", "engine.attention_backend=torch"])
    bundle = run_pipeline(cfg, tmp_path / "out", until="compile", log=lambda m: None).bundle
    assert json.loads((bundle / "engine.json").read_text())["model"]["architecture"] == "qwen3"
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (7, 40)]
    ex = Executor(bundle, dtype=torch.float32, verify_hashes=False, start=False)
    try:
        ours = ex.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    finally:
        ex.shutdown()
    for prompt, res in zip(prompts, ours):
        assert res.token_ids == hf_greedy(model, prompt, NEW_TOKENS)
