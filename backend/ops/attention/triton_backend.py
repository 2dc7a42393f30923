"""Attention backend on the project's own Triton kernels (plugins/): registry key "triton".

Same interface and semantics as ``backend.ops.attention.torch_backend.TorchAttentionBackend`` (see
``backend.ops.attention.AttentionBackend``). Per step it launches at most two attention kernels per layer:
the varlen paged-prefill kernel for prefill rows (and for speculative token trees or long queries), and
the split-K paged-decode kernel for one-token decode rows and for the rows of verify passes of chains.

On CPU the kernels only run under Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is
imported): slow, meant for tests.
"""
from __future__ import annotations

import os

import torch

from backend.ops.attention import AttentionBackend
from plugins import registry

# This backend's kernels: the table's triton rows
_quantize_fp8 = registry.load("quantize_fp8", "triton")
_write_kv = registry.load("write_kv", "triton")
paged_decode = registry.load("paged_decode", "triton")
paged_prefill = registry.load("paged_prefill", "triton")


# Verify passes of chains up to this many rows per sequence run row by row on the decode kernel
# (``_chain_rows``); each row re-reads its sequence's context, which stops paying for long queries.
CHAIN_ROWS_MAX = 8


def _check_device(t: torch.Tensor) -> None:
    if t.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("engine.attention_backend: 'triton' needs an NVIDIA GPU (or TRITON_INTERPRET=1 "
                         "for tests); allowed on this machine: torch, auto")


class TritonAttentionBackend(AttentionBackend):
    """``aot``: the bundle's ahead-of-time kernels (plugins.launcher.KernelSet, see ``load_aot``);
    None = Triton JIT."""
    name = "triton"
    sliding_window = True   # the paged kernels' window variants (plugins/paged_decode.py, paged_prefill.py)
    window_tables = True    # their masks drop every key outside the window (a stale table entry is never weighed)

    def __init__(self, aot=None) -> None:
        self.aot = aot

    def load_aot(self, bundle_dir, kernel_entries: list[dict], device) -> None:
        """Use the cubins listed in engine.json "kernels" (falls back to JIT, with a warning, when the
        device, driver or Triton cannot use them)."""
        from plugins.launcher import KernelSet
        self.aot = KernelSet.from_bundle(bundle_dir, kernel_entries, device)

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
        """Scatter ``k, v [T, Hkv, D]`` into the caches at ``slot_mapping [T]`` (-1 = skip)."""
        _check_device(k)
        _write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, aot=self.aot)

    def forward(self, q, k_cache, v_cache, meta, scale, k_scale=None, v_scale=None, out_scale=None,
                window=None) -> torch.Tensor:
        """``q [T, Hq, D]`` -> ``[T, Hq, D]``: causal attention over each sequence's cache. With
        ``out_scale`` (the O projection's static fp8 input scale) -> its float8_e4m3fn codes instead:
        folded into the decode kernel for decode-only steps, a quantization kernel after the others.
        ``window``: a sliding layer's, keys ``p - window < k <= p`` only (the kernels' window variants)."""
        _check_device(q)
        if out_scale is not None and not (meta.num_prefills == 0 and meta.tree_mask is None
                                          and meta.num_decode_tokens == meta.num_seqs):
            out = self.forward(q, k_cache, v_cache, meta, scale, k_scale, v_scale, window=window)
            return _quantize_fp8(out.reshape(out.shape[0], -1), out_scale, aot=self.aot).view(out.shape)
        w = {"window": window} if window is not None else {}   # (a full layer launches the kernels as before)
        num_p, num_seqs = meta.num_prefills, int(meta.seq_lens.shape[0])
        p_tok = meta.num_prefill_tokens
        num_d = num_seqs - num_p
        # one-token decodes and the rows of chain verify passes take the decode kernel; prefills,
        # token trees and long queries the prefill kernel, which handles any query length and mask
        plain_decode = meta.tree_mask is None and num_d > 0 and meta.num_decode_tokens == num_d
        if not plain_decode and not num_p and meta.tree_mask is None and meta.max_query_len <= CHAIN_ROWS_MAX:
            return self._chain_rows(q, k_cache, v_cache, meta, scale, k_scale, v_scale, w)
        if not plain_decode:
            return paged_prefill(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                 meta.context_lens, scale, k_scale, v_scale, tree_mask=meta.tree_mask,
                                 max_query_len=meta.max_query_len, aot=self.aot, **w)
        if not num_p:   # decodes only: the kernel's output is the result (no copy into a second buffer)
            return paged_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, k_scale, v_scale,
                                max_seq_len=meta.max_seq_len, aot=self.aot, out_scale=out_scale, **w)
        out = torch.empty_like(q)
        if num_p:
            out[:p_tok] = paged_prefill(q[:p_tok], k_cache, v_cache, meta.block_tables[:num_p],
                                        meta.query_start_loc[:num_p + 1], meta.context_lens[:num_p],
                                        scale, k_scale, v_scale, max_query_len=meta.max_query_len, aot=self.aot,
                                        **w)
        out[p_tok:] = paged_decode(q[p_tok:], k_cache, v_cache, meta.block_tables[num_p:],
                                   meta.seq_lens[num_p:], scale, k_scale, v_scale,
                                   max_seq_len=meta.max_seq_len, aot=self.aot, **w)
        return out

    def _chain_rows(self, q, k_cache, v_cache, meta, scale, k_scale, v_scale, w: dict) -> torch.Tensor:
        """A verify pass of chains: query row i of a sequence sees its context and new rows 0..i,
        which is a one-token decode with length ``context + i + 1``. So every row goes through the
        split-K decode kernel as a sequence of its own: the prefill kernel would run one program per
        (sequence, KV head), 8 programs at batch 1 on an 8B model, however long the context.
        Computed on the device from the metadata (no host sync: CUDA graphs capture this), once per
        step: every layer reuses it (ten small kernels a layer cost ~0.3 ms a pass at 8B). Rows past
        the step's last sequence (graph padding) get length 0."""
        rows_meta = meta.__dict__.get("_chain_rows")
        if rows_meta is None or rows_meta[0].shape[0] != q.shape[0]:
            qsl = meta.query_start_loc
            rows = torch.arange(q.shape[0], dtype=qsl.dtype, device=q.device)
            seq = torch.searchsorted(qsl[1:], rows, right=True).clamp_(max=meta.num_seqs - 1)
            lens = meta.context_lens.index_select(0, seq) + (rows - qsl.index_select(0, seq)) + 1
            lens = torch.where(rows < qsl[-1], lens, torch.zeros_like(lens)).to(torch.int32)
            rows_meta = meta.__dict__["_chain_rows"] = (lens, meta.block_tables.index_select(0, seq))
        lens, tables = rows_meta
        return paged_decode(q, k_cache, v_cache, tables, lens, scale, k_scale, v_scale,
                            max_seq_len=meta.max_seq_len, aot=self.aot, **w)


__all__ = ["TritonAttentionBackend"]
