"""quant/formats.py on random tensors (fresh seed each run, see the `rng` fixture) and edge values.

Error bounds used below, per element x with dequantized value x':
  fp8 e4m3   3 mantissa bits: a normal value is off by at most half a step, 2^-4 * |x|; below
             fp8's smallest normal (2^-6 in scaled units) the step is 2^-9, so at most 2^-10 * scale.
  nvfp4      e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} times the block scale s: half a step is s/4 on
             [0, 2], s/2 on [2, 4], s on [4, 6], so |x - x'| <= max(|x|, s) / 4 (this also covers
             the block maximum clipped at 6 when its fp8 block scale rounded down by <= 2^-4).
  int4/int8  symmetric with scale = amax / qmax and no clipping: at most half a step, scale / 2.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from quant import formats as F

EPS = 1e-6  # float32 arithmetic in the dequantizers


def odd_matrix(rng: torch.Generator, rows: int = 32, cols: int = 128) -> torch.Tensor:
    """Normal random data with zeros, a row of zeros, huge/tiny magnitudes and negatives mixed in."""
    w = torch.randn(rows, cols, generator=rng) * torch.exp(torch.randn(rows, 1, generator=rng))
    w[0, :7] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 3.0, -3.0, 0.0])
    w[1] = 0.0
    w[2, 5] = w.abs().max() * 4  # one outlier: the global amax
    w[3, ::2] *= -1
    return w


def test_nibbles_layout_and_round_trip(rng):
    assert F.pack_nibbles(torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)).tolist() == [[0x21, 0x0F]]
    codes = torch.randint(0, 16, (7, 64), generator=rng, dtype=torch.uint8)
    packed = F.pack_nibbles(codes)
    assert packed.shape == (7, 32) and packed.dtype == torch.uint8
    assert torch.equal(F.unpack_nibbles(packed), codes)
    with pytest.raises(F.FormatError, match="odd"):
        F.pack_nibbles(torch.zeros(3, 5, dtype=torch.uint8))


def test_e2m1_grid_ties_saturation():
    grid = torch.tensor(F.E2M1_VALUES)
    both = torch.cat([grid, -grid[1:]])
    assert torch.equal(F.e2m1_decode(F.e2m1_encode(both)), both)
    # ties go to the code with an even mantissa (what ModelOpt and IEEE round-to-nearest-even do)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert F.e2m1_decode(F.e2m1_encode(ties)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert F.e2m1_decode(F.e2m1_encode(torch.tensor([7.0, 1e9, -1e9, float("inf")]))).tolist() == [6, 6, -6, 6]
    assert F.e2m1_decode(F.e2m1_encode(torch.tensor([float("nan")]))).tolist() == [0.0]


def test_e2m1_round_is_the_codes_round_trip_bit_for_bit(rng):
    """e2m1_round (the activation fake-quantization's rounding, without codes) against
    e2m1_decode(e2m1_encode(x)): same float32 bits, the sign of zero included, on ties, the segment
    edges (2, 4) and just below them, saturation, infinities, NaN of either sign, tiny values of
    either sign, and random values at the scales a block's values take (|x| up to 6 and beyond)."""
    edges = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 2.0, 4.0, 6.0, 0.5, 1.0,
             1.9999999, 3.9999998, 5.9999995, 0.2500001, 0.7499999, 4.999999, 5.000001, 7.0, 1e30, 0.0,
             1e-9, 1e-40, float("inf"), float("nan")]
    special = torch.tensor(edges + [-v for v in edges])
    for x in (special, torch.randn(200_000, generator=rng) * 3, torch.randn(1000, generator=rng) * 1e-3,
              torch.randn(1000, generator=rng) * 100, (torch.randn(8, 64, generator=rng) * 4).to(torch.bfloat16)):
        want = F.e2m1_decode(F.e2m1_encode(x))
        got = F.e2m1_round(x)
        assert got.dtype == torch.float32 and got.shape == x.shape
        same = got.view(torch.int32) == want.view(torch.int32)
        assert same.all(), (x[~same][:8], want[~same][:8], got[~same][:8])
    assert F.e2m1_decode(torch.arange(16, dtype=torch.uint8)).view(torch.int32).tolist() == \
        torch.tensor(list(F.E2M1_VALUES) + [-v for v in F.E2M1_VALUES]).view(torch.int32).tolist()


