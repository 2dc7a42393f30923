"""Per-step attention metadata: built once per step by ``backend/engine/inputs.py``, read by every layer.

Sequences are ordered prefills first, then decodes (and speculative verifications, which are
decode-like: a few query tokens per sequence). Shapes: ``T`` = tokens of this step, ``B`` = sequences.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: constructing metadata needs the tensors anyway
    import torch


@dataclass
class AttentionMetadata:
    positions: "torch.Tensor"        # [T] int64 position of each token in its sequence
    slot_mapping: "torch.Tensor"     # [T] int64 flat KV slot (block_id * block_size + offset); -1 = skip
    block_tables: "torch.Tensor"     # [B, max_blocks] int32, padded with 0
    seq_lens: "torch.Tensor"         # [B] int32 tokens in cache after this step (context + new)
    query_start_loc: "torch.Tensor"  # [B+1] int32 cumulative query lengths (tokens of this step)
    context_lens: "torch.Tensor"     # [B] int32 tokens already cached before this step
    num_prefills: int
    num_prefill_tokens: int
    num_decode_tokens: int
    max_query_len: int
    max_seq_len: int
    # [T, max_query_len] bool: which of the same step's tokens a query may see (EAGLE token trees).
    tree_mask: "torch.Tensor | None" = None
    # The sliding layers' own metadata when they have a KV pool of their own (backend/engine/kv_groups.py):
    # the same step with their block tables and slots; None: every layer reads this one.
    window: "AttentionMetadata | None" = None

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_decodes(self) -> int:
        return self.num_seqs - self.num_prefills

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


__all__ = ["AttentionMetadata"]
