"""The MoE align step: token slots sorted by expert and padded per expert to a multiple of the GEMM's
row block, so each block of plugins/fused_moe.py's grouped GEMM reads one expert's weights.

Torch ops, not a Triton kernel (yet): a handful of small launches (scatter-add, cumsum, a stable sort,
searchsorted, a scatter) over T * k integers, none of which reads the device back, so a decode step
stays capturable and never waits on the host. A fused Triton version (vLLM's moe_align_block_size is one
kernel) is worth it only once a GPU profile shows these launches next to the GEMMs.
Reference: plugins/reference/moe.py (align_ref).
"""
from __future__ import annotations

import torch


def max_padded(num_slots: int, num_experts: int, block: int) -> int:
    """An upper bound of the padded count, known on the host without reading the routing: each expert
    adds at most block - 1 padding slots, and no more than num_slots experts have any slot (at worst each
    slot alone in a block). The grid is sized by it; blocks past the true count return at once."""
    bound = min(num_slots * block, num_slots + num_experts * (block - 1))
    return -(-bound // block) * block


def moe_align(topk_ids: torch.Tensor, num_experts: int, block: int):
    """topk_ids int [T, k] -> (sorted_ids int32 [max_padded]: slot ids t * k + j grouped by expert in slot
    order, padding and the tail past the padded count = T * k; expert_ids int32 [max_padded / block]: the
    expert of each block (E - 1 past the count: never read); num_padded int32 [1]: the padded count, on
    the device). align_ref gives the same first num_padded / num_padded / block entries."""
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    size = max_padded(n, num_experts, block)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block - 1) // block * block
    end_padded = torch.cumsum(padded, 0)
    start_padded = end_padded - padded
    start = torch.cumsum(counts, 0) - counts
    order = torch.sort(flat, stable=True).indices          # slots by expert, slot order kept within one
    by_expert = flat[order]
    dest = start_padded[by_expert] + torch.arange(n, device=dev) - start[by_expert]
    sorted_ids = torch.full((size,), n, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, size, block, device=dev)
    expert_ids = torch.searchsorted(end_padded, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, expert_ids.to(torch.int32), end_padded[-1:].to(torch.int32)
