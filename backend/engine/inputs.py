"""Step input preparation: ``SchedulerOutput`` -> flat ``input_ids``, ``AttentionMetadata`` and the
rows to compute logits for. This is the hot path of host overhead, so:

- per-sequence work is Python, per-token work is numpy (positions, slot mapping), never a Python
  loop over tokens;
- block tables are kept in a persistent numpy array with one row per live request, updated
  incrementally (a decode step usually appends nothing; a new block appends one entry), and the
  step's table is one fancy-indexing gather;
- every integer array of one dtype goes to the device in ONE copy (int64: ids, positions, slots,
  logits rows; int32: block tables, lengths, offsets), then views are sliced out of it.

Overlapped loop (``backend/engine/overlap.py``): a decode row whose input is the previous step's
token, not known on the host yet (``late_tokens.PLACEHOLDER`` in ``all_token_ids``), gets it on the
device: ``prepare(output, late)`` returns where those rows are (``late_dst``) and which of the
previous step's samples each one takes (``late_src``), shipped in the same int64 copy. In the steady
decode state (the same sequences as the last step, all of which sampled) that map is the identity,
known without reading a token or looking a request up.
"""
from __future__ import annotations

import dataclasses
import operator
from array import array
from dataclasses import dataclass

import numpy as np
import torch

from backend.ops.attention.metadata import AttentionMetadata
from backend.engine.kv_cache import BlockManager
from backend.engine.late_tokens import PLACEHOLDER, LateRows
from backend.engine.logits_out import context_rows
from backend.engine.scheduler import ScheduledSeq, SchedulerOutput


@dataclass
class StepInputs:
    input_ids: torch.Tensor          # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor     # [L] int64 rows of the step's hidden states to compute logits on
    sample_seqs: list[ScheduledSeq]  # sequences that sample, in logits order
    # Logits rows per sampling sequence (1 + its draft tokens); None when every count is 1.
    logits_counts: list[int] | None = None
    # Overlapped loop: input_ids[late_dst] must be set to previous_samples[late_src] on the device.
    late_dst: torch.Tensor | None = None
    late_src: torch.Tensor | None = None
    # Context logits (``SamplingParams.return_context_logits``): (request, first prompt position,
    # count) per prefill chunk that asks; their rows follow the sampling rows in ``logits_indices``.
    context: list | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


