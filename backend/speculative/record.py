"""Recording the target's hidden states while the engine generates: the training data of an
EAGLE-3 draft, from the same runtime (device, compute dtype, kernels, quantized weights) that will
serve the bundle.

``HiddenRecorder`` sits in the executor's ``Speculator`` seam and proposes nothing: each step the
executor hands ``propose`` the outputs of the layers in ``capture_hidden_layers`` for every token
of the step (prompt chunks and decode tokens alike), which is exactly what the EAGLE speculator
reads. The recorder copies each request's rows to the host (bf16, the draft's training storage)
at the rows' absolute positions, so a prompt split over several chunks, or a request preempted and
recomputed, still ends with one row per position. The last sampled token of a request never runs
through the target (nothing is generated after it), so a request of ``n`` tokens ends with ``n - 1``
rows: the rows for positions ``0 .. n-2``.
"""
from __future__ import annotations

from typing import Callable

import torch

from backend.engine.speculator_seam import Speculator


class HiddenRecorder(Speculator):
    """Per request id, the outputs of ``layers`` (concatenated in that order, ``[n, len(layers) * H]``,
    bf16 on the host) at every position the target ran. Requests must be announced with
    ``expect(request_id, max_len)`` before their first step (the buffer's size)."""

    def __init__(self, layers: tuple[int, ...], hidden_size: int, dtype: torch.dtype = torch.bfloat16,
                 transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """``transform``: applied to each step's rows on the device, in the compute dtype, before they
        are rounded to ``dtype`` (e.g. the target's final norm on the last layer's columns)."""
        assert len(set(layers)) == len(layers), layers
        self.capture_hidden_layers = tuple(layers)
        self.width = len(layers) * hidden_size
        self.dtype = dtype
        self.transform = transform
        self._max_len: dict[str, int] = {}
        self._rows: dict[str, torch.Tensor] = {}
        self._filled: dict[str, int] = {}     # highest position written + 1

    def expect(self, request_id: str, max_len: int) -> None:
        self._max_len[request_id] = max_len

    def take(self, request_id: str) -> torch.Tensor:
        """The rows of a finished request (positions ``0 .. n-1`` that ran), removed from the recorder."""
        del self._max_len[request_id]
        rows = self._rows.pop(request_id)
        return rows[:self._filled.pop(request_id)]

    # -- the executor seam (backend/engine/speculator_seam.py ``Speculator``) ----------------------------
    def prepare(self, out, inputs) -> None:
        pass

    def verify(self, out, logits, rows, sampler):
        raise AssertionError("HiddenRecorder proposes no drafts, so no step has any to verify")

    def propose(self, out, inputs, captured: dict[int, torch.Tensor], finished) -> None:
        qsl = inputs.meta.query_start_loc.tolist()
        picks, where = [], []
        for i, s in enumerate(out.scheduled):
            rid = s.request.request_id
            if rid not in self._max_len or not s.num_new_tokens:
                continue
            if rid not in self._rows:   # allocated at its first step: queued requests hold nothing
                self._rows[rid] = torch.zeros(self._max_len[rid], self.width, dtype=self.dtype)
                self._filled[rid] = 0
            picks.append(torch.arange(qsl[i], qsl[i] + s.num_new_tokens))
            where.append((rid, s.start_pos, s.num_new_tokens))
        if not picks:
            return
        # One gather and one device->host copy per step (a CUDA graph's output buffers are
        # overwritten by the next replay, so the rows are copied out now).
        idx = torch.cat(picks).to(captured[self.capture_hidden_layers[0]].device)
        step = torch.cat([captured[i].index_select(0, idx) for i in self.capture_hidden_layers], -1)
        if self.transform is not None:
            step = self.transform(step)
        step = step.to("cpu", self.dtype)
        off = 0
        for rid, start, n in where:
            buf = self._rows[rid]
            assert start + n <= buf.shape[0], (rid, start, n, buf.shape)
            buf[start:start + n] = step[off:off + n]
            self._filled[rid] = max(self._filled[rid], start + n)
            off += n


__all__ = ["HiddenRecorder"]
