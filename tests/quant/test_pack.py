"""quant/pack.py: fusing exported per-module tensors into the runtime layout, and back.

Parts are built the way ModelOpt exports them (per-tensor fp8 scale, int4 packed along the
output dimension, ...) from fresh random weights each run (`rng` fixture prints the seed)."""

from __future__ import annotations

import pytest
import torch

from quant import formats as F
from quant.pack import PackError, pack_kv_scales, pack_linear, split_linear

OUTS = (48, 16, 16)  # q, k, v rows (GQA: k and v are smaller)
IN = 64


def exported_part(fmt: str, w: torch.Tensor, rng, pqs: torch.Tensor | None = None, gs=None) -> dict:
    """One module as ModelOpt's unified checkpoint stores it."""
    if fmt == "fp8":
        p = F.quantize_fp8_per_tensor(w)
        return dict(p, input_scale=torch.rand((), generator=rng) + 0.01)
    if fmt == "nvfp4":
        return dict(F.quantize_nvfp4(w, gs), input_scale=torch.tensor(0.002))
    if fmt in ("int4_awq", "w4a8_awq"):
        q = F.quantize_int4(w, 32)
        p = {"weight": F.int4_to_modelopt(q["weight"]), "weight_scale": q["weight_scale"]}
        if pqs is not None:
            p["pre_quant_scale"] = pqs
        if fmt == "w4a8_awq":
            p["input_scale"] = torch.tensor(0.01)
        return p
    if fmt == "int8_sq":
        return dict(F.quantize_int8_per_row(w), input_scale=torch.tensor(1 / 127), pre_quant_scale=pqs)
    raise AssertionError(fmt)


def dense_of_part(fmt: str, part: dict) -> torch.Tensor:
    if fmt in ("int4_awq", "w4a8_awq"):  # pack_linear stores the scales in the model dtype (bf16)
        part = dict(part, weight=F.int4_from_modelopt(part["weight"]), weight_scale=part["weight_scale"].bfloat16())
    part = {k: v for k, v in part.items() if v is not None}
    spec = F.get_format(fmt)
    for name in spec.required:
        part.setdefault(name, torch.tensor(1.0))
    return spec.dequantize(part)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "int4_awq", "w4a8_awq", "int8_sq"])
def test_pack_then_split_round_trip(fmt, rng):
    # ModelOpt exports pre_quant_scale in the model dtype
    pqs = (torch.rand(IN, generator=rng) + 0.5).bfloat16() if fmt in ("int4_awq", "w4a8_awq", "int8_sq") else None
    ws = [torch.randn(n, IN, generator=rng) for n in OUTS]
    gs = torch.tensor(0.01) if fmt == "nvfp4" else None  # ModelOpt ties weight_scale_2 for q/k/v
    parts = [exported_part(fmt, w, rng, pqs, gs) for w in ws]
    packed = pack_linear(fmt, parts)
    F.get_format(fmt).check(packed)
    assert packed["weight"].shape[0] == sum(OUTS)
    # the fused weight is exactly the parts' dense weights stacked (no requantization)
    want = torch.cat([dense_of_part(fmt, p) for p in parts])
    assert torch.equal(F.dequantize(fmt, packed), want)
    if "input_scale" in packed:
        assert packed["input_scale"] == max(p["input_scale"] for p in parts)
    back = split_linear(fmt, packed, OUTS)
    for orig, got in zip(parts, back):
        assert torch.equal(got["weight"], orig["weight"])
        if fmt == "fp8":  # per-tensor scale came back as one value per row
            assert torch.equal(got["weight_scale"], orig["weight_scale"].expand(got["weight"].shape[0]))


def test_fp8_parts_keep_their_own_scale(rng):
    parts = [exported_part("fp8", torch.randn(n, IN, generator=rng) * (i + 1) * 10, rng) for i, n in enumerate(OUTS)]
    packed = pack_linear("fp8", parts)
    assert packed["weight_scale"].shape == (sum(OUTS),)
    assert packed["weight_scale"][0] == parts[0]["weight_scale"] and packed["weight_scale"][-1] == parts[2]["weight_scale"]


