"""The CPU linear path (backend/cpu_matmul.py): same numbers as F.linear, the few-row kernel taken
only where it was measured to win, and weights laid out once, shared rather than copied."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backend import cpu_matmul
from backend.linear import make_linear

needs_onednn = pytest.mark.skipif(cpu_matmul._DNN is None, reason="this PyTorch build has no oneDNN linear")


@needs_onednn
def test_prepare_is_column_major_same_values_and_idempotent():
    w = torch.randn(96, 40)
    p = cpu_matmul.prepare(w)
    assert p.shape == w.shape and torch.equal(p, w)
    assert cpu_matmul.is_column_major(p) and not cpu_matmul.is_column_major(w)
    assert cpu_matmul.prepare(p) is p  # a shared weight (tied lm_head, draft reusing it) is not copied twice


def test_prepare_leaves_other_dtypes_devices_and_ranks_alone():
    for w in (torch.randn(8, 4, dtype=torch.bfloat16), torch.randn(8), torch.randint(0, 9, (8, 4), dtype=torch.uint8)):
        assert cpu_matmul.prepare(w) is w


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 32, 33, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(rows, bias):
    torch.manual_seed(rows)
    w = torch.randn(72, 48)
    b = torch.randn(72) if bias else None
    x = torch.randn(rows, 48)
    got = cpu_matmul.linear(x, cpu_matmul.prepare(w), b)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_linear_accepts_leading_batch_dims():
    w, x = torch.randn(24, 16), torch.randn(2, 3, 16)
    torch.testing.assert_close(cpu_matmul.linear(x, cpu_matmul.prepare(w)), F.linear(x, w), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_kernel_chosen_by_row_count(monkeypatch):
    calls = []
    real = cpu_matmul._DNN
    monkeypatch.setattr(cpu_matmul, "_DNN", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    w = cpu_matmul.prepare(torch.randn(16, 8))
    for rows in (1, 4, cpu_matmul.SMALL_ROWS, cpu_matmul.SMALL_ROWS + 1, 256):
        cpu_matmul.linear(torch.randn(rows, 8), w)
    cpu_matmul.linear(torch.randn(2, 8), torch.randn(16, 8))        # a row-major weight: plain F.linear
    cpu_matmul.linear(torch.randn(2, 8).double(), w.double())       # not float32: plain F.linear
    assert calls == [1, 4, cpu_matmul.SMALL_ROWS]


@needs_onednn
def test_dense_and_dequantized_linears_store_column_major_on_cpu():
    torch.manual_seed(0)
    w = torch.randn(32, 16)
    lin = make_linear("none", {"weight": w, "bias": torch.randn(32)}, torch.float32, "cpu")
    assert cpu_matmul.is_column_major(lin.weight)
    x = torch.randn(3, 16)
    torch.testing.assert_close(lin(x), F.linear(x, w, lin.bias), rtol=1e-5, atol=1e-5)
    # bf16 compute (a CPU with native bf16, or a test asking for it) keeps the layout it was given.
    assert not cpu_matmul.is_column_major(make_linear("none", {"weight": w}, torch.bfloat16, "cpu").weight)
