"""Attention backends: one interface, one registry.

Every backend reads and writes the paged KV cache described in docs/contracts.md section 4:
per layer ``k_cache, v_cache`` of shape ``[num_blocks, block_size, num_kv_heads, head_dim]`` in the
model dtype, or ``torch.float8_e4m3fn`` with fp32 scalar ``k_scale``/``v_scale`` (stored = x / scale).

A backend is registered by name in ``ATTENTION_BACKENDS`` as a *module path* so that importing this
package never imports Triton (the CPU runtime must not pay for, or depend on, a GPU toolchain).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # the metadata module belongs to the runtime core; only needed for annotations
    import torch

    from backend.ops.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """What the model calls once per layer per step.

    ``write_kv`` stores this step's keys/values (``k, v: [T, Hkv, D]``) at ``slot_mapping`` (``[T]``
    int64, ``-1`` = padding, skipped). ``forward`` computes causal attention of ``q: [T, Hq, D]`` over
    everything cached for each sequence (context + this step's tokens, already written) and returns
    ``[T, Hq, D]`` in ``q``'s dtype. ``meta.tree_mask`` (``[T, max_query_len]`` bool), when given,
    further restricts which of the *same step's* tokens a query may see (EAGLE token trees); the
    cached context is always fully visible. A backend with ``sliding_window`` takes ``window=W`` in
    ``forward`` (a sliding layer): a query at position ``p`` then sees keys at positions ``p - W < k <= p``
    (transformers' sliding_window_overlay); without the keyword, or with None, every earlier key.
    """

    name: str    # also the backend's kind in the kernel table (plugins/registry.py)
    # Members with a default (backends subclass this protocol, so callers read them, never probe):
    # the bundle's ahead-of-time kernels the backend launches (``plugins.launcher.KernelSet``); None: JIT
    aot: Any = None
    # whether an fp8 KV cache may be held as its scaled values in the compute dtype (``fp8_as_float``,
    # set by backend/runtime/kv_plan.py: on a CPU, where PyTorch has no fast fp8 conversion)
    holds_fp8_as_float: bool = False
    # whether forward honours ``window=`` (the runner refuses a window that binds on a backend without it)
    sliding_window: bool = False
    # whether the sliding layers may read a block table of their own (``meta.window``: their KV pool,
    # backend/engine/kv_groups.py), whose entries behind the window name blocks given back: the
    # backend must never read keys outside the window through it
    window_tables: bool = False
    fp8_as_float: bool = False

    def write_kv(self, k: "torch.Tensor", v: "torch.Tensor", k_cache: "torch.Tensor",
                 v_cache: "torch.Tensor", slot_mapping: "torch.Tensor",
                 k_scale: "torch.Tensor | None", v_scale: "torch.Tensor | None") -> None: ...

    def forward(self, q: "torch.Tensor", k_cache: "torch.Tensor", v_cache: "torch.Tensor",
                meta: "AttentionMetadata", scale: float, k_scale: "torch.Tensor | None",
                v_scale: "torch.Tensor | None") -> "torch.Tensor": ...

    def load_aot(self, bundle_dir, kernel_entries: list[dict], device) -> None:
        """Launch the bundle's AOT kernels (engine.json "kernels") from now on; a backend that launches
        none keeps its own."""
        return None


# name -> "module:Class"
ATTENTION_BACKENDS: dict[str, str] = {
    "torch": "backend.ops.attention.torch_backend:TorchAttentionBackend",
    "triton": "backend.ops.attention.triton_backend:TritonAttentionBackend",
}


def resolve_backend_name(name: str, device: str) -> str:
    """``auto`` means Triton kernels on a GPU and the PyTorch reference on CPU."""
    if name == "auto":
        return "triton" if str(device).startswith("cuda") else "torch"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"engine.attention_backend: unknown backend {name!r}; "
                         f"allowed: auto, {', '.join(sorted(ATTENTION_BACKENDS))}")
    return name


def get_backend(name: str, device: str = "cpu") -> AttentionBackend:
    """Instantiate the backend registered under ``name`` (``auto`` resolved for ``device``)."""
    requested = name
    name = resolve_backend_name(name, device)
    module_name, _, cls_name = ATTENTION_BACKENDS[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if requested == "auto" and name != "torch":
            # auto promises a working backend; the reference one runs everywhere.
            return get_backend("torch", device)
        raise ValueError(f"engine.attention_backend: backend {name!r} is not available here "
                         f"({exc}); allowed on this machine: torch") from exc
    return getattr(module, cls_name)()


__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "get_backend", "resolve_backend_name"]