def test_e2m1_matches_modelopt(rng):
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    x = torch.randn(4096, generator=rng) * 3
    x[:14] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0])
    assert torch.equal(F.e2m1_encode(x), NVFP4QTensor._cast_fp4(x.clone()).to(torch.uint8))


def test_fp8_round_trip_within_bound(rng):
    w = odd_matrix(rng)
    for q in (F.quantize_fp8_per_tensor(w), F.quantize_fp8_per_row(w)):
        scale = q["weight_scale"].reshape(-1, 1) if q["weight_scale"].dim() else q["weight_scale"]
        back = F.dequantize_fp8(q["weight"], q["weight_scale"])
        bound = torch.maximum(2.0**-4 * w.abs(), 2.0**-10 * scale.expand_as(w)) * (1 + EPS)
        assert ((back - w).abs() <= bound).all()
        assert torch.isfinite(back).all()
    # the amax element maps onto 448 exactly and comes back as itself; zero stays zero
    q = F.quantize_fp8_per_tensor(w)
    assert q["weight"].float().abs().max().item() == F.FP8_MAX
    assert F.dequantize_fp8(q["weight"], q["weight_scale"])[1].abs().max().item() == 0.0
    # out-of-range values saturate instead of turning into NaN
    assert F.quantize_fp8(torch.tensor([1e6, -1e6]), torch.tensor(1.0)).float().tolist() == [448.0, -448.0]


def test_nvfp4_round_trip_within_bound(rng):
    w = odd_matrix(rng)
    q = F.quantize_nvfp4(w)
    assert q["weight"].shape == (32, 64) and q["weight_scale"].shape == (32, 8)
    assert q["weight_scale"].dtype == F.FP8 and q["weight_scale_2"].shape == ()
    back = F.dequantize_nvfp4(q["weight"], q["weight_scale"], q["weight_scale_2"])
    s = (q["weight_scale"].float() * q["weight_scale_2"]).repeat_interleave(16, dim=1)
    assert ((back - w).abs() <= torch.maximum(w.abs(), s) / 4 * (1 + EPS)).all()
    assert (back[1] == 0).all() and torch.isfinite(back).all()
    # fresh data of ordinary spread: the overall error is what 4-bit data gives (~10 %)
    g = torch.randn(64, 256, generator=rng)
    q = F.quantize_nvfp4(g)
    rel = (F.dequantize_nvfp4(q["weight"], q["weight_scale"], q["weight_scale_2"]) - g).norm() / g.norm()
    assert 0.02 < rel < 0.15


def test_nvfp4_activation_fake_quant(rng):
    x = torch.randn(5, 64, generator=rng, dtype=torch.float32) * 4
    gs = x.abs().amax() / (F.E2M1_MAX * F.FP8_MAX)
    y = F.fake_quantize_nvfp4_activation(x.to(torch.bfloat16), gs)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    # every value is a grid value times its block's scale, so a second pass changes nothing
    assert torch.equal(F.fake_quantize_nvfp4_activation(y, gs), y)
    blocks_amax = x.abs().reshape(5, 4, 16).amax(-1, keepdim=True).expand(5, 4, 16).reshape(5, 64)
    # block scale = amax / 6 (rounded in fp8) -> error <= max(|x|, scale) / 4, plus bf16 output rounding
    assert ((y.float() - x).abs() <= torch.maximum(x.abs(), blocks_amax / 6 * 1.07) / 4 + 2**-7 * x.abs() + 1e-6).all()


