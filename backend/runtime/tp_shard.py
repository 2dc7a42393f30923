"""Tensor-parallel sharding of a bundle's runtime tensors: rank ``r`` of ``tp`` gets its share.

Pure (tensors in, tensors out, no process group), so the builder can write per-rank files ahead of
time as TensorRT-LLM's per-rank engines do, and a test can check shapes without any process.
The split follows Megatron-LM for Llama (names: docs/contracts.md section 3):

- ``qkv`` column-parallel by heads: rank r keeps its q heads' rows, then its kv heads' k rows, then
  their v rows, so the rank's fused projection is again ``q | k | v`` of a model with heads/tp. With
  fewer KV heads than ranks, a rank's kv heads are the one its q heads read (``tp_rules.kv_heads_of_rank``),
  so those k/v rows (with their per-row or per-group scales and biases) are on tp/kv_heads ranks.
- ``gate_up`` column-parallel: rank r keeps its slice of gate AND of up (``silu(gate) * up`` pairs
  them row for row, so both halves must come from the same intermediate columns).
- ``o`` and ``down`` row-parallel: their input columns split, outputs are partial sums all-reduced.
- ``embed_tokens`` and ``lm_head`` vocab-parallel: rows ``[r*V/tp, (r+1)*V/tp)``.
- Scales go with the weights they scale (docs/contracts.md section 3 for each format's tensors):
  per-output-row ones (fp8/int8 ``weight_scale``, a bias) with a column-parallel linear's rows and
  whole on every rank of a row-parallel one (its outputs are all-reduced, the bias added after it);
  per-group ones (nvfp4's fp8 block scales ``[out, in/16]``, AWQ's ``[out, in/group]``) with their
  rows, and for ``o``/``down`` with their columns, on group boundaries (``tp_rules.group_problem``);
  per-input-column ones (AWQ / SmoothQuant ``pre_quant_scale [in]``) with o/down's columns, whole for
  qkv/gate_up (whose input is not split); per-tensor ones (``input_scale``, ``weight_scale_2``, KV
  ``k/v_scale``) and norms are copied. Packed 4-bit weights (``uint8 [out, in/2]``, two codes of one
  row per byte, no interleaving: the W4A16 kernels read that layout) split rows whole and columns
  on byte boundaries, which a whole group always is (groups are even).

Each tensor splits on its own (``shard_tensor``: its name says how), so the builder streams a
checkpoint into per-rank files one tensor at a time; ``unshard_tensor`` is the inverse, for readers
that want the whole model from such a bundle (the verify stage, a tp_size=1 run). The rules of which
splits are possible live in ``tp_rules`` (no torch: the builder's config check uses them too).
"""
from __future__ import annotations

import dataclasses
import re
from contextlib import ExitStack
from pathlib import Path

import torch

from backend.bundle_schema import ModelConfig
# re-exported: callers find the rules beside the splitting they guard
from backend.runtime.tp_rules import SHARDABLE_FORMATS, ShardError, check_tp  # noqa: F401
from backend.runtime.tp_rules import kv_heads_of_rank, kv_heads_per_rank
from quant.formats import get_format

# The tensors a linear may carry in any format (anything else is refused, never replicated blindly);
# shard_weights also holds each linear to its own format's set (quant/formats.py).
_LINEAR_PARTS = ("weight", "weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale", "bias")
_PER_TENSOR = ("input_scale", "weight_scale_2")
_COLUMN = ("qkv", "gate_up")      # output rows split
_ROW = ("o", "down")              # input columns split, outputs all-reduced
_VOCAB = ("embed_tokens.weight", "lm_head.weight")
# Copied whole to every rank: the norms of the hidden state (Gemma 3's four a layer among them), the KV
# scales, and the per-head q/k norms (Qwen3, Gemma 3): one [head_dim] weight applied to every head, so
# whichever heads a rank holds
_LAYER_COPIED = ("input_norm.weight", "post_attn_norm.weight", "pre_ff_norm.weight", "post_ff_norm.weight",
                 "attn.k_scale", "attn.v_scale", "q_norm.weight", "k_norm.weight")
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")

Spans = list[tuple[int, int]]     # (start, count) runs of rows, in the order one rank keeps them


