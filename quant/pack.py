"""Fuse the exported per-module linears into the runtime layout (docs/contracts.md section 3).

    pack_linear(fmt, parts) -> {"weight": ..., "weight_scale": ..., ...}

`parts` is a list of per-module tensor dicts in the ModelOpt unified checkpoint's naming (for a
fused q|k|v: the q_proj, k_proj and v_proj dicts in that order; a single module is a list of one),
rows are concatenated in list order. Imports only torch (the runtime may import it).

Scale rules, and why:
  fp8       ModelOpt exports one weight scale per module; the runtime keeps one per output ROW so
            fused parts keep their own scale (no requantization). input_scale: max over parts
            (the parts see the same input, so ModelOpt calibrates the same value; max never clips).
  nvfp4     One global scale per GEMM: weight_scale_2 must be shared. ModelOpt already ties it for
            q/k/v and gate/up; if parts differ, block scales are re-expressed against the largest
            global scale (a block scale only shrinks, so it cannot overflow fp8).
  int4_awq  pre_quant_scale multiplies the GEMM's single input, so parts must agree (ModelOpt folds
            it into the preceding norm for q/k/v and gate/up; it remains on o_proj and down_proj).
            The int4 codes are repacked from ModelOpt's [out/2, in] two's complement layout to the
            runtime's [out, in/2] offset-binary layout; weight_scale is cast to the model dtype.
  w4a8_awq  as int4_awq; ModelOpt also exports weight_scale_2 (fp8 per-tensor scale of the int4
            weights, for kernels that convert them to fp8): max over parts, kept as is.
  int8_sq   per-row weight scales concatenate; input_scale max; pre_quant_scale must agree.
"""

from __future__ import annotations

from typing import Sequence

import torch

from quant.formats import (FP8, FormatError, Tensors, _nvfp4_block_scale, get_format, int4_from_modelopt,
                           int4_to_modelopt)

KV_SCALE_NAMES = ("k_scale", "v_scale")


class PackError(ValueError):
    """Exported parts that cannot be fused (one line naming the tensor and the problem)."""


def _need(part: Tensors, name: str, fmt: str, i: int) -> torch.Tensor:
    if name not in part:
        raise PackError(f"{fmt}: part {i} has no {name!r} tensor; it has: {', '.join(sorted(part)) or 'nothing'}")
    return part[name]


def _max_scalar(parts: Sequence[Tensors], name: str, fmt: str) -> torch.Tensor:
    return torch.stack([_need(p, name, fmt, i).float().reshape(()) for i, p in enumerate(parts)]).amax()


