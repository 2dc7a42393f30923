"""The streamed (layer-by-layer) quantization writes exactly what the whole-model path writes.

Real ModelOpt on both sides; SmolLM2 for fp8 (the issue's contract), a tiny random Llama written
by `harness.perf.lib.models` (tests/conftest.py `tiny_llama_dir`: sharded, untied lm_head) for
nvfp4 and exclusions.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from quant import quantize as qz
from quant.quantize import quantize_checkpoint
from quant.recipes import QuantConfigError

QUIET = {"progress": lambda *a: None}


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(shard)))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def assert_same_export(whole: Path, streamed: Path) -> None:
    a, b = _tensors(whole), _tensors(streamed)
    assert sorted(a) == sorted(b)
    for name in a:
        assert (a[name].dtype, a[name].shape) == (b[name].dtype, b[name].shape), name
        assert torch.equal(_bits(a[name]), _bits(b[name])), f"{name} differs"
    assert json.loads((whole / "config.json").read_text()) == json.loads((streamed / "config.json").read_text())
    assert (json.loads((whole / "hf_quant_config.json").read_text())
            == json.loads((streamed / "hf_quant_config.json").read_text()))


@pytest.fixture
def tiny_llama(tiny_llama_dir) -> Path:
    return tiny_llama_dir


def _settings(fmt: str, exclude=("lm_head",)) -> dict:
    return {"format": fmt, "kv_cache": "fp8", "exclude": list(exclude),
            "calibration": {"dataset": "builtin", "num_samples": 4, "max_seq_len": 64}}


@pytest.mark.slow
def test_smollm2_fp8_streamed_equals_whole_model(quantized_export, smollm2_hf_dir, tmp_path):
    whole, info = quantized_export("fp8")
    assert info["path"] == "whole"  # SmolLM2 is under the streaming threshold
    from tests.quant.conftest import EXPORTS

    streamed = tmp_path / "streamed"
    got = quantize_checkpoint(smollm2_hf_dir, streamed, EXPORTS["fp8"], path="streamed", **QUIET)
    assert got["path"] == "streamed" and len(list(streamed.glob("model-layer-*.safetensors"))) == 30
    assert_same_export(whole, streamed)


@pytest.mark.parametrize("fmt, exclude", [("nvfp4", ["lm_head"]), ("fp8", ["lm_head", "model.layers.1.mlp.*"])])
def test_tiny_streamed_equals_whole_model(tiny_llama, tmp_path, fmt, exclude):
    assert len(list(tiny_llama.glob("*.safetensors"))) > 1
    for path in ("whole", "streamed"):
        info = quantize_checkpoint(tiny_llama, tmp_path / path, _settings(fmt, exclude), path=path, **QUIET)
        assert info["path"] == path
    assert_same_export(tmp_path / "whole", tmp_path / "streamed")


def test_awq_is_whole_model_only(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setattr(qz, "STREAM_ABOVE_BYTES", 0)  # every model counts as large
    assert qz.choose_path("fp8", tiny_llama) == "streamed"
    assert qz.choose_path("int4_awq", tiny_llama) == "whole"
    with pytest.raises(QuantConfigError, match="int4_awq cannot be calibrated layer by layer.*fp8"):
        quantize_checkpoint(tiny_llama, tmp_path / "out", _settings("int4_awq"), path="streamed", **QUIET)
    assert not (tmp_path / "out").exists()


def test_small_models_stay_whole(tiny_llama):
    assert qz.fp32_weight_bytes(tiny_llama) < qz.STREAM_ABOVE_BYTES
    assert qz.choose_path("fp8", tiny_llama) == "whole"


def test_streamed_estimate_is_below_whole_model(tiny_llama):
    from quant.memory import quantize_memory

    whole = quantize_memory(tiny_llama, _settings("fp8"), path="whole")
    streamed = quantize_memory(tiny_llama, _settings("fp8"), path="streamed")
    assert (whole.path, streamed.path) == ("whole", "streamed")
    assert streamed.host_bytes < whole.host_bytes


def test_bf16_streamed_equals_whole_model(tiny_llama, tmp_path, monkeypatch):
    """The GPU path's arithmetic (bf16 layers and activations, the throw-away modules in bf16),
    run on the CPU: the stream must still write what the whole-model path writes in bf16."""
    monkeypatch.setattr(qz, "_compute_dtype", lambda device: torch.bfloat16)
    for path in ("whole", "streamed"):
        info = quantize_checkpoint(tiny_llama, tmp_path / path, _settings("fp8"), path=path, device="cpu", **QUIET)
        assert (info["path"], info["dtype"]) == (path, "bfloat16")
    assert_same_export(tmp_path / "whole", tmp_path / "streamed")


def test_activations_leave_the_gpu_only_when_they_do_not_fit():
    from quant.stream import activation_device

    gib = 1 << 30
    assert activation_device("cpu", 1, 1) == "cpu"
    # an 8B layer (0.44 GB in bf16) beside 2x 16 MB of activations on an 80 GB card
    assert activation_device("cuda", 16 << 20, int(0.44 * gib), free_bytes=78 * gib) == "cuda"
    # a 70B calibration set of 1M tokens x 8192 x bf16 (16 GiB, twice) beside a 1.7 GB layer
    assert activation_device("cuda", 16 * gib, int(1.7 * gib), free_bytes=30 * gib) == "cpu"
