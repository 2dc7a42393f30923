"""The registry picks Triton kernels for GPUs/interpreter and references on CPU, and refuses clearly."""
import pytest
import torch

from plugins import registry
from plugins.reference.attention import paged_decode_ref
from plugins.rmsnorm import rms_norm


def test_every_registered_target_imports_and_both_kinds_exist():
    for (op, kind, fmt), impl in registry.REGISTRY.items():
        # (a row this machine does not run may load as None: a PyTorch build without FBGEMM)
        assert callable(impl.load()) or not impl.runs_here(), (op, kind, fmt)
        if kind != "cpu":   # the CPU C kernels' fallback is the caller's PyTorch ops, not a row
            assert (op, "torch" if kind == "triton" else "triton", fmt) in registry.REGISTRY


def test_the_cpu_kernels_are_rows_of_the_table():
    from plugins.cpu import gemm, ops
    assert registry.get("add_rms_norm", "cpu", torch.float32, kind="cpu") is ops.add_rms_norm
    assert registry.load("panel_gemm", "cpu") is gemm.gemm
    with pytest.raises(ValueError, match="run on the CPU only"):
        registry.get("add_rms_norm", "cuda", torch.float32, kind="cpu")
    with pytest.raises(ValueError, match="does not take torch.float16"):
        registry.get("add_rms_norm", "cpu", torch.float16, kind="cpu")
    with pytest.raises(ValueError, match="no torch implementation of 'add_rms_norm'"):
        registry.load("add_rms_norm", "torch")


def test_the_table_says_which_cpu_gemms_this_machine_has(monkeypatch):
    """The CPU linear's storage follows the table's answer: FBGEMM's fp16 GEMM where PyTorch has
    FBGEMM, Kiln's panel GEMM where the CPU has AVX-512, oneDNN where PyTorch was built with it."""
    from plugins.cpu import gemm
    assert registry.available("fp16_gemm", "cpu") == ("fbgemm" in torch.backends.quantized.supported_engines)
    assert registry.available("onednn_linear", "cpu") == torch.backends.mkldnn.is_available()
    assert registry.available("panel_gemm", "cpu") == gemm.available()
    assert registry.available("rms_norm", "torch")                   # a row with no condition
    assert not registry.available("no_such_op", "cpu")
    if registry.available("fp16_gemm", "cpu"):
        assert registry.load("fp16_gemm", "cpu") is torch.ops.quantized.linear_dynamic_fp16.default
        assert registry.load_if_available("fp16_pack", "cpu") is torch.ops.quantized.linear_prepack_fp16.default
    monkeypatch.setattr("plugins.cpu.vendor.fp16_gemm", None)        # a build without FBGEMM's GEMM
    assert not registry.available("fp16_gemm", "cpu") and registry.load_if_available("fp16_gemm", "cpu") is None


def test_the_table_says_which_kinds_run_the_fused_layer(monkeypatch):
    assert registry.fused_layer_kernels("torch", "cpu", torch.float32) is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernels = registry.fused_layer_kernels("triton", "cpu", torch.float32)
    assert kernels == {op: registry.get(op, "cpu", torch.float32, kind="triton") for op in registry.FUSED_LAYER_OPS}


def test_cpu_defaults(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert registry.get("rms_norm", "cpu", torch.float16) is rms_norm
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert registry.get("paged_decode", "cpu", torch.bfloat16) is paged_decode_ref
    with pytest.raises(ValueError, match="need an NVIDIA GPU"):
        registry.get("paged_decode", "cpu", torch.float16, kind="triton")


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="unknown op 'matmul'"):
        registry.get("matmul", "cpu", torch.float16)
    with pytest.raises(ValueError, match="for format 'int8_sq'; allowed: fp8, int4_awq, none, nvfp4, w4a8_awq"):
        registry.get("linear", "cpu", torch.float16, fmt="int8_sq")
    with pytest.raises(ValueError, match="does not take torch.int8"):
        registry.get("rms_norm", "cpu", torch.int8, kind="torch")


@pytest.mark.parametrize("fmt", ["nvfp4", "int4_awq", "w4a8_awq", "fp8", "none"])
def test_linear_kinds_agree(device, fmt):
    n, k = 64, 128
    x = torch.randn(3, k, device=device).half()
    t = {"weight": torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device)}
    if fmt == "nvfp4":
        t.update(weight_scale=torch.rand(n, k // 16, device=device).to(torch.float8_e4m3fn),
                 weight_scale_2=torch.tensor(0.1, device=device), input_scale=torch.tensor(1.0, device=device))
    elif fmt in ("int4_awq", "w4a8_awq"):
        t.update(weight_scale=(torch.rand(n, k // 64, device=device) * 0.1).half(),
                 pre_quant_scale=(torch.rand(k, device=device) + 0.5).half())
        if fmt == "w4a8_awq":
            t.update(input_scale=torch.tensor(0.02, device=device))
    elif fmt == "fp8":
        t = {"weight": torch.randn(n, k, device=device).to(torch.float8_e4m3fn),
             "weight_scale": torch.rand(n, device=device), "input_scale": torch.tensor(0.05, device=device)}
    else:
        t = {"weight": torch.randn(n, k, device=device).half()}
    a = registry.get("linear", device, torch.float16, fmt, kind="triton")(x, **t).float()
    b = registry.get("linear", device, torch.float16, fmt, kind="torch")(x, **t).float()
    assert (a - b).abs().max() <= 2e-3 * max(1.0, b.abs().max().item())


def test_w4a8_quantizes_activations_to_fp8(device):
    # same weights as int4_awq, but activations pass through fp8 at input_scale: results must differ
    n, k = 64, 128
    x = torch.randn(2, k, device=device).half()
    t = {"weight": torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device),
         "weight_scale": (torch.rand(n, 2, device=device) * 0.1).half()}
    a = registry.get("linear", device, torch.float16, "int4_awq", kind="torch")(x, **t)
    b = registry.get("linear", device, torch.float16, "w4a8_awq", kind="torch")(x, **t, input_scale=torch.tensor(0.05))
    assert 0 < (a.float() - b.float()).abs().max() < 0.1 * a.float().abs().max()
