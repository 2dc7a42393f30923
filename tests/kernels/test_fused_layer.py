"""Fused decode-layer kernels vs their references (plugins/reference/fused.py): residual add + RMSNorm
+ FP8 quantization, SiLU x up + FP8 quantization, plain FP8 quantization, RoPE + paged KV write.
Outputs are poisoned first, inputs fresh random each run (the seed is in every message)."""
import pytest
import torch

from plugins.act_quant import quantize_fp8, silu_mul_quant
from plugins.norm_quant import add_rms_norm_quant
from plugins.reference import kv_cache as kv_ref
from plugins.reference.fused import add_rms_norm_quant_ref, rope_write_kv_ref, silu_mul_quant_ref
from plugins.reference.rope import rope_cos_sin, rope_inv_freq
from plugins.rope_kv import rope_write_kv
from tests.kernels.kernel_utils import TOL, assert_close, poison

FP8 = torch.float8_e4m3fn


def _e4m3_step(x: torch.Tensor) -> torch.Tensor:
    """The spacing of e4m3 codes at |x|: 2^(e-3) in the binade [2^e, 2^(e+1)), 2^-9 among subnormals."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(2.0 ** -6))) - 3)


def assert_fp8_close(got: torch.Tensor, ref: torch.Tensor, what: str, seed: int, max_frac: float = 0.01,
                     atol: float = 0.0):
    """fp8 codes: each value within one e4m3 step of the reference's (the value before rounding may
    differ by an ulp of the activation dtype and fall on the other side) plus ``atol`` (in the codes'
    units: the error the computation before the quantization may make), and at most ``max_frac`` of
    the codes different at all. Steps are judged by value, not by code distance: near zero a code
    step is 2^-9 and an absolute error of the computation spans several of them."""
    assert got.dtype == FP8 and ref.dtype == FP8, what
    assert not got.float().isnan().any(), f"{what}: NaN (unwritten element?) seed={seed}"
    g, r = got.float().cpu(), ref.float().cpu()
    bound = _e4m3_step(torch.maximum(g.abs(), r.abs())) + atol
    worst = float(((g - r).abs() - bound).max())
    assert worst <= 0, f"{what}: a value is {worst:.3g} past one e4m3 step (+ atol {atol:.3g}) seed={seed}"
    differ = float((got.view(torch.uint8) != ref.view(torch.uint8)).float().mean())
    assert differ <= max_frac, f"{what}: {differ:.3%} of codes differ seed={seed}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("T,H", [(1, 128), (7, 576), (33, 1000)])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("quant", [False, True])
def test_add_rms_norm_quant(device, fresh_seed, dtype, T, H, residual, quant):
    x = (torch.randn(T, H, device=device) * 2).to(dtype)
    res = torch.randn(T, H, device=device).to(dtype) if residual else None
    w = (1 + 0.1 * torch.randn(H, device=device)).to(dtype)
    scale = torch.tensor(0.01, device=device) if quant else None
    want_y, want_res = add_rms_norm_quant_ref(x, w, 1e-5, res, scale)
    y, new_res = add_rms_norm_quant(x, w, 1e-5, res, scale)
    if quant:
        assert_fp8_close(y, want_y, "normed codes", fresh_seed)
    else:
        assert_close(y, want_y, dtype, "normed", fresh_seed)
    assert_close(new_res, want_res, dtype, "residual", fresh_seed, tol=0.0)   # one rounded add: exact


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("T,N", [(1, 256), (9, 1536), (4, 5000)])
@pytest.mark.parametrize("quant", [False, True])
def test_silu_mul_quant(device, fresh_seed, dtype, T, N, quant):
    gu = (torch.randn(T, 2 * N, device=device) * 3).to(dtype)
    scale = torch.tensor(0.02, device=device) if quant else None
    want = silu_mul_quant_ref(gu, scale)
    got = silu_mul_quant(gu, scale)
    if quant:
        assert_fp8_close(got, want, "silu*up codes", fresh_seed)
    else:
        assert_close(got, want, dtype, "silu*up", fresh_seed)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_quantize_fp8_is_bit_exact(device, fresh_seed, dtype):
    x = torch.randn(6, 777, device=device).to(dtype) * 5
    x[0, :8] = torch.tensor([1.99, -1.99, 0.4925, 500.0, -1e4, 0.0013, 3.5e-3, 0.0]).to(dtype)   # ties, saturation
    s = torch.tensor(1.0, device=device)
    assert torch.equal(quantize_fp8(x, s).view(torch.uint8), kv_ref.quantize_fp8(x, s).view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("kv", ["act", "fp8"])
@pytest.mark.parametrize("T,hq,hkv,D", [(1, 4, 2, 32), (19, 9, 3, 64), (40, 32, 8, 128)])
def test_rope_write_kv(device, fresh_seed, dtype, kv, T, hq, hkv, D):
    bs, num_blocks = 16, 6
    qkv = torch.randn(T, (hq + 2 * hkv) * D, device=device).to(dtype)
    cos_sin = rope_cos_sin(512, rope_inv_freq(D, 500000.0, {"rope_type": "llama3", "factor": 8.0,
                                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 128})).to(device)
    positions = torch.randint(0, 512, (T,), device=device)
    slots = torch.randperm(num_blocks * bs, device=device)[:T].long()
    slots[[0] if T > 1 else []] = -1            # padding: written nowhere
    cache_dtype = FP8 if kv == "fp8" else dtype
    shape = (num_blocks, bs, hkv, D)
    caches = [poison(torch.empty(shape, dtype=cache_dtype, device=device)) for _ in range(4)]
    ks, vs = torch.tensor(0.05, device=device), torch.tensor(0.03, device=device)
    ref_qkv = qkv.clone()
    q_ref = rope_write_kv_ref(ref_qkv, positions, cos_sin, caches[2], caches[3], slots, hq, hkv, ks, vs)
    q = rope_write_kv(qkv, positions, cos_sin, caches[0], caches[1], slots, hq, hkv, ks, vs)
    assert q.data_ptr() == qkv.data_ptr() and q.shape == (T, hq, D)
    assert_close(q, q_ref, dtype, "rotated q", fresh_seed)
    assert torch.equal(qkv[:, hq * D:], ref_qkv[:, hq * D:]), "k and v must stay as they were in qkv"
    keep = slots[slots >= 0]
    for name, got, ref in (("k", caches[0], caches[2]), ("v", caches[1], caches[3])):
        g, r = got.view(-1, hkv, D)[keep], ref.view(-1, hkv, D)[keep]
        if kv == "fp8":
            assert_fp8_close(g, r, f"{name} cache codes", fresh_seed, max_frac=0.02 if name == "k" else 0.0)
        else:
            assert_close(g, r, dtype, f"{name} cache", fresh_seed)
        # slots not written by this step keep their poison
        untouched = torch.ones(num_blocks * bs, dtype=torch.bool, device=device)
        untouched[keep] = False
        assert torch.equal(got.view(-1, hkv, D)[untouched].view(torch.uint8),
                           ref.view(-1, hkv, D)[untouched].view(torch.uint8))


def test_rope_write_kv_rejects_bad_shapes(device):
    qkv = torch.zeros(2, 100, device=device)
    cache = torch.zeros(1, 16, 2, 32, device=device)
    cs = torch.zeros(16, 2, 16, device=device)
    pos = torch.zeros(2, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="qkv width"):
        rope_write_kv(qkv, pos, cs, cache, cache, pos, 4, 2)
    with pytest.raises(ValueError, match="positions"):
        rope_write_kv(torch.zeros(2, 8 * 32, device=device), pos[:1], cs, cache, cache, pos, 4, 2)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_paged_decode_writes_the_o_projections_fp8_input(device, fresh_seed, splits, dtype):
    """The attention output's quantization folded into the decode kernel (and its split-K reduction)."""
    from plugins.paged_decode import paged_decode
    from plugins.reference.attention import paged_decode_ref
    from tests.kernels.kernel_utils import make_paged
    lens, hkv, group, d = [5, 70, 130], 2, 4, 64
    k, v, tables = make_paged(lens, 16, hkv, d, dtype, device)
    q = torch.randn(len(lens), hkv * group, d, device=device).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    s = torch.tensor(0.004, device=device)
    got = paged_decode(q, k, v, tables, seq_lens, d ** -0.5, num_splits=splits, out_scale=s)
    exact = paged_decode_ref(q, k, v, tables, seq_lens, d ** -0.5)
    want = kv_ref.quantize_fp8(exact, s)
    # the attention itself is allowed assert_close's error (TOL, relative to max(1, max |out|)) before
    # it is quantized: in code units that is TOL * max(1, max |out|) / s
    atol = TOL[dtype] * max(1.0, float(exact.float().abs().max())) / float(s)
    assert_fp8_close(got, want, "attention output codes", fresh_seed, max_frac=0.03, atol=atol)
