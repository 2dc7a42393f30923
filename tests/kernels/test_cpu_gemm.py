"""Kiln's AVX-512 CPU GEMM (plugins/cpu/gemm.c, gemm.py): float32 sums of fp16 or fp8 e4m3 weights
packed in 16-column panels. What it must keep: every output is one FMA chain over k in order (so a
row's bits do not depend on the other rows, the blocking or the threads), e4m3 codes widen exactly,
and every output is written. Runs where the CPU has AVX-512 (elsewhere FBGEMM's GEMM runs and these
skip, saying so)."""
from __future__ import annotations

import pytest
import torch

from plugins.cpu import gemm

pytestmark = pytest.mark.skipif(not gemm.available(), reason="this CPU has no AVX-512 (or no C compiler): "
                                "backend/ops/cpu_matmul.py runs FBGEMM's fp16 GEMM instead")


def _codes(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 3).to(torch.float8_e4m3fn)


def _packed(codes: torch.Tensor, fmt: int) -> torch.Tensor:
    return gemm.pack(codes if fmt == gemm.E4M3 else codes.float().half())[0]


def _run(x, codes, fmt, scale=None, threads=None):
    out = torch.full((x.shape[0], codes.shape[0]), float("nan"))     # poisoned: every output must be written
    return gemm.gemm(x, _packed(codes, fmt), fmt, codes.shape[0], scale, threads=threads, out=out)


@pytest.mark.parametrize("fmt", [gemm.FP16, gemm.E4M3])
@pytest.mark.parametrize("n,k", [(1, 8), (17, 33), (40, 64), (100, 96), (576, 576)])
def test_gemm_matches_a_float64_reference(fmt, n, k):
    codes = _codes(n, k, seed=n + k)
    scale = torch.rand(n, generator=torch.Generator().manual_seed(1)) * 0.01
    w = codes.double()
    for m in (1, 2, 5, 7, 8, 13, 14, 15, 16, 17, 29, 113, 250):   # every block shape, several passes
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        want = (x.double() @ w.T) * scale.double()
        got = _run(x, codes, fmt, scale)
        assert not got.isnan().any(), (m, "an output was never written")
        bound = 1e-6 * k * ((x.double().abs() @ w.abs().T) * scale.double()).max().item()
        assert (got.double() - want).abs().max().item() <= bound, (m, n, k)


@pytest.mark.parametrize("fmt", [gemm.FP16, gemm.E4M3])
def test_every_e4m3_code_widens_exactly(fmt):
    """Every finite code, positive and negative, normal and subnormal: a one-hot row picks one weight
    out, so the output is the code's value (times the scale) with no sum to round."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = codes[~codes.float().isnan()]                                 # 254 codes (0x7f, 0xff are NaN)
    w = finite.view(-1, 1).expand(-1, 24).contiguous()                     # [254, 24]: column j of x picks k = j
    x = torch.eye(24)[[0, 5, 23]]
    scale = torch.full((finite.numel(),), 0.375)
    got = _run(x, w, fmt, scale)
    assert torch.equal(got, (finite.float() * 0.375).expand(3, -1))


def test_fp8_and_fp16_panels_give_the_same_bits():
    """Both storages widen to the same float32 values and sum them in the same order (the e4m3 path's
    2^8 folded into the scale is exact for these inputs)."""
    codes = _codes(96, 1536, seed=3)
    scale = torch.rand(96) * 0.01 + 1e-3
    for m in (1, 16, 40):
        x = torch.randn(m, 1536)
        assert torch.equal(_run(x, codes, gemm.E4M3, scale), _run(x, codes, gemm.FP16, scale)), m


@pytest.mark.parametrize("fmt", [gemm.FP16, gemm.E4M3])
def test_a_rows_bits_do_not_depend_on_the_other_rows_or_the_threads(fmt):
    """Batch invariance (docs/contracts.md): a row alone, or at any place among any number of rows,
    on one thread or two, gives the same bits."""
    codes = _codes(576, 1536, seed=4)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(300, 1536, generator=g)
    row = torch.randn(1, 1536, generator=g)
    alone = _run(row, codes, fmt, threads=1)
    assert torch.equal(_run(row, codes, fmt, threads=2), alone)
    for rows in (2, 3, 7, 8, 9, 14, 15, 16, 17, 28, 31, 113, 300):
        for at in sorted({0, rows // 2, rows - 1}):
            batch = x[:rows].clone()
            batch[at] = row[0]
            for threads in (1, 2):
                assert torch.equal(_run(batch, codes, fmt, threads=threads)[at], alone[0]), (rows, at, threads)


@pytest.mark.skipif("fbgemm" not in torch.backends.quantized.supported_engines,
                    reason="this PyTorch build has no FBGEMM")
def test_the_same_bits_as_fbgemms_fp16_gemm():
    """The kernel replaces FBGEMM's fp16 GEMM on AVX-512 without changing a model's numbers: FBGEMM's
    AVX-512 kernels also sum each output as one FMA chain over k. Output widths that are multiples of
    16 (every model's): FBGEMM's own results for other widths change with the width (measured: its
    N = 53 differs from its N = 64 padded), this kernel's do not."""
    for n, k in ((576, 576), (960, 576), (64, 1536), (3072, 576)):
        codes = _codes(n, k, seed=n)
        packed = torch.ops.quantized.linear_prepack_fp16(codes.float(), None)
        for m in (1, 3, 16, 33, 130):
            x = torch.randn(m, k)
            want = torch.ops.quantized.linear_dynamic_fp16(x, packed)
            assert torch.equal(_run(x, codes, gemm.FP16), want), (n, k, m)
            assert torch.equal(_run(x, codes, gemm.E4M3), want), (n, k, m)


def test_pack_round_trips_and_refuses_other_dtypes():
    codes = _codes(37, 20, seed=6)
    for w in (codes, codes.float().half()):
        panels, fmt = gemm.pack(w)
        assert panels.shape == (3, 20, 16)
        assert torch.equal(gemm.unpack(panels, fmt, 37), w.float())
    with pytest.raises(ValueError, match="float16 or float8_e4m3fn"):
        gemm.pack(torch.randn(4, 4))
    with pytest.raises(ValueError, match="contiguous float32"):
        gemm.gemm(torch.randn(4, 40)[:, ::2], gemm.pack(codes)[0], gemm.E4M3, 37)
    # one row of a wider tensor (PyTorch calls it contiguous whatever its row stride) is taken as it is
    wide = torch.randn(3, 50)
    row = wide[1:2, 10:30]
    assert row.is_contiguous() and row.stride(0) == 50
    assert torch.equal(gemm.gemm(row, gemm.pack(codes)[0], gemm.E4M3, 37),
                       gemm.gemm(row.clone(), gemm.pack(codes)[0], gemm.E4M3, 37))
