"""bf16, the runtime's dtype on GPUs, which the interpreter cannot check (its bf16 tl.dot is wrong):
these run only on an NVIDIA GPU (`make bench-kernels` runs them)."""
import pytest
import torch

from plugins.gemm_w4a16 import w4a16_linear
from plugins.paged_decode import paged_decode
from plugins.paged_prefill import paged_prefill
from plugins.reference.attention import paged_decode_ref, paged_prefill_ref
from plugins.reference.gemm import int4_awq_linear_ref, nvfp4_linear_ref
from tests.kernels.kernel_utils import assert_close, make_paged

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 kernels need an NVIDIA GPU")]


@pytest.mark.parametrize("group,head_dim,block_size", [(4, 128, 16), (8, 128, 64), (3, 64, 32)])
def test_bf16_decode_and_prefill(fresh_seed, group, head_dim, block_size):
    lens = [1, 300, 2049, 77]
    k, v, tables = make_paged(lens, block_size, 2, head_dim, torch.bfloat16, "cuda")
    q = torch.randn(4, 2 * group, head_dim, device="cuda").bfloat16()
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    assert_close(paged_decode(q, k, v, tables, sl, head_dim ** -0.5),
                 paged_decode_ref(q, k, v, tables, sl, head_dim ** -0.5), torch.bfloat16, "bf16 decode", fresh_seed)
    ctx = torch.tensor([0, 200, 2000, 0], dtype=torch.int32, device="cuda")
    qlens = sl - ctx
    qsl = torch.cat([torch.zeros(1, dtype=torch.int32, device="cuda"), qlens.cumsum(0).int()])
    qp = torch.randn(int(qlens.sum()), 2 * group, head_dim, device="cuda").bfloat16()
    assert_close(paged_prefill(qp, k, v, tables, qsl, ctx, head_dim ** -0.5),
                 paged_prefill_ref(qp, k, v, tables, qsl, ctx, head_dim ** -0.5), torch.bfloat16, "bf16 prefill",
                 fresh_seed)


@pytest.mark.parametrize("m", [1, 16, 100])
def test_bf16_w4a16(fresh_seed, m):
    n, k = 256, 1024
    x = torch.randn(m, k, device="cuda").bfloat16()
    w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
    ws = (torch.rand(n, k // 16, device="cuda") + 0.1).to(torch.float8_e4m3fn)
    ws2 = torch.tensor(0.01, device="cuda")
    assert_close(w4a16_linear(x, "nvfp4", w, ws, ws2), nvfp4_linear_ref(x, w, ws, ws2), torch.bfloat16,
                 "bf16 nvfp4", fresh_seed)
    s4 = (torch.rand(n, k // 128, device="cuda") * 0.02).bfloat16()
    assert_close(w4a16_linear(x, "int4_awq", w, s4), int4_awq_linear_ref(x, w, s4), torch.bfloat16,
                 "bf16 int4", fresh_seed)
