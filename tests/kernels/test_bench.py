"""`make bench-kernels` needs a GPU: without one it must stop at once with a clear message (status 2)."""
import pytest
import torch

from harness.bench import kernels as bench


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_bench_refuses_without_gpu(capsys):
    assert bench.main([]) == 2
    assert "no NVIDIA GPU visible" in capsys.readouterr().err
