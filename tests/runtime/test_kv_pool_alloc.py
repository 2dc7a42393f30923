"""The KV pool's CPU allocation (backend/runtime/kv_plan.zeroed): zeros from an anonymous mapping."""
from __future__ import annotations

import os

import pytest
import torch

from backend.runtime.kv_plan import zeroed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_a_pool_tensor_is_zeros_of_its_shape_and_dtype_and_takes_writes(dtype):
    t = zeroed((7, 16, 3, 64), dtype, torch.device("cpu"))
    assert t.shape == (7, 16, 3, 64) and t.dtype == dtype and t.is_contiguous()
    assert not t.view(torch.uint8).any()
    t[3, 5] = torch.ones(3, 64).to(dtype)
    assert t.view(torch.uint8).count_nonzero() > 0 and bool((t[3, 5].float() == 1).all())
    assert not t[:3].view(torch.uint8).any() and not t[4:].view(torch.uint8).any()


def test_pool_tensors_do_not_share_memory_and_an_empty_one_is_fine():
    a, b = (zeroed((2, 4, 1, 8), torch.float32, torch.device("cpu")) for _ in range(2))
    a.fill_(5.0)
    assert not b.any()
    assert zeroed((0, 4, 1, 8), torch.float32, torch.device("cpu")).numel() == 0


def test_the_pool_is_resident_only_where_written():
    """1 GiB asked for, one block written: the process's resident memory grows by far less than the
    pool (torch.zeros would commit all of it at load)."""
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    before = rss()
    t = zeroed((1 << 14, 16, 4, 64), torch.float32, torch.device("cpu"))   # 1 GiB
    t[0].fill_(1.0)
    assert rss() - before < (64 << 20)
