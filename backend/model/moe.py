"""The mixture-of-experts MLP (model.arch.experts): route, run each chosen expert's SwiGLU over the tokens
routed to it, combine. Two implementations of the routed part, chosen by the kernel table
(``plugins.registry.expert_kernel``): the fused expert kernel (plugins/fused_moe.py: an NVIDIA GPU, or the
Triton backend under the interpreter in tests) over the bundle's packed tensors, or this module's per-expert
loop (the torch path, CPU), to which the kernel is held.

Storage: the bundle's packed ``gate_up [E, 2I, H]`` and ``down [E, H, I]``, once, in the model dtype. The
kernel reads them as they are; the loop's per-expert linears are views of them (a CPU float32 linear
takes its GEMM's own storage, backend/ops/cpu_matmul.py, and the packed tensors are then not kept).

Numbers follow transformers' MixtralSparseMoeBlock / Qwen3MoeSparseMoeBlock: router logits in the model
dtype, softmax and top-k in fp32 (renormalised when the spec says), each expert's output times its weight,
added into a zero buffer in the model dtype, experts in ascending order.

Batch invariance (docs/contracts.md): a token's output must not depend on the step's other tokens. Each
expert's rows go through the dense path's linears (``cpu_matmul``: a row's result is the same at every row
count), and a token's k contributions are added in expert order whatever else was routed, so it holds.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from backend.arch_spec import Experts
from backend.model.layers import silu_and_mul
from backend.ops.linear import QuantLinear, make_linear


@dataclass
class ExpertMLP:
    """One layer's experts: ``router [E, H]``; per expert ``gate_up [2I, H]`` and ``down [H, I]`` linears
    (the torch path; empty when ``kernel`` runs them), or ``kernel(x, ids, weights)``: the fused expert
    kernel bound to the packed tensors."""
    router: QuantLinear
    gate_up: list[QuantLinear]
    down: list[QuantLinear]
    top_k: int
    renormalize: bool
    kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    shared: "SharedExpert | None" = None    # model.arch.experts.shared_intermediate_size

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` (normed) -> ``[T, H]``."""
        weights, ids = route(self.router(x), self.top_k, self.renormalize)
        out = self._routed(x, weights, ids)
        if self.shared is not None:   # after the routed sum, as transformers adds it
            out = out + self.shared(x)
        return out

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum: ``x [T, H]``, ``weights [T, k]`` fp32, ``ids [T, k]`` -> ``[T, H]``."""
        if self.kernel is not None:
            return self.kernel(x, ids, weights)
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():   # only the experts that received tokens (sorted)
            tokens, slot = torch.nonzero(ids == e, as_tuple=True)
            y = self.down[e](silu_and_mul(self.gate_up[e](x.index_select(0, tokens))))
            out.index_add_(0, tokens, (y * weights[tokens, slot, None]).to(out.dtype))
        return out


@dataclass
class SharedExpert:
    """The expert every token runs: ``gate_up [2Is, H]``, ``down [H, Is]``; ``gate [1, H]`` or None (ungated)."""
    gate_up: QuantLinear
    down: QuantLinear
    gate: QuantLinear | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(silu_and_mul(self.gate_up(x)))
        return y if self.gate is None else torch.sigmoid(self.gate(x)) * y


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [T, E]`` -> (``weights [T, k]`` fp32, ``ids [T, k]``): softmax over the experts, the k
    largest probabilities, divided by their sum when ``renormalize`` (Mixtral, norm_topk_prob)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def build_experts(weights: dict[str, torch.Tensor], prefix: str, spec: Experts, hidden: int, dtype: torch.dtype,
                  device: torch.device, kernel: Callable | None = None, aot=None) -> ExpertMLP:
    """Layer ``prefix``'s (``layers.3``) experts from the bundle's packed tensors; a shape that disagrees
    with the spec is refused. ``kernel``: the kernel table's fused_moe (``registry.expert_kernel``), which
    then runs on the packed tensors (launching ``aot``'s cubins, the bundle's ``KernelSet``, where it has
    them); None: each expert's slice as a dense linear, in the storage the CPU matmul wants."""
    e, width, shared = spec.num_experts, spec.intermediate_size, spec.shared_intermediate_size
    want = {"router.weight": (e, hidden), "experts.gate_up.weight": (e, 2 * width, hidden),
            "experts.down.weight": (e, hidden, width),
            **({"shared_expert.gate_up.weight": (2 * shared, hidden), "shared_expert.down.weight": (hidden, shared)}
               if shared else {}),
            **({"shared_expert_gate.weight": (1, hidden)} if spec.shared_gate else {})}
    for name, shape in want.items():
        got = weights.get(f"{prefix}.{name}")
        if got is None:
            raise KeyError(f"weights.safetensors: missing tensor {prefix}.{name!r} (model.arch.experts.layers "
                           f"has this layer); rebuild the bundle")
        if tuple(got.shape) != shape:
            raise ValueError(f"weights.safetensors: {prefix}.{name} is {tuple(got.shape)}; model.arch.experts "
                             f"implies {shape}")

    def linear(w: torch.Tensor, where: str) -> QuantLinear:
        return make_linear("none", {"weight": w}, dtype, device, where=where)

    # the packed tensors, converted once: the kernel's operands, or what the per-expert linears view
    gate_up, down = (weights[f"{prefix}.experts.{n}.weight"].to(device=device, dtype=dtype)
                     for n in ("gate_up", "down"))
    router = linear(weights[f"{prefix}.router.weight"], f"{prefix}.router")
    # the shared expert is one dense SwiGLU on every token: the dense path's linears on both paths
    common = SharedExpert(
        gate_up=linear(weights[f"{prefix}.shared_expert.gate_up.weight"], f"{prefix}.shared_expert.gate_up"),
        down=linear(weights[f"{prefix}.shared_expert.down.weight"], f"{prefix}.shared_expert.down"),
        gate=linear(weights[f"{prefix}.shared_expert_gate.weight"], f"{prefix}.shared_expert_gate")
        if spec.shared_gate else None) if shared else None
    if kernel is not None:
        return ExpertMLP(router=router, gate_up=[], down=[], top_k=spec.top_k, renormalize=spec.renormalize,
                         kernel=partial(_fused, kernel, gate_up.contiguous(), down.contiguous(), aot), shared=common)
    return ExpertMLP(router=router, gate_up=[linear(gate_up[k], f"{prefix}.experts.gate_up[{k}]") for k in range(e)],
                     down=[linear(down[k], f"{prefix}.experts.down[{k}]") for k in range(e)],
                     top_k=spec.top_k, renormalize=spec.renormalize, shared=common)


def _fused(kernel: Callable, gate_up: torch.Tensor, down: torch.Tensor, aot, x: torch.Tensor, ids: torch.Tensor,
           weights: torch.Tensor) -> torch.Tensor:
    return kernel(x, ids, weights, gate_up, down, aot=aot)