def test_nvfp4_different_global_scales_are_reexpressed(rng):
    ws = [torch.randn(n, IN, generator=rng) * (4.0 ** i) for i, n in enumerate(OUTS)]
    parts = [exported_part("nvfp4", w, rng) for w in ws]  # each part its own weight_scale_2
    assert len({float(p["weight_scale_2"]) for p in parts}) == 3
    packed = pack_linear("nvfp4", parts)
    assert packed["weight_scale_2"] == max(p["weight_scale_2"] for p in parts)
    got = F.dequantize("nvfp4", packed)
    want = torch.cat([dense_of_part("nvfp4", p) for p in parts])
    # codes unchanged; each block scale re-rounded once in fp8 e4m3 (<= 2^-4 relative, or the
    # 2^-9 floor of the block scale for tiny blocks)
    floor = 2.0**-9 * packed["weight_scale_2"] * 6
    assert ((got - want).abs() <= want.abs() * 2.0**-4 + floor).all()
    assert torch.equal(F.unpack_nibbles(packed["weight"]), torch.cat([F.unpack_nibbles(p["weight"]) for p in parts]))


def test_int4_mismatched_pre_quant_scale_is_refused(rng):
    parts = [exported_part("int4_awq", torch.randn(n, IN, generator=rng), rng,
                           pqs=torch.rand(IN, generator=rng) + 0.5) for n in OUTS]
    with pytest.raises(PackError, match="pre_quant_scale differs between fused parts 0 and 1"):
        pack_linear("int4_awq", parts)
    parts[1].pop("pre_quant_scale")
    with pytest.raises(PackError, match="present on parts \\[0, 2\\] but not on all 3"):
        pack_linear("int4_awq", parts)


def test_int4_scales_take_model_dtype(rng):
    parts = [exported_part("int4_awq", torch.randn(n, IN, generator=rng), rng) for n in OUTS]
    assert pack_linear("int4_awq", parts, dtype=torch.float16)["weight_scale"].dtype == torch.float16
    assert pack_linear("int4_awq", parts)["weight_scale"].dtype == torch.bfloat16


def test_pack_bad_input(rng):
    good = exported_part("fp8", torch.randn(8, IN, generator=rng), rng)
    with pytest.raises(F.FormatError, match="unknown weight format 'fp4'"):
        pack_linear("fp4", [good])
    with pytest.raises(PackError, match="needs at least one part"):
        pack_linear("fp8", [])
    with pytest.raises(PackError, match="part 1 has no 'input_scale'"):
        pack_linear("fp8", [good, {k: v for k, v in good.items() if k != "input_scale"}])
    with pytest.raises(PackError, match="part 0 weight is torch.bfloat16, expected torch.float8_e4m3fn"):
        pack_linear("fp8", [dict(good, weight=torch.zeros(8, IN, dtype=torch.bfloat16))])
    with pytest.raises(PackError, match="different packed input widths"):
        pack_linear("fp8", [good, dict(good, weight=good["weight"][:, :32])])
    with pytest.raises(PackError, match="sum to 10"):
        split_linear("fp8", pack_linear("fp8", [good]), [5, 5])


def test_kv_scales():
    got = pack_kv_scales({"k_scale": torch.tensor(0.02), "weight": torch.zeros(1)}, {"v_scale": torch.tensor([0.5])})
    assert got["k_scale"].shape == () and got["v_scale"].dtype == torch.float32 and float(got["v_scale"]) == 0.5
    with pytest.raises(PackError, match="v_scale missing"):
        pack_kv_scales({"k_scale": torch.tensor(0.02)}, {})
    with pytest.raises(PackError, match="k_scale = 0.0 is not a positive finite scale"):
        pack_kv_scales({"k_scale": torch.tensor(0.0)}, {"v_scale": torch.tensor(1.0)})