def shard_config(config: ModelConfig, tp_size: int) -> ModelConfig:
    """The model one rank computes: heads, intermediate size and vocab divided by ``tp_size``, KV heads
    too or one where there are fewer (``kv_heads_per_rank``); hidden size and head_dim unchanged, so
    ``backend.model.llama``'s layer code runs as it is (its GQA group is the rank's heads / KV heads)."""
    return dataclasses.replace(config, num_heads=config.num_heads // tp_size,
                               num_kv_heads=kv_heads_per_rank(config.num_kv_heads, tp_size),
                               intermediate_size=config.intermediate_size // tp_size,
                               vocab_size=config.vocab_size // tp_size)


def _plan(name: str, shape: tuple[int, ...], c: ModelConfig, tp: int, whole: bool) -> tuple[str, list]:
    """How the tensor ``name`` splits: ("copy", []), ("rows", [Spans per rank]) or ("cols", [(start,
    count) per rank]). ``whole``: ``shape`` is the unsharded tensor's (checked), else one rank's."""
    d = c.head_dim
    if name in _VOCAB:
        if whole and shape[0] != c.vocab_size:
            raise ShardError(f"{name}: {shape[0]} rows; model.vocab_size is {c.vocab_size}")
        v = c.vocab_size // tp
        return "rows", [[(r * v, v)] for r in range(tp)]
    if name == "norm.weight":
        return "copy", []
    m = _LAYER.fullmatch(name)
    if m is None or int(m[1]) >= c.num_layers:
        raise ShardError(f"tensors not covered by tensor-parallel sharding: {name}")
    rest = m[2]
    if rest in _LAYER_COPIED:
        return "copy", []
    lin, _, part = rest.partition(".")
    where = f"layers.{m[1]}.{lin}"
    if lin not in _COLUMN + _ROW:
        raise ShardError(f"tensors not covered by tensor-parallel sharding: {name}")
    if part not in _LINEAR_PARTS:
        raise ShardError(f"{where}: tensors {part} are not part of a shardable linear "
                         f"(formats {', '.join(SHARDABLE_FORMATS)})")
    numel = 1
    for n in shape:
        numel *= n
    if part in _PER_TENSOR or (part == "weight_scale" and numel == 1):
        return "copy", []                               # per-tensor: every rank quantizes alike
    if lin in _ROW:
        return _row_plan(f"{where}.{part}", part, shape, c.q_size if lin == "o" else c.intermediate_size,
                         tp, whole)
    if part == "pre_quant_scale":
        # multiplies qkv/gate_up's input, which every rank gets whole
        if whole and shape != (c.hidden_size,):
            raise ShardError(f"{where}.{part}: shape {shape}; expected ({c.hidden_size},)")
        return "copy", []
    if lin == "qkv":
        qh, rows = c.num_heads // tp * d, c.q_size + 2 * c.kv_size
        kv = [kv_heads_of_rank(c.num_heads, c.num_kv_heads, tp, r) for r in range(tp)]
        spans = [[(r * qh, qh), (c.q_size + k * d, n * d), (c.q_size + c.kv_size + k * d, n * d)]
                 for r, (k, n) in enumerate(kv)]
    else:
        inter, rows = c.intermediate_size // tp, 2 * c.intermediate_size
        spans = [[(r * inter, inter), (c.intermediate_size + r * inter, inter)] for r in range(tp)]
    if whole and shape[0] != rows:   # weight (packed or not), per-row or per-group weight_scale, bias
        raise ShardError(f"{where}.{part}: shape {shape}; expected {rows} rows or one value")
    return "rows", spans


def _row_plan(what: str, part: str, shape: tuple[int, ...], inp: int, tp: int, whole: bool) -> tuple[str, list]:
    """How a tensor of a row-parallel linear (``inp`` input features, split ``tp`` ways) splits."""
    n = inp // tp
    if part == "bias" or (part == "weight_scale" and len(shape) == 1):
        return "copy", []            # per output row: every rank computes every row's partial sum
    if part == "pre_quant_scale":    # one per input feature: with its columns
        if whole and shape != (inp,):
            raise ShardError(f"{what}: shape {shape}; expected ({inp},)")
        return "rows", [[(r * n, n)] for r in range(tp)]
    # weight [out, in] (or packed two codes a byte [out, in/2]); grouped weight_scale [out, in/group]
    cols = shape[-1] if len(shape) == 2 else 0
    if not whole:
        return "cols", []
    per_col = inp // cols if cols and inp % cols == 0 else 0
    if not (per_col in (1, 2) if part == "weight" else per_col > 1):
        want = f"{inp} or {inp // 2} (packed 4-bit)" if part == "weight" else f"{inp}/group"
        raise ShardError(f"{what}: shape {shape}; expected {want} columns for {inp} input features")
    if cols % tp:
        unit = (("input features" if per_col == 1 else "bytes of two 4-bit codes") if part == "weight"
                else f"scale groups of {per_col} input features")
        raise ShardError(f"{what}: {cols} {unit} do not split {tp} ways: each rank's {n} of the {inp} "
                         f"input features would cut one")
    k = cols // tp
    return "cols", [(r * k, k) for r in range(tp)]


def shard_tensor(name: str, t: torch.Tensor, config: ModelConfig, tp_size: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s part of the unsharded tensor ``name``, in new storage (a view would keep the
    whole tensor alive, and a rank must hold only its share)."""
    kind, spans = _plan(name, tuple(t.shape), config, tp_size, whole=True)
    if kind == "copy":
        return t.clone()
    if kind == "cols":
        return t.narrow(1, *spans[rank]).clone(memory_format=torch.contiguous_format)
    mine = spans[rank]
    return torch.cat([t.narrow(0, s, n) for s, n in mine]) if len(mine) > 1 else t.narrow(0, *mine[0]).clone()


def unshard_tensor(name: str, parts: list[torch.Tensor], config: ModelConfig) -> torch.Tensor:
    """The unsharded tensor ``name`` from every rank's part (rank order): ``shard_tensor``'s inverse."""
    tp = len(parts)
    kind, spans = _plan(name, tuple(parts[0].shape), config, tp, whole=False)
    if kind == "copy":
        return parts[0]
    if kind == "cols":
        return torch.cat(parts, dim=1)
    pieces = {}
    for part, mine in zip(parts, spans):
        off = 0
        for start, n in mine:
            # replicated KV heads' rows are on several ranks: the first rank's copy stands for them
            pieces.setdefault(start, part.narrow(0, off, n))
            off += n
    return torch.cat([pieces[s] for s in sorted(pieces)])


def shard_weights(weights: dict[str, torch.Tensor], config: ModelConfig, quant_format: str,
                  tp_size: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s tensors, named as the unsharded bundle's (its model is ``shard_config``'s).
    Every name of ``weights`` is accounted for: an unknown one is refused rather than copied."""
    check_tp(config, quant_format, tp_size)
    if not 0 <= rank < tp_size:
        raise ShardError(f"rank {rank}: outside tp_size={tp_size}")
    for i in range(config.num_layers):
        for lin in _COLUMN + _ROW:
            if f"layers.{i}.{lin}.weight" not in weights:
                raise ShardError(f"layers.{i}.{lin}.weight: missing")
    # A tensor the format does not have would be split by its name's rule without meaning it
    fmt = get_format(quant_format)
    parts = (*fmt.required, *fmt.optional, "bias")
    for name in weights:
        m = _LAYER.fullmatch(name)
        lin, _, part = m[2].partition(".") if m else ("", "", "")
        if lin in _COLUMN + _ROW and part not in parts:
            raise ShardError(f"layers.{m[1]}.{lin}: tensors {part} are not part of a {quant_format!r} linear; "
                             f"allowed: {', '.join(parts)}")
    return {name: shard_tensor(name, t, config, tp_size, rank) for name, t in weights.items()}


def load_unsharded(files: list[Path], config: ModelConfig, names: list[str] | None = None,
                   prefix: str = "", device: str = "cpu") -> dict[str, torch.Tensor]:
    """The whole tensors ``names`` (default: every one starting with ``prefix``) read from per-rank
    files (rank order) and put back together. The files are opened for this call only: a handle kept
    open keeps every page read through its memory map resident."""
    from safetensors import safe_open
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(f), "pt", device=device)) for f in files]
        keys = set(handles[0].keys())
        names = names if names is not None else [n for n in handles[0].keys() if n.startswith(prefix)]
        missing = [n for n in names if n not in keys]
        if missing:
            raise KeyError(f"{files[0]}: missing tensor {missing[0]!r}")
        return {n: unshard_tensor(n, [h.get_tensor(n) for h in handles], config) for n in names}
