"""Reference: a mixture-of-experts MLP (SwiGLU experts) on routing the model has already done, and the
alignment of token slots to expert blocks that plugins/fused_moe.py runs on.

Layouts (what the kernels read):
- x [T, H]; topk_ids int [T, k] (expert of each of a token's k slots); topk_weights [T, k] (their weights,
  already normalised or not: the model's routing decides, these only multiply).
- gate_up [E, 2I, H]: per expert the gate projection's I rows first, then the up projection's I rows
  (a checkpoint's separate gate_proj / up_proj stacked in that order, like a dense layer's fused gate_up).
- down [E, H, I].
- A token slot is s = t * k + j (token t, its j-th choice): the row of the [T*k, ...] intermediates.
out[t] = sum_j w[t, j] * down_e(silu(gate_e x_t) * up_e x_t), e = topk_ids[t, j].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_ref(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up: torch.Tensor,
            down: torch.Tensor, gate_up_scale: torch.Tensor | None = None,
            down_scale: torch.Tensor | None = None) -> torch.Tensor:
    """-> [T, H] in x.dtype. fp32 math; silu(gate) * up is rounded to x.dtype (the kernel's intermediate
    is stored in it, as a dense layer's activation is). gate_up_scale / down_scale: fp32 [E] per-expert
    per-tensor scales of float8_e4m3fn weights (value = code * scale); None for 16/32-bit weights."""
    T, H = x.shape
    inter = gate_up.shape[1] // 2
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in torch.unique(topk_ids).tolist():
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        wgu = gate_up[e].float() * (1.0 if gate_up_scale is None else gate_up_scale[e].float())
        wd = down[e].float() * (1.0 if down_scale is None else down_scale[e].float())
        gu = xf[tok] @ wgu.t()
        h = (F.silu(gu[:, :inter]) * gu[:, inter:]).to(x.dtype).float()
        y = (h @ wd.t()) * topk_weights[tok, slot].float()[:, None]
        out.index_add_(0, tok, y)
    return out.to(x.dtype)


def align_ref(topk_ids: torch.Tensor, num_experts: int, block: int):
    """Token slots grouped by expert, each expert's group padded to a multiple of `block`, so one block
    of the grouped GEMM reads one expert's weights.
    -> (sorted_ids int32 [P]: slot ids (t * k + j), in slot order within an expert, padding = T * k;
        expert_ids int32 [P / block]: the expert of each block; P: the padded count, sum over experts of
        ceil(count_e / block) * block; an expert with no slot has no block)."""
    flat = topk_ids.reshape(-1).tolist()
    sentinel = len(flat)
    sorted_ids: list[int] = []
    expert_ids: list[int] = []
    for e in range(num_experts):
        slots = [s for s, x in enumerate(flat) if x == e]
        if not slots:
            continue
        nblocks = -(-len(slots) // block)
        sorted_ids += slots + [sentinel] * (nblocks * block - len(slots))
        expert_ids += [e] * nblocks
    dev = topk_ids.device
    return (torch.tensor(sorted_ids, dtype=torch.int32, device=dev),
            torch.tensor(expert_ids, dtype=torch.int32, device=dev), len(sorted_ids))
