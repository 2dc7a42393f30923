"""Step input preparation: ``SchedulerOutput`` -> flat ``input_ids``, ``AttentionMetadata`` and the
rows to compute logits for. This is the hot path of host overhead, so:

- per-sequence work is Python, per-token work is numpy (positions, slot mapping), never a Python
  loop over tokens;
- block tables are kept in a persistent numpy array with one row per live request, updated
  incrementally (a decode step usually appends nothing; a new block appends one entry), and the
  step's table is one fancy-indexing gather;
- every integer array of one dtype goes to the device in ONE copy (int64: ids, positions, slots,
  logits rows; int32: block tables, lengths, offsets), then views are sliced out of it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from backend.attention.metadata import AttentionMetadata
from backend.scheduler import ScheduledSeq, SchedulerOutput


@dataclass
class StepInputs:
    input_ids: torch.Tensor          # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor     # [L] int64 rows of the step's hidden states to compute logits on
    sample_seqs: list[ScheduledSeq]  # sequences that sample, in logits order
    # Logits rows per sampling sequence (1 + its draft tokens); None when every count is 1.
    logits_counts: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


class InputPreparer:
    """Builds one step's inputs. One instance per executor (it caches block-table rows)."""

    def __init__(self, block_size: int, max_blocks_per_seq: int, device: str | torch.device = "cpu",
                 initial_rows: int = 64) -> None:
        assert block_size > 0 and max_blocks_per_seq > 0
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = torch.device(device)
        self._bt = np.zeros((initial_rows, max_blocks_per_seq), dtype=np.int32)
        self._row_of: dict[str, int] = {}
        self._free_rows: list[int] = list(range(initial_rows - 1, -1, -1))
        # Per row: the block list object last copied (identity changes when the BlockManager frees
        # the request) and how many of its entries are in the row.
        self._row_src: list[list[int] | None] = [None] * initial_rows
        self._row_len: list[int] = [0] * initial_rows
        # Pinned staging buffers (GPU only), two of each so a step's asynchronous copy can still be
        # in flight while the next step is prepared.
        self._pinned = self.device.type == "cuda"
        self._staging: dict[tuple[torch.dtype, int], torch.Tensor] = {}
        self._flip = 0

    @property
    def num_rows_in_use(self) -> int:
        return len(self._row_of)

    def release(self, request_id: str) -> None:
        row = self._row_of.pop(request_id, None)
        if row is not None:
            self._bt[row, :self._row_len[row]] = 0
            self._row_src[row] = None
            self._row_len[row] = 0
            self._free_rows.append(row)

    def _grow(self) -> None:
        old = self._bt.shape[0]
        new = old * 2
        bt = np.zeros((new, self.max_blocks_per_seq), dtype=np.int32)
        bt[:old] = self._bt
        self._bt = bt
        self._row_src.extend([None] * (new - old))
        self._row_len.extend([0] * (new - old))
        self._free_rows.extend(range(new - 1, old - 1, -1))

    def _row(self, rid: str, blocks: list[int]) -> int:
        """The request's row in the persistent block table, brought up to date."""
        row = self._row_of.get(rid)
        if row is None:
            if not self._free_rows:
                self._grow()
            row = self._free_rows.pop()
            self._row_of[rid] = row
        n = len(blocks)
        old = self._row_len[row]
        if self._row_src[row] is not blocks:
            if n > self.max_blocks_per_seq:
                raise ValueError(f"request {rid!r} holds {n} KV blocks; the block table has room for "
                                 f"{self.max_blocks_per_seq} (max_seq_len / kv_block_size)")
            bt = self._bt[row]
            bt[:n] = blocks
            if old > n:
                bt[n:old] = 0
            self._row_src[row] = blocks
            self._row_len[row] = n
        elif n != old:
            # Same list object: the BlockManager only appended to it (shrinking makes a new list).
            assert n > old, f"block table of {rid!r} shrank in place"
            if n > self.max_blocks_per_seq:
                raise ValueError(f"request {rid!r} holds {n} KV blocks; the block table has "
                                 f"room for {self.max_blocks_per_seq}")
            self._bt[row, old:n] = blocks[old:]
            self._row_len[row] = n
        return row

    def prepare(self, output: SchedulerOutput) -> StepInputs:
        for rid in output.finished_request_ids:
            self.release(rid)
        seqs = output.scheduled
        assert seqs, "nothing scheduled"
        nseq = len(seqs)
        rows = [0] * nseq
        starts = [0] * nseq
        counts = [0] * nseq
        ids: list[int] = []
        sample_seqs: list[ScheduledSeq] = []
        logits_counts: list[int] = []
        any_spec = False
        row_fn = self._row
        for i, s in enumerate(seqs):
            req = s.request
            rows[i] = row_fn(req.request_id, req.block_ids)
            start = s.start_pos
            n = s.num_new_tokens
            starts[i] = start
            counts[i] = n
            toks = req.all_token_ids
            k = s.num_spec_tokens
            if n == 1:
                ids.append(toks[start])
            elif k:
                ids.append(toks[start])
                ids.extend(req.spec_token_ids[:k])
                any_spec = True
            else:
                ids.extend(toks[start:start + n])
            if s.sample:
                sample_seqs.append(s)
                logits_counts.append(1 + k)

        bs = self.block_size
        counts_np = np.array(counts, dtype=np.int64)
        starts_np = np.array(starts, dtype=np.int64)
        rows_np = np.array(rows, dtype=np.int64)
        qsl = np.zeros(nseq + 1, dtype=np.int64)
        np.cumsum(counts_np, out=qsl[1:])
        num_tokens = int(qsl[-1])
        seq_lens = starts_np + counts_np
        max_seq_len = int(seq_lens.max())
        if num_tokens == nseq:           # all one-token queries (decodes): no repeat needed
            positions = starts_np
            token_rows = rows_np
        else:
            positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(qsl[:-1] - starts_np,
                                                                           counts_np)
            token_rows = np.repeat(rows_np, counts_np)
        bt = self._bt
        slots = bt[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        width = -(-max_seq_len // bs)
        block_tables = bt[rows_np, :width]

        ends = qsl[1:]
        if not any_spec and len(sample_seqs) == nseq:
            logits_idx = ends - 1
        elif not any_spec:
            logits_idx = np.array([int(ends[i]) - 1 for i, s in enumerate(seqs) if s.sample],
                                  dtype=np.int64)
        else:
            idx: list[int] = []
            for i, s in enumerate(seqs):
                if s.sample:
                    e = int(ends[i])
                    idx.extend(range(e - 1 - s.num_spec_tokens, e))
            logits_idx = np.array(idx, dtype=np.int64)

        ids_np = np.array(ids, dtype=np.int64)
        i64 = self._to_device([ids_np, positions, slots, logits_idx], np.int64, torch.int64)
        i32 = self._to_device([block_tables.reshape(-1), seq_lens, qsl, starts_np], np.int32,
                              torch.int32)
        t_ids, t_pos, t_slots, t_logits = i64
        t_bt, t_seq_lens, t_qsl, t_ctx = i32
        num_prefills = output.num_prefills
        num_prefill_tokens = int(qsl[num_prefills])
        meta = AttentionMetadata(
            positions=t_pos, slot_mapping=t_slots, block_tables=t_bt.view(nseq, width),
            seq_lens=t_seq_lens, query_start_loc=t_qsl, context_lens=t_ctx,
            num_prefills=num_prefills, num_prefill_tokens=num_prefill_tokens,
            num_decode_tokens=num_tokens - num_prefill_tokens,
            max_query_len=int(counts_np.max()), max_seq_len=max_seq_len)
        self._flip ^= 1
        return StepInputs(t_ids, meta, t_logits, sample_seqs, logits_counts if any_spec else None)

    def _to_device(self, arrays: list[np.ndarray], np_dtype, torch_dtype) -> list[torch.Tensor]:
        """Concatenate ``arrays`` into one buffer, move it in one copy, return views."""
        sizes = [a.size for a in arrays]
        total = sum(sizes)
        if self._pinned:
            key = (torch_dtype, self._flip)
            buf = self._staging.get(key)
            if buf is None or buf.numel() < total:
                buf = torch.empty(max(total, 4096) * 2, dtype=torch_dtype, pin_memory=True)
                self._staging[key] = buf
            host = buf[:total]
            np.concatenate(arrays, out=host.numpy(), casting="unsafe")
            dev = host.to(self.device, non_blocking=True)
        else:
            dev = torch.from_numpy(np.concatenate(arrays).astype(np_dtype, copy=False))
        out = []
        off = 0
        for n in sizes:
            out.append(dev[off:off + n])
            off += n
        return out


__all__ = ["InputPreparer", "StepInputs"]