class _Table:
    """A persistent block table: one row per live request, ``src``/``lens`` saying what each row
    holds. The full layers' one, and the sliding layers' when they have their own pool
    (backend/engine/kv_groups.py), in the same rows."""

    def __init__(self, rows: int, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self.bt = np.zeros((rows, max_blocks), dtype=np.int32)
        self.src: list[list[int] | None] = [None] * rows
        self.lens: list[int] = [0] * rows

    def clear(self, row: int) -> None:
        self.bt[row, :self.lens[row]] = 0
        self.src[row], self.lens[row] = None, 0

    def grow(self, rows: int) -> None:
        old = self.bt.shape[0]
        bt = np.zeros((rows, self.max_blocks), dtype=np.int32)
        bt[:old] = self.bt
        self.bt = bt
        self.src.extend([None] * (rows - old))
        self.lens.extend([0] * (rows - old))

    def update(self, row: int, rid: str, blocks: list[int]) -> None:
        """Bring ``row`` up to date with ``blocks``: the list object last copied is kept, since the
        BlockManager changes its identity whenever it does more than append."""
        n = len(blocks)
        old = self.lens[row]
        if self.src[row] is not blocks:
            if n > self.max_blocks:
                raise ValueError(f"request {rid!r} holds {n} KV blocks; the block table has room for "
                                 f"{self.max_blocks} (max_seq_len / kv_block_size)")
            r = self.bt[row]
            r[:n] = blocks
            if old > n:
                r[n:old] = 0
            self.src[row] = blocks
            self.lens[row] = n
        elif n != old:
            # Same list object: the BlockManager only appended to it (shrinking makes a new list).
            assert n > old, f"block table of {rid!r} shrank in place"
            if n > self.max_blocks:
                raise ValueError(f"request {rid!r} holds {n} KV blocks; the block table has room for {self.max_blocks}")
            self.bt[row, old:n] = blocks[old:]
            self.lens[row] = n


class InputPreparer:
    """Builds one step's inputs. One instance per executor (it caches block-table rows)."""

    def __init__(self, block_size: int, max_blocks_per_seq: int, device: str | torch.device = "cpu",
                 initial_rows: int = 64, block_manager: BlockManager | None = None) -> None:
        """With ``block_manager`` (recommended; it must be the scheduler's), rows are refreshed from
        its ``block_table_changes`` log; without it every sequence's row is checked every step."""
        assert block_size > 0 and max_blocks_per_seq > 0
        assert block_manager is None or block_manager.block_size == block_size
        self.block_manager = block_manager
        if block_manager is not None:
            block_manager.track_block_table_changes()
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = torch.device(device)
        self._table = _Table(initial_rows, max_blocks_per_seq)
        self._row_of: dict[str, int] = {}
        self._free_rows: list[int] = list(range(initial_rows - 1, -1, -1))
        # The last step's decode sequences and their rows (reused while the batch is unchanged).
        self._prev_decodes: list[ScheduledSeq] | None = None
        self._prev_rows: np.ndarray | None = None
        # The sliding layers' own pool (backend/engine/kv_groups.py): a second table, same rows.
        self.window_pool = block_manager.window_pool if block_manager is not None else None
        self._window = _Table(initial_rows, max_blocks_per_seq) if self.window_pool is not None else None
        # Off-CPU devices: pack each dtype group into one staging buffer (pinned when CUDA is
        # there), two of each so a step's asynchronous copy can still be in flight while the next
        # step is prepared.
        self._pack = self.device.type != "cpu"
        self._pin = self._pack and torch.cuda.is_available()
        self._staging: dict[tuple[torch.dtype, int], torch.Tensor] = {}
        self._flip = 0

    @property
    def num_rows_in_use(self) -> int:
        return len(self._row_of)

    @property
    def _bt(self) -> np.ndarray:
        return self._table.bt

    def release(self, request_id: str) -> None:
        row = self._row_of.pop(request_id, None)
        if row is not None:
            self._table.clear(row)
            self._free_rows.append(row)
            if self._window is not None:
                self._window.clear(row)

    def _grow(self) -> None:
        old = self._table.bt.shape[0]
        self._table.grow(2 * old)
        if self._window is not None:
            self._window.grow(2 * old)
        self._free_rows.extend(range(2 * old - 1, old - 1, -1))

    def _row(self, rid: str, blocks: list[int]) -> int:
        """The request's row in the persistent block table, brought up to date."""
        row = self._row_of.get(rid)
        if row is None:
            if not self._free_rows:
                self._grow()
            row = self._free_rows.pop()
            self._row_of[rid] = row
        self._table.update(row, rid, blocks)
        return row

    def _rows_checked(self, seqs: list[ScheduledSeq]) -> list[int]:
        """Each sequence's row, refreshed when its block list object or length changed."""
        row_of, row_src, row_len = self._row_of, self._table.src, self._table.lens
        rows: list[int] = []
        rows_append = rows.append
        for s in seqs:
            req = s.request
            blocks = req.block_ids
            row = row_of.get(req.request_id)
            if row is None or row_src[row] is not blocks or row_len[row] != len(blocks):
                row = self._row(req.request_id, blocks)
            rows_append(row)
        return rows

    def prepare(self, output: SchedulerOutput, late: LateRows | None = None) -> StepInputs:
        """``late``: the previous step's rows whose sampled token is still a placeholder (overlapped
        loop): which requests, and the row of that step's samples each one takes; None when every
        input token is known."""
        for rid in output.finished_request_ids:
            self.release(rid)
        seqs = output.scheduled
        assert seqs, "nothing scheduled"
        nseq = len(seqs)
        num_prefills = output.num_prefills
        any_spec = output.num_spec_tokens > 0

        # Per sequence (Python): block-table rows, brought up to date only when they changed.
        row_of = self._row_of
        bm = self.block_manager
        decodes = seqs[num_prefills:] if num_prefills else seqs
        rows_np = None
        same_decodes = False
        if bm is not None:
            changes = bm.block_table_changes
            if changes:
                for req in changes:
                    if not req.is_finished:      # finished ones were released above
                        self._row(req.request_id, req.block_ids)
                changes.clear()
            # A decode-only step running the same sequences as the last one (the scheduler
            # refreshes one ScheduledSeq per request in place) has the same rows: their contents
            # were brought up to date just above.
            prev = self._prev_decodes
            if (not num_prefills and prev is not None and len(prev) == nseq
                    and all(map(operator.is_, prev, seqs))):
                rows_np = self._prev_rows
                same_decodes = True
            else:
                try:
                    rows = [row_of[s.request.request_id] for s in seqs]
                except KeyError:                 # a request this preparer never saw: check all
                    rows = self._rows_checked(seqs)
        else:
            rows = self._rows_checked(seqs)
        if rows_np is None:
            # array() + frombuffer: the fastest list -> ndarray conversion for Python ints.
            rows_np = np.frombuffer(array("q", rows), dtype=np.int64)
        if bm is not None:
            self._prev_decodes = decodes
            self._prev_rows = rows_np[num_prefills:] if num_prefills else rows_np
        starts = [s.start_pos for s in seqs]
        uniform = not num_prefills and not any_spec      # every query is one token
        counts = None if uniform else [s.num_new_tokens for s in seqs]
        # Overlapped loop, steady decode: the same sequences as the last step (whose decodes these
        # are), all of which sampled (a range of rows, as many as there are sequences: no prefill
        # sampled then either), so each input token is its own sample of the last step, still a
        # placeholder in all_token_ids: not read, taken on the device from row k for row k.
        steady_late = (late is not None and same_decodes and uniform and isinstance(late.index, range)
                       and len(late.requests) == nseq)
        ids: list[int] = []
        for s in seqs[:num_prefills]:
            ids.extend(s.request.all_token_ids[s.start_pos:s.start_pos + s.num_new_tokens])
        if steady_late:
            assert late.requests[0] is seqs[0].request and late.requests[-1] is seqs[-1].request, \
                "late rows that are not the last step's"
        elif any_spec:
            for s in decodes:
                ids.append(s.request.all_token_ids[s.start_pos])
                if s.num_spec_tokens:
                    ids.extend(s.request.spec_token_ids[:s.num_spec_tokens])
        else:
            ids += [s.request.all_token_ids[s.start_pos] for s in decodes]
        prefill_samples = [s.sample for s in seqs[:num_prefills]]
        all_sample = all(prefill_samples)
        sample_seqs = decodes if all_sample and not num_prefills else (
            [s for s in seqs[:num_prefills] if s.sample] + decodes)

        # Per token (numpy).
        bs = self.block_size
        starts_np = np.frombuffer(array("q", starts), dtype=np.int64)
        if uniform:
            qsl = np.arange(nseq + 1, dtype=np.int64)
            num_tokens = nseq
            seq_lens = starts_np + 1
        else:
            counts_np = np.frombuffer(array("q", counts), dtype=np.int64)
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
        window = self._window_inputs(seqs, rows_np, token_rows, positions, width) if self._window is not None else None

        logits_counts = None
        if any_spec:
            idx: list[int] = []
            ends = qsl[1:].tolist()
            for i, s in enumerate(seqs):
                if s.sample:
                    e = ends[i]
                    idx.extend(range(e - 1 - s.num_spec_tokens, e))
            logits_idx = np.array(idx, dtype=np.int64)
            logits_counts = [1 + s.num_spec_tokens for s in sample_seqs]
        elif all_sample:
            logits_idx = qsl[1:] - 1
        else:
            keep = np.ones(nseq, dtype=bool)
            keep[:num_prefills] = prefill_samples
            logits_idx = (qsl[1:] - 1)[keep]

        context = context_rows(seqs[:num_prefills], qsl) if num_prefills else None
        if context is not None:
            context, ctx_idx = context
            logits_idx = np.concatenate([logits_idx, ctx_idx])

        if steady_late:
            late_rows = np.arange(nseq, dtype=np.int64)
            groups = [np.full(nseq, PLACEHOLDER, dtype=np.int64), positions, slots, logits_idx,
                      late_rows, late_rows]
        else:
            ids_np = np.frombuffer(array("q", ids), dtype=np.int64)
            groups = [ids_np, positions, slots, logits_idx]
            if late is not None:
                groups += self._late_tokens(seqs, ids_np, qsl, late)
        i64 = self._to_device(groups, np.int64, torch.int64)
        late_dst = late_src = None
        if len(i64) > 4:
            late_dst, late_src = i64[4:]
        i32 = self._to_device([block_tables.reshape(-1), seq_lens, qsl, starts_np], np.int32,
                              torch.int32)
        t_ids, t_pos, t_slots, t_logits = i64[:4]
        t_bt, t_seq_lens, t_qsl, t_ctx = i32
        num_prefill_tokens = int(qsl[num_prefills])
        meta = AttentionMetadata(
            positions=t_pos, slot_mapping=t_slots, block_tables=t_bt.view(nseq, width),
            seq_lens=t_seq_lens, query_start_loc=t_qsl, context_lens=t_ctx,
            num_prefills=num_prefills, num_prefill_tokens=num_prefill_tokens,
            num_decode_tokens=num_tokens - num_prefill_tokens,
            max_query_len=1 if uniform else int(counts_np.max()), max_seq_len=max_seq_len)
        if window is not None:
            w_slots, w_tables = window
            meta.window = dataclasses.replace(meta, slot_mapping=w_slots, block_tables=w_tables.view(nseq, width))
        self._flip ^= 1
        return StepInputs(t_ids, meta, t_logits, sample_seqs, logits_counts, late_dst, late_src, context)

    def _window_inputs(self, seqs: list[ScheduledSeq], rows: np.ndarray, token_rows: np.ndarray,
                       positions: np.ndarray, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The sliding layers' slots and block tables (their own pool), in the same rows: each
        sequence's row refreshed from its ``window_kv`` block list when that changed."""
        table = self._window
        for s, row in zip(seqs, rows.tolist()):
            req = s.request
            table.update(row, req.request_id, req.window_kv.block_ids)
        bs = self.block_size
        slots = table.bt[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        tables = table.bt[rows, :width].reshape(-1)
        # (a plain copy off the CPU: the staging buffers hold the step's other arrays, maybe in flight)
        return torch.from_numpy(slots).to(self.device), torch.from_numpy(tables).to(self.device)

    @staticmethod
    def _late_tokens(seqs: list[ScheduledSeq], ids: np.ndarray, qsl: np.ndarray, late: LateRows
                     ) -> list[np.ndarray]:
        """[dst, src]: the rows of ``ids`` that are placeholders, and the previous step's sample row
        each takes ([] when none is)."""
        dst = np.flatnonzero(ids < 0)
        if not dst.size:
            return []
        row_of = dict(zip(late.requests, late.index))
        seq_of = np.searchsorted(qsl, dst, side="right") - 1
        try:
            src = [row_of[seqs[i].request] for i in seq_of.tolist()]
        except KeyError as exc:
            raise AssertionError(f"input token of {exc} unknown and not sampled last step") from None
        return [dst, np.array(src, dtype=np.int64)]

    def _to_device(self, arrays: list[np.ndarray], np_dtype, torch_dtype) -> list[torch.Tensor]:
        """GPU: concatenate ``arrays`` into one pinned buffer, copy it in one transfer, return
        views. CPU: wrap each array without copying (a concatenation would only cost time)."""
        if not self._pack:
            return [torch.from_numpy(a if a.dtype == np_dtype else a.astype(np_dtype))
                    for a in arrays]
        sizes = [a.size for a in arrays]
        total = sum(sizes)
        key = (torch_dtype, self._flip)
        buf = self._staging.get(key)
        if buf is None or buf.numel() < total:
            buf = torch.empty(max(total, 4096) * 2, dtype=torch_dtype, pin_memory=self._pin)
            self._staging[key] = buf
        host = buf[:total]
        np.concatenate(arrays, out=host.numpy(), casting="unsafe")
        dev = host.to(self.device, non_blocking=self._pin)
        if dev.data_ptr() == host.data_ptr():
            dev = dev.clone()            # same device: never hand out views of the staging buffer
        out = []
        off = 0
        for n in sizes:
            out.append(dev[off:off + n])
            off += n
        return out


__all__ = ["InputPreparer", "StepInputs"]
