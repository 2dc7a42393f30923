"""Kiln's GGUF importer on gemma3 files made here with the gguf package's writer (tiny, every
float and block-quantized type gguf can write): tensor names, dequantized values, Gemma's (1 + w)
norms, config.json, and agreement with transformers' own GGUF loader, tensor by tensor.
The real Gemma 3 270M file (K-quants among its types) is tested in test_gguf_gemma_real.py."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from builder.gguf_import import FAMILIES, GLOBAL_NAMES, _hf_name, convert
from builder.gguf_tokenizer import BYTE, CONTROL, NORMAL
from builder.stages.base import StageError

HIDDEN, FF, HEADS, KV, HEAD_DIM, LAYERS = 64, 128, 2, 1, 32, 2


def test_names_match_gguf_tensor_name_map():
    import gguf

    arch = gguf.MODEL_ARCH.GEMMA3
    reverse = gguf.get_tensor_name_map(arch, LAYERS)
    for tensor in gguf.MODEL_TENSORS[arch]:
        name = gguf.TENSOR_NAMES[tensor].format(bid=1) + ".weight"
        hf = _hf_name(name, "gemma3")
        assert reverse.get_name(hf.removesuffix(".weight")) == name.removesuffix(".weight"), (name, hf)
    with pytest.raises(StageError, match="unexpected GGUF tensor 'blk.0.ffn_gate_inp.weight' for a gemma3"):
        _hf_name("blk.0.ffn_gate_inp.weight", "gemma3")
    assert FAMILIES["gemma3"].layer_names["ffn_norm"] == "pre_feedforward_layernorm"
    assert FAMILIES["llama"].layer_names["ffn_norm"] == "post_attention_layernorm"
    assert set(GLOBAL_NAMES) == {"token_embd", "output_norm", "output"}


def _vocab():
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [CONTROL] * 4 + [BYTE] * 256
    normal = ["a", "b", "\u2581", "ab", "\u2581a"]
    return tokens + normal, [0.0] * len(tokens) + [-float(i) for i in range(len(normal))], types + [NORMAL] * 5


def _tensors():
    """(gguf name, float32 values, GGML type): each layer stores its tensors in different types."""
    import gguf
    T = gguf.GGMLQuantizationType
    rng = np.random.default_rng(0)
    vocab = len(_vocab()[0])
    shapes = {"attn_q": (HEADS * HEAD_DIM, HIDDEN), "attn_k": (KV * HEAD_DIM, HIDDEN),
              "attn_v": (KV * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HEADS * HEAD_DIM),
              "ffn_gate": (FF, HIDDEN), "ffn_up": (FF, HIDDEN), "ffn_down": (HIDDEN, FF)}
    kinds = [T.Q8_0, T.Q5_0, T.Q4_0, T.Q5_1, T.Q4_1, T.F16, T.BF16]
    out = [("token_embd.weight", rng.standard_normal((vocab, HIDDEN), dtype=np.float32), T.BF16),
           ("output_norm.weight", 1 + rng.standard_normal(HIDDEN, dtype=np.float32), T.F32)]
    for b in range(LAYERS):
        for i, (n, shape) in enumerate(shapes.items()):
            out.append((f"blk.{b}.{n}.weight", rng.standard_normal(shape, dtype=np.float32) * 0.1,
                        kinds[(i + b) % len(kinds)]))
        for n, size in (("attn_norm", HIDDEN), ("post_attention_norm", HIDDEN), ("ffn_norm", HIDDEN),
                        ("post_ffw_norm", HIDDEN), ("attn_q_norm", HEAD_DIM), ("attn_k_norm", HEAD_DIM)):
            out.append((f"blk.{b}.{n}.weight", 1 + rng.standard_normal(size, dtype=np.float32),
                        T.F16 if n == "ffn_norm" else T.F32))   # a norm in F16 gets the offset too
    return out


def write_gemma3(path, extra=None, tensors=None):
    import gguf

    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1_000_000.0)
    w.add_sliding_window(16)
    tokens, scores, types = _vocab()
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_pad_token_id(0)
    w.add_unk_token_id(3)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    for key, value in (extra or {}).items():
        w.add_uint32(key, value)
    stored = {}
    for name, values, kind in tensors if tensors is not None else _tensors():
        q = gguf.quants.quantize(values, kind)
        stored[name] = gguf.quants.dequantize(q, kind).reshape(values.shape).astype(np.float32)
        w.add_tensor(name, q, raw_shape=q.shape if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
                     else None, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("gemma3-gguf")
    stored = write_gemma3(d / "tiny.gguf")
    out = d / "hf"
    out.mkdir()
    info = convert(d / "tiny.gguf", "gemma3", out, torch.float32)
    return d / "tiny.gguf", out, stored, info


def test_every_tensor_dequantized_and_renamed(tiny):
    from safetensors.torch import load_file

    _, out, stored, info = tiny
    state = load_file(out / "model.safetensors")
    assert info == {"tensors": len(stored), "gguf_architecture": "gemma3"} and len(state) == len(stored)
    for name, values in stored.items():
        expect = values - 1 if name.split(".")[-2].endswith("norm") else values   # HF holds w of (1 + w)
        got = state[_hf_name(name, "gemma3")]
        assert got.dtype == torch.float32 and tuple(got.shape) == values.shape, name
        assert torch.equal(got, torch.from_numpy(expect)), name   # same bits: no rope permutation either


def test_config(tiny):
    from transformers import AutoConfig

    _, out, _, _ = tiny
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["Gemma3ForCausalLM"] and raw["model_type"] == "gemma3_text"
    cfg = AutoConfig.from_pretrained(out)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim) == (HIDDEN, FF, LAYERS, HEADS, KV, HEAD_DIM)
    assert cfg.sliding_window == 16 and cfg.max_position_embeddings == 128 and cfg.tie_word_embeddings
    assert cfg.rope_parameters["full_attention"]["rope_theta"] == 1_000_000.0
    assert cfg.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0
    assert cfg.query_pre_attn_scalar == HEAD_DIM and cfg.hidden_activation == "gelu_pytorch_tanh"
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id, cfg.vocab_size) == (2, 1, 0, len(_vocab()[0]))
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": 2, "eos_token_id": 1,
                                                                        "pad_token_id": 0}
    from tokenizers import Tokenizer
    assert Tokenizer.from_file(str(out / "tokenizer.json")).encode("ab a").tokens == ["<bos>", "ab", "\u2581a"]


def test_layer_pattern_of_a_deeper_model():
    from builder.gguf_import import gemma3_config

    meta = {f"gemma3.{k}": v for k, v in (("embedding_length", 5376), ("block_count", 62),
            ("feed_forward_length", 21504), ("attention.head_count", 32), ("attention.head_count_kv", 16),
            ("attention.key_length", 128), ("attention.sliding_window", 1024))}
    meta.update({"gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0})
    hf = gemma3_config("27b.gguf", meta)
    assert hf["layer_types"][:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert hf["layer_types"].count("full_attention") == 10
    assert hf["query_pre_attn_scalar"] == 168   # the 27B scales queries by hidden / heads
    assert hf["rope_parameters"]["full_attention"] == {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}
    with pytest.raises(StageError, match="gemma3.rope.scaling.type = 'yarn'; allowed: none, linear"):
        gemma3_config("x.gguf", {**meta, "gemma3.rope.scaling.type": "yarn"})
    with pytest.raises(StageError, match="lacks gemma3.attention.sliding_window"):
        gemma3_config("x.gguf", {k: v for k, v in meta.items() if "sliding" not in k})


def test_agrees_with_transformers_gguf_loader(tiny):
    """transformers' loader (its GGUF name map and Gemma norm handling; no accelerate needed at this
    level) gives the same tensors and the same architecture numbers."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, Gemma3ForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path, out, _, _ = tiny
    ref_cfg = AutoConfig.for_model(**load_gguf_checkpoint(str(path))["config"])
    with torch.device("meta"):
        skeleton = Gemma3ForCausalLM(ref_cfg)
    ref = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton,
                               torch_dtype=torch.float32)["tensors"]
    state = load_file(out / "model.safetensors")
    assert sorted(ref) == sorted(state)
    for name, t in ref.items():
        assert torch.equal(state[name], t.float()), name
    ours = AutoConfig.from_pretrained(out)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "sliding_window", "rms_norm_eps", "layer_types",
                "rope_parameters", "tie_word_embeddings", "hidden_activation"):
        assert getattr(ours, key) == getattr(ref_cfg, key), key
    # transformers takes its class default 256 for every file; llama.cpp, which defines how a GGUF
    # runs, scales by head_dim (the same 256 for Gemma 3 up to 12B; the real-file test compares it)
    assert (ours.query_pre_attn_scalar, ref_cfg.query_pre_attn_scalar) == (HEAD_DIM, 256)


