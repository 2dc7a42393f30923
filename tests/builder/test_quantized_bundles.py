"""Quantized bundles of the real SmolLM2 (real ModelOpt calibration + export, our packing): every
linear, dequantized from the bundle, gives back the original bf16 weight within the format's
rounding bound, element by element."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from backend.bundle import load_bundle
from quant.formats import dequantize

pytestmark = pytest.mark.slow
# Light calibration: these tests check packing and rounding, not calibration quality (verify does).
# The fp8 overrides are the MLPerf tests' so both areas share one cached build.
LIGHT = ["quantization.calibration.num_samples=4", "quantization.calibration.max_seq_len=64", "verify.enabled=false"]
FUSED = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
         "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}


def fp8_bound(w: torch.Tensor, t: dict) -> torch.Tensor:
    # e4m3 keeps 3 mantissa bits: round-to-nearest is within 2^-4 relative, or half the smallest
    # subnormal step (2^-10 of the row scale) near zero; the scale is amax/448 so nothing clips
    s = t["weight_scale"].float()[:, None]
    return w.abs() * 2.0 ** -4 + s * 2.0 ** -10


def nvfp4_bound(w: torch.Tensor, t: dict) -> torch.Tensor:
    # per 16-element block, effective scale s = fp8(block scale) * weight_scale_2; e2m1's widest gap
    # (4 -> 6) gives at most 1*s rounding error, and a block scale rounded down may clip |w| > 6s
    s = (t["weight_scale"].float() * t["weight_scale_2"].float()).repeat_interleave(16, dim=1)
    amax = w.abs().reshape(w.shape[0], -1, 16).amax(-1).repeat_interleave(16, dim=1)
    return torch.maximum(s, amax - 6 * s) * 1.001 + 1e-9


@pytest.mark.parametrize("config, fmt, bound, max_rel", [
    ("smollm2-135m-fp8", "fp8", fp8_bound, 0.04),
    ("smollm2-135m-nvfp4", "nvfp4", nvfp4_bound, 0.15),
])
def test_dequantized_bundle_matches_source(build_bundle, smollm2_hf_dir, config, fmt, bound, max_rel):
    path = Path(build_bundle(config, LIGHT))
    bundle = load_bundle(path)
    engine = json.loads((path / "engine.json").read_text())
    assert engine["quantization"]["format"] == fmt and engine["engine"]["kv_cache_dtype"] == "fp8_e4m3"
    src = safe_open(str(smollm2_hf_dir / "model.safetensors"), "pt")
    names = bundle.tensor_names()
    worst = 0.0
    n = bundle.model.num_layers
    # first, middle and last layer: packing is per layer and identical code, dequantizing all 30 in
    # the CI budget costs a minute for no extra coverage; every layer's KV scales are checked below
    for i in (0, n // 2, n - 1):
        for ours, parts in FUSED.items():
            prefix = f"layers.{i}.{ours}."
            t = {n[len(prefix):]: bundle.tensor(n) for n in names if n.startswith(prefix)}
            w = torch.cat([src.get_tensor(f"model.layers.{i}.{p}.weight") for p in parts]).float()
            deq = dequantize(fmt, t)
            assert deq.shape == w.shape, (prefix, deq.shape, w.shape)
            err = (deq - w).abs()
            excess = err - bound(w, t)
            assert excess.max() <= 0, f"{prefix}: error exceeds the {fmt} bound by {excess.max():.3g}"
            worst = max(worst, float(err.norm() / w.norm()))
    for i in range(n):
        for kv in ("k_scale", "v_scale"):
            s = bundle.tensor(f"layers.{i}.attn.{kv}")
            assert s.dtype == torch.float32 and s.shape == () and 0 < float(s) < 1e3
    assert worst < max_rel, f"worst relative Frobenius error {worst:.3f}"
    # unquantized tensors are the source's, bit for bit
    assert torch.equal(bundle.tensor("embed_tokens.weight"), src.get_tensor("model.embed_tokens.weight"))