def _shared(parts: Sequence[Tensors], name: str, fmt: str, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """A tensor that every part must carry identically (or none may carry)."""
    present = [name in p for p in parts]
    if not any(present):
        return None
    if not all(present):
        raise PackError(f"{fmt}: {name} is present on parts {[i for i, x in enumerate(present) if x]} but not on all "
                        f"{len(parts)} fused parts; they multiply one shared input, so all or none must have it")
    first = parts[0][name]
    for i, p in enumerate(parts[1:], 1):
        if p[name].shape != first.shape or not torch.equal(p[name], first):
            raise PackError(f"{fmt}: {name} differs between fused parts 0 and {i}; the fused GEMM has one input, "
                            f"so the parts must share it (export the checkpoint with ModelOpt's default AWQ/SQ settings)")
    return first if dtype is None else first.to(dtype)


def _pack_fp8(parts: Sequence[Tensors], dtype: torch.dtype) -> Tensors:
    weights, scales = [], []
    for i, p in enumerate(parts):
        w = _need(p, "weight", "fp8", i)
        if w.dtype != FP8:
            raise PackError(f"fp8: part {i} weight is {w.dtype}, expected {FP8}")
        s = _need(p, "weight_scale", "fp8", i).float().reshape(-1)
        if s.numel() not in (1, w.shape[0]):
            raise PackError(f"fp8: part {i} weight_scale has {s.numel()} values; expected 1 or {w.shape[0]}")
        weights.append(w)
        scales.append(s.expand(w.shape[0]))
    return {"weight": torch.cat(weights), "weight_scale": torch.cat(scales).contiguous(),
            "input_scale": _max_scalar(parts, "input_scale", "fp8")}


def _pack_nvfp4(parts: Sequence[Tensors], dtype: torch.dtype) -> Tensors:
    gs = [_need(p, "weight_scale_2", "nvfp4", i).float().reshape(()) for i, p in enumerate(parts)]
    shared = torch.stack(gs).amax()
    weights, blocks = [], []
    for i, (p, g) in enumerate(zip(parts, gs)):
        w, bs = _need(p, "weight", "nvfp4", i), _need(p, "weight_scale", "nvfp4", i)
        if w.dtype != torch.uint8 or bs.dtype != FP8:
            raise PackError(f"nvfp4: part {i} has weight {w.dtype} / weight_scale {bs.dtype}; expected uint8 / {FP8}")
        if g != shared:
            # Re-expressing rounds each block scale once more in fp8 (relative step 2^-3); the codes stay
            bs = _nvfp4_block_scale(bs.float() * (g / shared))
        weights.append(w)
        blocks.append(bs)
    out = {"weight": torch.cat(weights), "weight_scale": torch.cat(blocks), "weight_scale_2": shared}
    if any("input_scale" in p for p in parts):
        out["input_scale"] = _max_scalar(parts, "input_scale", "nvfp4")
    return out


def _pack_int4(fmt: str, parts: Sequence[Tensors], dtype: torch.dtype) -> Tensors:
    weights, scales = [], []
    for i, p in enumerate(parts):
        w, s = _need(p, "weight", fmt, i), _need(p, "weight_scale", fmt, i)
        if w.dtype != torch.uint8:
            raise PackError(f"{fmt}: part {i} weight is {w.dtype}, expected uint8 (ModelOpt packed int4)")
        if w.shape[0] * 2 != s.shape[0] or s.dim() != 2 or w.shape[1] % s.shape[1]:
            raise PackError(f"{fmt}: part {i} weight {tuple(w.shape)} (ModelOpt layout [out/2, in]) does not match "
                            f"weight_scale {tuple(s.shape)} ([out, in/group])")
        weights.append(int4_from_modelopt(w))
        scales.append(s.to(dtype))
    if len({s.shape[1] for s in scales}) != 1:
        raise PackError(f"{fmt}: fused parts have different group counts {[s.shape[1] for s in scales]}")
    out = {"weight": torch.cat(weights), "weight_scale": torch.cat(scales)}
    pqs = _shared(parts, "pre_quant_scale", fmt, dtype)
    if pqs is not None:
        out["pre_quant_scale"] = pqs
    if fmt == "w4a8_awq":
        out["input_scale"] = _max_scalar(parts, "input_scale", fmt)
        if any("weight_scale_2" in p for p in parts):
            # Absolute group scales do not depend on it, so the max needs no re-expression
            out["weight_scale_2"] = _max_scalar(parts, "weight_scale_2", fmt)
    return out


def _pack_int8(parts: Sequence[Tensors], dtype: torch.dtype) -> Tensors:
    weights, scales = [], []
    for i, p in enumerate(parts):
        w = _need(p, "weight", "int8_sq", i)
        if w.dtype != torch.int8:
            raise PackError(f"int8_sq: part {i} weight is {w.dtype}, expected int8")
        s = _need(p, "weight_scale", "int8_sq", i).float().reshape(-1)
        if s.numel() not in (1, w.shape[0]):
            raise PackError(f"int8_sq: part {i} weight_scale has {s.numel()} values; expected 1 or {w.shape[0]}")
        weights.append(w)
        scales.append(s.expand(w.shape[0]))
    out = {"weight": torch.cat(weights), "weight_scale": torch.cat(scales).contiguous(),
           "input_scale": _max_scalar(parts, "input_scale", "int8_sq")}
    pqs = _shared(parts, "pre_quant_scale", "int8_sq", dtype)
    if pqs is not None:
        out["pre_quant_scale"] = pqs
    return out


def _pack_none(parts: Sequence[Tensors], dtype: torch.dtype) -> Tensors:
    return {"weight": torch.cat([_need(p, "weight", "none", i).to(dtype) for i, p in enumerate(parts)])}


_PACKERS = {
    "none": _pack_none,
    "fp8": _pack_fp8,
    "nvfp4": _pack_nvfp4,
    "int4_awq": lambda parts, dtype: _pack_int4("int4_awq", parts, dtype),
    "w4a8_awq": lambda parts, dtype: _pack_int4("w4a8_awq", parts, dtype),
    "int8_sq": _pack_int8,
}


def pack_linear(fmt: str, parts: Sequence[Tensors], dtype: torch.dtype = torch.bfloat16) -> Tensors:
    """Fuse `parts` (exported per-module tensors, rows in list order) into one runtime linear.

    `dtype` is the model dtype, used for int4 weight scales and pre-quant scales (and `none` weights).
    Tensors other than the format's (bias, k_scale, v_scale) are the caller's business and are ignored.
    Returns the tensors of docs/contracts.md section 3 for `fmt`; raises PackError when the parts
    cannot share one GEMM.
    """
    fmt_spec = get_format(fmt)
    if not parts:
        raise PackError(f"{fmt}: pack_linear needs at least one part")
    in_sizes = set()
    for i, p in enumerate(parts):
        w = _need(p, "weight", fmt, i)
        in_sizes.add(w.shape[-1])
    if len(in_sizes) != 1:
        raise PackError(f"{fmt}: fused parts have different packed input widths {sorted(in_sizes)}")
    out = _PACKERS[fmt](parts, dtype)
    fmt_spec.check(out, where=f"pack_linear({fmt})")
    return out


def pack_kv_scales(k_part: Tensors, v_part: Tensors) -> Tensors:
    """{k_scale, v_scale} fp32 scalars for `layers.{i}.attn.*` from the k_proj / v_proj exports
    (ModelOpt writes `k_proj.k_scale` = K amax / 448; the cache stores K / k_scale in fp8)."""
    out = {}
    for name, part in (("k_scale", k_part), ("v_scale", v_part)):
        if name not in part:
            raise PackError(f"kv cache: {name} missing (quantization.kv_cache=fp8 exports it on the "
                            f"{name[0]}_proj module); found: {', '.join(sorted(part)) or 'nothing'}")
        s = part[name].float().reshape(())
        if not torch.isfinite(s) or s <= 0:
            raise PackError(f"kv cache: {name} = {float(s)} is not a positive finite scale")
        out[name] = s
    return out


def split_linear(fmt: str, packed: Tensors, out_sizes: Sequence[int]) -> list[Tensors]:
    """Inverse of pack_linear for tests and tools: the runtime tensors of one fused linear -> per-part
    tensors in the export's naming and layout. Shared tensors (input_scale, pre_quant_scale,
    weight_scale_2) are copied to each part; fp8/int8 per-row scales stay per row."""
    get_format(fmt).check(packed, where=f"split_linear({fmt})")
    rows = packed["weight"].shape[0]
    if sum(out_sizes) != rows:
        raise PackError(f"{fmt}: out_sizes {list(out_sizes)} sum to {sum(out_sizes)}, the weight has {rows} rows")
    per_row = {"weight", "weight_scale"}
    parts = []
    start = 0
    for n in out_sizes:
        part = {}
        for name, t in packed.items():
            part[name] = t[start:start + n] if name in per_row else t.clone()
        if fmt in ("int4_awq", "w4a8_awq"):
            try:
                part["weight"] = int4_to_modelopt(part["weight"])
            except FormatError as e:
                raise PackError(str(e)) from None
            part["weight_scale"] = part["weight_scale"].float()
        parts.append(part)
        start += n
    return parts