def test_unknown_metadata_field_is_refused(tmp_path):
    write_gemma3(tmp_path / "x.gguf", extra={"gemma3.attention.shared_kv_layers": 4})
    with pytest.raises(StageError, match=r"x.gguf: GGUF field gemma3.attention.shared_kv_layers = 4 is not "
                                         r"understood for gemma3; allowed: "):
        convert(tmp_path / "x.gguf", "gemma3", tmp_path, torch.float32)
    assert not (tmp_path / "model.safetensors").exists()


def test_type_gguf_cannot_dequantize_is_refused(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "f64.gguf"), "gemma3")
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float64))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(StageError, match="f64.gguf: tensor output_norm.weight is stored as F64, which the gguf "
                                         "package cannot dequantize"):
        convert(tmp_path / "f64.gguf", "gemma3", tmp_path, torch.float32)


def test_a_gemma3_gguf_resolves_as_a_source_the_build_runs(tiny):
    """The runtime runs gemma3 now: its GGUF is a build source (no 'not run yet' refusal)."""
    from builder import sources

    path, _, _, _ = tiny
    src = sources.resolve(str(path), "gemma.yaml")
    assert (src.kind, src.path, src.architecture) == ("gguf", path, "gemma3")


def test_imported_config_maps_to_the_gemma3_spec(tiny):
    """The config.json the importer writes is one the gemma3 family reads whole (no field refused): the
    architecture spec the runtime will run the imported model from."""
    import json

    from builder.families import read_spec

    _, out, _, _ = tiny
    hf = json.loads((out / "config.json").read_text())
    family, spec = read_spec(hf, out / "config.json")
    assert family.name == "gemma3"
    assert spec.norm == "rms_one_plus" and spec.qk_norm and spec.activation == "gelu_tanh"
    assert len(spec.layer_types) == hf["num_hidden_layers"]