def test_int4_round_trip_and_modelopt_layout(rng):
    from modelopt.torch.export.quant_utils import pack_int4_in_uint8

    w = odd_matrix(rng, rows=32, cols=128)
    q = F.quantize_int4(w, 32)
    assert q["weight"].shape == (32, 64) and q["weight_scale"].shape == (32, 4)
    back = F.dequantize_int4(q["weight"], q["weight_scale"])
    half_step = q["weight_scale"].repeat_interleave(32, dim=1) / 2
    # (as for int8 below: a tie is half a step off, and q * scale rounds in float32)
    assert ((back - w).abs() <= half_step * (1 + EPS) + back.abs() * 2**-23 + 1e-30).all()
    # ModelOpt packs along the output dimension; converting both ways is lossless and matches it
    theirs = pack_int4_in_uint8(w, q["weight_scale"], 32)
    assert theirs.shape == (16, 128)
    assert torch.equal(F.int4_from_modelopt(theirs), q["weight"])
    assert torch.equal(F.int4_to_modelopt(q["weight"]), theirs)
    codes = F.unpack_nibbles(q["weight"]).int() - F.INT4_OFFSET
    assert codes.min() >= -8 and codes.max() <= 7 and (codes[1] == 0).all()
    with pytest.raises(F.FormatError, match="group_size 48"):
        F.quantize_int4(w, 48)


def test_int8_round_trip(rng):
    w = odd_matrix(rng)
    q = F.quantize_int8_per_row(w)
    back = F.dequantize_int8(q["weight"], q["weight_scale"])
    # A tie (w / scale = k + 0.5) is exactly half a step off, and the dequantized q * scale rounds in
    # float32, by up to |back| * 2^-24 (and the difference once more): at codes near 127 that is ~8e-6
    # of a step, above EPS's share (seen: KILN_TEST_SEED=1646567459, w / scale = -100.5 in row 15).
    assert ((back - w).abs() <= q["weight_scale"][:, None] / 2 * (1 + EPS) + back.abs() * 2**-23 + 1e-30).all()
    assert q["weight"].abs().max() == 127


@pytest.mark.parametrize("fmt", sorted(F.FORMATS))
def test_registry_dequantize_every_format(fmt, rng):
    w = torch.randn(16, 64, generator=rng)
    spec = F.get_format(fmt)
    t = spec.quantize(w, 32) if fmt in ("int4_awq", "w4a8_awq") else spec.quantize(w)
    for extra in spec.required:
        t.setdefault(extra, torch.tensor(0.05))  # activation scales: not part of the weight
    dense = F.dequantize(fmt, t)
    assert dense.shape == w.shape
    assert (dense - w).norm() / w.norm() < 0.2
    if "pre_quant_scale" in spec.optional:  # smoothing folds into the columns: W diag(s)
        s = torch.rand(64, generator=rng) + 0.5
        assert torch.allclose(F.dequantize(fmt, dict(t, pre_quant_scale=s)), dense * s, rtol=1e-6, atol=0)


def test_registry_errors():
    with pytest.raises(F.FormatError, match="unknown weight format 'fp6'; allowed: none \\| fp8 \\| nvfp4"):
        F.get_format("fp6")
    with pytest.raises(F.FormatError, match="missing \\['weight_scale_2'\\]"):
        F.dequantize("nvfp4", {"weight": torch.zeros(4, 8, dtype=torch.uint8),
                               "weight_scale": torch.zeros(4, 1, dtype=F.FP8)})
    with pytest.raises(F.FormatError, match="expected torch.float8_e4m3fn, got torch.bfloat16"):
        F.dequantize_fp8(torch.zeros(2, 2, dtype=torch.bfloat16), torch.tensor(1.0))
    with pytest.raises(F.FormatError, match="weight_scale shape \\(4, 3\\)"):
        F.dequantize_nvfp4(torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, 3, dtype=F.FP8), torch.tensor(1.0))
    with pytest.raises(F.FormatError, match="does not tile"):
        F.dequantize_int4(torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, 3))


def test_runtime_modules_import_only_torch():
    code = ("import sys, quant, quant.formats, quant.pack; "
            "heavy = {'modelopt', 'transformers', 'numpy.distutils', 'tritonclient'} & set(sys.modules); "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)
