"""Bundle model-config validation and runner refusals: one clear line, before any weight is read."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend.bundle import EngineSettings, Manifest, Quantization
from backend.bundle_schema import ModelConfig, ModelConfigError
from backend.model.layers import RotaryEmbedding, rope_type
from backend.runtime.native import ModelRunner
from backend.runtime.spec import EngineError, EngineSpec

SMOL = {"architecture": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_layers": 30,
        "num_heads": 9, "num_kv_heads": 3, "head_dim": 64, "vocab_size": 49152, "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True,
        "eos_token_ids": [2], "dtype": "bfloat16", "some_future_key": 1}


def test_from_dict_ignores_unknown_keys_and_freezes_lists():
    cfg = ModelConfig.from_dict(SMOL)
    assert cfg.eos_token_ids == (2,) and cfg.q_size == 576 and cfg.kv_size == 192


@pytest.mark.parametrize("change, needle", [
    ({"architecture": "gpt2"}, "model.architecture: 'gpt2'"),
    ({"dtype": "int8"}, "model.dtype: 'int8'"),
    ({"num_kv_heads": 4}, "multiple of model.num_kv_heads"),
    ({"head_dim": 0}, "model.head_dim: must be a positive integer"),
])
def test_bad_model_section_is_one_clear_line(change, needle):
    with pytest.raises(ModelConfigError, match=needle):
        ModelConfig.from_dict({**SMOL, **change})
    with pytest.raises(ModelConfigError, match="missing"):
        ModelConfig.from_dict({k: v for k, v in SMOL.items() if k != "vocab_size"})


def test_rope_scaling_types():
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    plain = RotaryEmbedding(128, 4096, 500000.0, None)
    scaled = RotaryEmbedding(128, 4096, 500000.0, llama3)
    # High frequencies (first dims) are untouched, the lowest ones are divided by the factor.
    assert torch.allclose(plain.cos[:, 0], scaled.cos[:, 0])
    assert not torch.allclose(plain.cos[:, 63], scaled.cos[:, 63])
    assert rope_type({"type": "linear", "factor": 2.0}) == "linear"
    assert rope_type({"rope_type": "yarn", "factor": 4.0}) == "yarn"
    with pytest.raises(ValueError, match="rope_scaling.rope_type: 'ntk' is not supported; allowed: default, linear, "
                                         "dynamic, llama3, yarn, longrope"):
        rope_type({"rope_type": "ntk", "factor": 4.0})


def _windowed_spec(backend: str) -> EngineSpec:
    cfg = ModelConfig.from_dict({**SMOL, "architecture": "mistral", "sliding_window": 1024})
    return EngineSpec(Path("/nonexistent"), Manifest(model=cfg, quantization=Quantization("none"),
                                                     engine=EngineSettings(max_seq_len=2048, attention_backend=backend)))


def test_runner_refuses_a_binding_window_where_the_backend_has_none(monkeypatch):
    from backend.ops.attention.triton_backend import TritonAttentionBackend
    monkeypatch.setattr(TritonAttentionBackend, "sliding_window", False)   # a backend without window kernels
    with pytest.raises(EngineError) as exc:
        ModelRunner(_windowed_spec("triton"))
    assert str(exc.value) == ("engine.max_seq_len: 2048 exceeds the model's sliding_window (1024), which the triton "
                              "attention backend does not implement yet; allowed: at most 1024, or "
                              "engine.attention_backend=torch")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_both_backends_take_a_max_seq_len_above_the_window(backend):
    # past the window check: the next thing the runner does is read the (absent) weights
    with pytest.raises(EngineError, match="weights.safetensors: not found"):
        ModelRunner(_windowed_spec(backend))
