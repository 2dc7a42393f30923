"""The expert MLP's two implementations of its routed part (backend/model/moe.py), chosen by the kernel table
(plugins.registry.expert_kernel): the torch path's per-expert linears are views of the bundle's packed tensors
(one copy of the experts), and the fused expert kernel (Triton's interpreter here) gives the torch path's
numbers on the same routing."""
from __future__ import annotations

import os

# before triton is imported (tests/kernels/conftest.py does too): every test here runs the kernel on the CPU
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from backend.arch_spec import Experts  # noqa: E402
from backend.model.moe import build_experts  # noqa: E402
from plugins import registry  # noqa: E402

E, K, H, I = 4, 2, 32, 48
SPEC = Experts(num_experts=E, top_k=K, intermediate_size=I, layers=(0,), renormalize=True)


def _weights(dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"layers.0.router.weight": torch.randn(E, H, generator=g).to(dtype),
            "layers.0.experts.gate_up.weight": (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(dtype),
            "layers.0.experts.down.weight": (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dtype)}


def test_the_torch_path_views_the_packed_tensors():
    """bf16 (whose CPU linears keep their weight as given): every expert's linear is a slice of the one packed
    tensor, not a copy of it."""
    w = _weights(torch.bfloat16)
    moe = build_experts(w, "layers.0", SPEC, H, torch.bfloat16, torch.device("cpu"))
    assert moe.kernel is None and len(moe.gate_up) == len(moe.down) == E
    for lins, name in ((moe.gate_up, "gate_up"), (moe.down, "down")):
        packed = w[f"layers.0.experts.{name}.weight"]
        assert {lin.weight.untyped_storage().data_ptr() for lin in lins} == {packed.untyped_storage().data_ptr()}


def test_the_kernel_table_picks_the_fused_expert_kernel_by_backend_kind():
    cpu = torch.device("cpu")
    assert registry.expert_kernel("torch", cpu, torch.float32) is None
    assert registry.expert_kernel("triton", cpu, torch.float32) is registry.load("fused_moe", "triton")


def test_the_fused_kernel_gives_the_torch_paths_numbers():
    w, cpu = _weights(), torch.device("cpu")
    torch_path = build_experts(w, "layers.0", SPEC, H, torch.float32, cpu)
    fused = build_experts(w, "layers.0", SPEC, H, torch.float32, cpu,
                          kernel=registry.expert_kernel("triton", cpu, torch.float32))
    assert fused.kernel is not None and not fused.gate_up
    for t in (1, 40):   # 2 and 80 slots over 4 experts: the decode row block (16) and the prefill one (64)
        x = torch.randn(t, H, generator=torch.Generator().manual_seed(t))
        torch.testing.assert_close(fused(x), torch_path(x), atol=1e-5, rtol=1e-5)
