"""Quantized GEMMs vs references: W4A16 (NVFP4, INT4-AWQ) with in-GEMM dequantization, FP8 W8A8
(Triton fallback path; torch._scaled_mm is GPU-only). Shapes include SmolLM2's K=576 and ragged N."""
import pytest
import torch

from plugins.gemm_fp8 import fp8_linear
from plugins.gemm_w4a16 import w4a16_linear
from plugins.reference.gemm import dequant_nvfp4, fp8_linear_ref, int4_awq_linear_ref, nvfp4_linear_ref
from quant.formats import E2M1_VALUES
from tests.kernels.kernel_utils import assert_close


def _packed(n, k, device):
    return torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("m,n,k,split_k", [(1, 96, 576, None), (1, 96, 576, 4), (5, 64, 128, 3),
                                           (33, 80, 192, None), (33, 80, 192, 2)])
def test_nvfp4_w4a16(device, fresh_seed, dtype, m, n, k, split_k):
    # split_k: K sliced over programs and summed in fp32 (uneven: 576 = 3 x 192 tiles of 64 -> 3 splits)
    x = torch.randn(m, k, device=device).to(dtype)
    w = _packed(n, k, device)
    ws = (torch.rand(n, k // 16, device=device) * 2 + 0.1).to(torch.float8_e4m3fn)
    ws2 = torch.tensor(0.01, device=device)
    out = w4a16_linear(x, "nvfp4", w, ws, ws2, split_k=split_k)
    ref = nvfp4_linear_ref(x, w, ws, ws2)
    assert_close(out, ref, dtype, "nvfp4", fresh_seed)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("m,n,k,group", [(1, 96, 576, 64), (7, 64, 256, 128), (20, 72, 128, 32)])
@pytest.mark.parametrize("pre_quant", [False, True])
@pytest.mark.parametrize("split_k", [None, 2])
def test_int4_awq_w4a16(device, fresh_seed, dtype, m, n, k, group, pre_quant, split_k):
    x = torch.randn(m, k, device=device).to(dtype)
    w = _packed(n, k, device)
    ws = (torch.rand(n, k // group, device=device) * 0.02 + 0.001).to(dtype)
    pqs = (torch.rand(k, device=device) + 0.5).to(dtype) if pre_quant else None
    out = w4a16_linear(x, "int4_awq", w, ws, pre_quant_scale=pqs, split_k=split_k)
    ref = int4_awq_linear_ref(x, w, ws, pqs)
    assert_close(out, ref, dtype, "int4_awq", fresh_seed)


def test_e2m1_table_covers_all_codes():
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes[0::2] | (codes[1::2] << 4)).view(1, 8)
    vals = dequant_nvfp4(packed, torch.ones(1, 1, dtype=torch.float8_e4m3fn), torch.tensor(1.0))[0, :16]
    assert vals.tolist() == list(E2M1_VALUES) + [-v for v in E2M1_VALUES]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("m,n,k", [(1, 96, 576), (18, 64, 128)])
def test_fp8_linear_triton_path(device, fresh_seed, dtype, m, n, k):
    x = torch.randn(m, k, device=device).to(dtype)
    # clamp: a CUDA cast of values beyond e4m3's 448 gives NaN, not the largest finite value
    w = (torch.randn(n, k, device=device) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    ws = torch.rand(n, device=device) * 0.01 + 1e-3
    xs = torch.tensor(0.02, device=device)
    out = fp8_linear(x, w, ws, xs, use_scaled_mm=False)
    ref = fp8_linear_ref(x, w, ws, xs)
    assert_close(out, ref, dtype, "fp8 gemm", fresh_seed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch._scaled_mm needs an NVIDIA GPU")
def test_fp8_linear_scaled_mm_path(fresh_seed):
    x = torch.randn(24, 256, device="cuda").bfloat16()
    w = (torch.randn(128, 256, device="cuda") * 100).to(torch.float8_e4m3fn)
    ws, xs = torch.rand(128, device="cuda") * 0.01 + 1e-3, torch.tensor(0.02, device="cuda")
    assert_close(fp8_linear(x, w, ws, xs, use_scaled_mm=True), fp8_linear_ref(x, w, ws, xs),
                 torch.bfloat16, "scaled_mm", fresh_seed)


def test_w4a16_rejects_bad_layouts(device):
    x = torch.zeros(2, 64, device=device)
    with pytest.raises(ValueError, match="format 'int8'"):
        w4a16_linear(x, "int8", _packed(8, 64, device), torch.ones(8, 1, device=device))
    with pytest.raises(ValueError, match=r"weight must be uint8 \[N, 32\]"):
        w4a16_linear(x, "int4_awq", _packed(8, 32, device), torch.ones(8, 1, device=device))
    with pytest.raises(ValueError, match="nvfp4 needs"):
        w4a16_linear(x, "nvfp4", _packed(8, 64, device), torch.ones(8, 4, device=device))


def test_fp8_linear_rejects_bad_weight(device):
    x = torch.zeros(2, 64, device=device)
    with pytest.raises(ValueError, match="allowed: float8_e4m3fn"):
        fp8_linear(x, torch.zeros(8, 64, device=device), torch.ones(8, device=device), torch.tensor(1.0))
    with pytest.raises(ValueError, match="do not share K"):
        fp8_linear(x, torch.zeros(8, 32, device=device).to(torch.float8_e4m3fn), torch.ones(8), torch.tensor(1.0))


def test_fp8_and_w4a16_variants_declare_what_the_shapes_guarantee():
    """AOT variants compile integer arguments as multiples of 16 only where every linear of the engine
    makes them so (plugins.common.divisible_args); a call that breaks it is refused by the launcher."""
    import dataclasses

    from plugins import aot, gemm_fp8, gemm_w4a16, w4a16_codes
    from plugins.common import EngineShapes
    from plugins.launcher import pack_params
    llama = EngineShapes(act="bf16", kv="fp8e4nv", num_heads=32, num_kv_heads=8, head_dim=128, hidden_size=4096,
                         intermediate_size=14336, block_size=16, quant_format="fp8", group_size=None, speculative=True)
    odd = dataclasses.replace(llama, intermediate_size=14344)    # a K that is not a multiple of 16
    assert set(gemm_fp8.divisible(llama)) == {"K", "stride_xm", "stride_wn"} and gemm_fp8.divisible(odd) == ()
    for v in aot.plan(llama):
        if v.fn is gemm_fp8.fp8_gemm_kernel:
            assert set(v.divisible) == {"K", "stride_xm", "stride_wn"}
    awq = dataclasses.replace(llama, quant_format="int4_awq", group_size=128)
    assert set(w4a16_codes.divisible(awq)) == {"K", "k_per_split", "stride_xm", "stride_wn", "stride_sn"}
    v = next(v for v in aot.plan(llama) if v.fn is gemm_fp8.fp8_gemm_kernel)
    sig = v.signature()
    meta = {"key": v.key, "signature": [[n, t] for n, t in sig.items()],
            "params": [n for n, t in sig.items() if t != "constexpr"], "aligned": [], "aligned_pointers": 16,
            "divisible": list(v.divisible), "extra_params": 0}
    args = dict(M=1, N=64, K=4096, stride_xm=4096, stride_wn=4096, stride_om=64)
    call = lambda **kw: tuple({**args, **kw}.get(n, 0) for n in meta["params"])  # noqa: E731
    pack_params(meta, call())
    with pytest.raises(ValueError, match="stride_wn=4100 is not a multiple of 16"):
        pack_params(meta, call(stride_wn=4100))
