"""KV-cache write kernel vs reference: slot mapping incl. -1 padding, fp16/fp32 and fp8 with scale."""
import pytest
import torch

from plugins.kv_write import write_kv
from plugins.reference.kv_cache import write_kv_ref
from tests.kernels.kernel_utils import poison


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("T,heads,head_dim,block_size", [(11, 3, 64, 16), (37, 8, 128, 32), (1, 1, 64, 64)])
def test_write_kv_matches_reference(device, fresh_seed, dtype, T, heads, head_dim, block_size):
    num_blocks = 4
    act = torch.float16 if dtype == torch.float8_e4m3fn else dtype
    k = torch.randn(T, heads, head_dim, device=device).to(act) * 3
    v = torch.randn(T, heads, head_dim, device=device).to(act)
    slots = torch.randperm(num_blocks * block_size, device=device)[:T].long()
    slots[[0, T - 1] if T > 1 else []] = -1   # padding rows must not be written anywhere
    shape = (num_blocks, block_size, heads, head_dim)
    caches = [poison(torch.empty(shape, dtype=dtype, device=device)) for _ in range(4)]
    ks, vs = torch.tensor(0.05), torch.tensor(0.02)
    write_kv(k, v, caches[0], caches[1], slots, ks, vs)
    write_kv_ref(k, v, caches[2], caches[3], slots, ks, vs)
    for got, ref in ((caches[0], caches[2]), (caches[1], caches[3])):
        # bit-exact: the kernel rounds to fp8 exactly like torch (round-to-nearest-even, saturating)
        assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8)), f"seed={fresh_seed}"
    written = caches[0].view(-1, heads, head_dim)[slots[slots >= 0]]
    assert not written.float().isnan().any()


def test_write_kv_fp8_saturates_and_rounds(device):
    # values straddling powers of two and beyond 448 * scale: where a truncating cast goes wrong
    vals = torch.tensor([1.99, -1.99, 0.4925, 500.0, -1e6, 0.0013, 3.5e-3, 0.0], device=device)
    k = vals.repeat(64).view(8, 1, 64).half()
    cache = torch.empty(1, 8, 1, 64, dtype=torch.float8_e4m3fn, device=device)
    write_kv(k, k, cache, cache.clone(), torch.arange(8, device=device), 1.0, 1.0)
    ref = k.float().clamp(-448, 448).to(torch.float8_e4m3fn).view(1, 8, 1, 64)
    assert torch.equal(cache.view(torch.uint8), ref.view(torch.uint8))


def test_write_kv_rejects_bad_shapes(device):
    k = torch.zeros(2, 2, 64, device=device)
    cache = torch.zeros(1, 16, 3, 64, device=device)
    with pytest.raises(ValueError, match="cache shape"):
        write_kv(k, k, cache, cache, torch.zeros(2, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(k, k, cache[:, :, :2].contiguous(), cache[:, :, :2].contiguous(),
                 torch.zeros(3, dtype=torch.long, device=device))
