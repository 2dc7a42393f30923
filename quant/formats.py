"""Runtime weight formats: pure-torch pack / unpack / quantize / dequantize, one registry entry each.

Imports only torch: the runtime (backend/) and the compile stage both use it. Layouts are the
runtime layout of docs/contracts.md section 3 (out = output features, in = input features):

  none      weight [out, in] model dtype
  fp8       weight float8_e4m3fn [out, in]; weight_scale fp32 [out]; input_scale fp32 []
  nvfp4     weight uint8 [out, in/2] e2m1 codes, low nibble = even element;
            weight_scale float8_e4m3fn [out, in/16]; weight_scale_2 fp32 []; input_scale fp32 []
  int4_awq  weight uint8 [out, in/2], low nibble = even element, value = nibble - 8;
            weight_scale [out, in/group] (model dtype); pre_quant_scale [in] optional
  w4a8_awq  as int4_awq plus input_scale fp32 [] (fp8 activations) and weight_scale_2 fp32 []
            optional (ModelOpt's fp8 scale for kernels that turn int4 into fp8; weight_scale is
            absolute, so the dense weight does not use it)
  int8_sq   weight int8 [out, in]; weight_scale fp32 [out]; input_scale fp32 []; pre_quant_scale [in] optional

Every quantizer here rounds to nearest (ties to even) like torch's casts and ModelOpt's export,
so quantizing a weight here and in ModelOpt gives the same codes up to scale rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

Tensors = dict[str, torch.Tensor]

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
E2M1_MAX = 6.0
NVFP4_BLOCK = 16
INT4_MIN, INT4_MAX = -8, 7
INT4_OFFSET = 8  # runtime nibble = value + 8 (offset binary: a plain shift-and-subtract in kernels)
INT8_MAX = 127.0

# e2m1 magnitudes by 3-bit code; bit 3 of a nibble is the sign
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between consecutive magnitudes: |x| above boundary i rounds to code i+1 at least
_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


class FormatError(ValueError):
    """Tensors that do not fit a format's layout (wrong dtype, shape or missing tensor)."""


# ---------------------------------------------------------------------------------------------
# nibbles


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 [..., 2k] -> uint8 [..., k]; element 2j goes in the low nibble of byte j."""
    if codes.shape[-1] % 2:
        raise FormatError(f"pack_nibbles: last dimension {codes.shape[-1]} is odd; nibbles pack in pairs")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., k] -> uint8 codes [..., 2k] (inverse of pack_nibbles)."""
    if packed.dtype != torch.uint8:
        raise FormatError(f"unpack_nibbles: expected uint8, got {packed.dtype}")
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# ---------------------------------------------------------------------------------------------
# e2m1 (fp4)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """float [...] -> uint8 e2m1 codes [...]: nearest of ±{0,.5,1,1.5,2,3,4,6}, ties to the even
    code (the one with mantissa 0), saturating at ±6. -0 encodes as +0."""
    xf = x.float()
    mag = xf.abs()
    bounds = torch.tensor(_E2M1_BOUNDS, device=x.device)
    code = torch.bucketize(mag, bounds, right=False)  # value == bound -> lower code
    # A value exactly on a midpoint rounds to the even code: bucketize gave the lower one, which is
    # odd for midpoints 0.75, 1.75, 3.5 (between codes 1|2, 3|4, 5|6) -> move those up.
    code = code + ((mag == 0.75) | (mag == 1.75) | (mag == 3.5)).to(code.dtype)
    code = torch.where(torch.isnan(xf), torch.zeros_like(code), code)
    # Like ModelOpt, a small negative value that rounds to zero keeps its sign (code 8 = -0)
    sign = (xf < 0).to(torch.uint8) << 3
    return code.to(torch.uint8) | sign


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 e2m1 codes [...] -> float32 [...] (code 8 is -0.0)."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32,
                         device=codes.device)
    return table[codes.long()]


# 1.5 * 2^23: adding 1.5 * 2^23 * s to a float of magnitude below 2^22 * s (s a power of two) and
# subtracting it again rounds the float to a multiple of s, ties to even, in the FPU's own rounding
_ROUND_MAGIC = 12582912.0


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """float [...] -> float32 [...]: each value rounded to the nearest e2m1 value, exactly
    ``e2m1_decode(e2m1_encode(x))`` (ties to the even code, saturating at ±6, NaN -> +0, -0 -> +0, a
    small negative that rounds to zero -> -0) without the codes: a handful of in-place passes instead
    of a bucketize, a gather and the temporaries of both (one CPU thread, 778 x 576 values: 20 ms
    -> 0.7 ms; a W4A4 NVFP4 linear on CPU fakes its activation quantization with this).

    The e2m1 grid has step 0.5 below 2, 1 in [2, 4) and 2 from 4: the step is half the power of two
    at or below ``clamp(|x|, 1, 4)``, read off its exponent bits."""
    xn = torch.nan_to_num(x.float(), nan=0.0).add_(0.0)      # + 0.0 turns -0 into +0
    magic = xn.abs().clamp_(1.0, 4.0)
    magic.view(torch.int32).bitwise_and_(0x7F800000)          # 2^floor(log2): 1, 2 or 4
    magic.mul_(_ROUND_MAGIC / 2)                              # 1.5 * 2^23 * step
    q = xn.clamp(-E2M1_MAX, E2M1_MAX)
    q.add_(magic).sub_(magic)
    return torch.copysign(q, xn, out=q)


# ---------------------------------------------------------------------------------------------
# fp8


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [...] / scale (broadcastable) -> float8_e4m3fn [...], saturating at ±448 (a plain cast
    would turn out-of-range values into NaN)."""
    return (x.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_fp8_per_tensor(w: torch.Tensor) -> Tensors:
    """w [out, in] -> {weight fp8 [out, in], weight_scale fp32 []} with scale = amax / 448."""
    scale = (w.float().abs().amax() / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return {"weight": quantize_fp8(w, scale), "weight_scale": scale}


def quantize_fp8_per_row(w: torch.Tensor) -> Tensors:
    """w [out, in] -> {weight fp8 [out, in], weight_scale fp32 [out]} (one scale per output row)."""
    scale = (w.float().abs().amax(dim=1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return {"weight": quantize_fp8(w, scale[:, None]), "weight_scale": scale}


def dequantize_fp8(weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight fp8 [out, in], weight_scale fp32 [] or [out] -> [out, in] in `dtype`."""
    _check_dtype("fp8 weight", weight, FP8)
    s = weight_scale.float().reshape(-1)
    if s.numel() not in (1, weight.shape[0]):
        raise FormatError(f"fp8 weight_scale has {s.numel()} values; expected 1 or one per output row ({weight.shape[0]})")
    return (weight.float() * s[:, None]).to(dtype) if s.numel() > 1 else (weight.float() * s).to(dtype)


# ---------------------------------------------------------------------------------------------
# nvfp4


def _nvfp4_block_scale(per_block: torch.Tensor) -> torch.Tensor:
    """Block scales in units of the global scale -> fp8, as ModelOpt does it: an all-zero block gets
    1.0 (its codes are 0 anyway) and every scale is clamped to [2^-9, 448] (fp8's smallest subnormal
    and largest finite value) so none underflows to 0 or overflows to NaN."""
    per_block = torch.where(per_block == 0, 1.0, per_block)
    return per_block.clamp(2.0**-9, FP8_MAX).to(FP8)


def quantize_nvfp4(w: torch.Tensor, weight_scale_2: torch.Tensor | None = None) -> Tensors:
    """w [out, in] (in % 16 == 0) -> {weight uint8 [out, in/2], weight_scale fp8 [out, in/16],
    weight_scale_2 fp32 []}.

    Two-level scaling as in ModelOpt: the global scale maps the largest block scale onto fp8's
    range (amax / (6 * 448)); each block of 16 gets an fp8 scale of block_amax / 6 in units of it.
    """
    out, k = w.shape
    if k % NVFP4_BLOCK:
        raise FormatError(f"nvfp4: input features {k} are not a multiple of {NVFP4_BLOCK}")
    wf = w.float()
    if weight_scale_2 is None:
        weight_scale_2 = wf.abs().amax() / (E2M1_MAX * FP8_MAX)
    gs = weight_scale_2.float().reshape(()).clamp(min=torch.finfo(torch.float32).tiny)
    blocks = wf.reshape(out, k // NVFP4_BLOCK, NVFP4_BLOCK)
    bscale = _nvfp4_block_scale(blocks.abs().amax(-1) / (E2M1_MAX * gs))
    scaled = blocks / (bscale.float() * gs).unsqueeze(-1)
    codes = e2m1_encode(scaled).reshape(out, k)
    return {"weight": pack_nibbles(codes), "weight_scale": bscale, "weight_scale_2": gs}


def dequantize_nvfp4(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight uint8 [out, in/2], weight_scale fp8 [out, in/16], weight_scale_2 fp32 [] -> [out, in]."""
    _check_dtype("nvfp4 weight", weight, torch.uint8)
    _check_dtype("nvfp4 weight_scale", weight_scale, FP8)
    out, half = weight.shape
    if tuple(weight_scale.shape) != (out, half * 2 // NVFP4_BLOCK):
        raise FormatError(f"nvfp4 weight_scale shape {tuple(weight_scale.shape)} does not match weight "
                          f"{tuple(weight.shape)}; expected {(out, half * 2 // NVFP4_BLOCK)}")
    vals = e2m1_decode(unpack_nibbles(weight)).reshape(out, -1, NVFP4_BLOCK)
    scale = weight_scale.float() * weight_scale_2.float().reshape(())
    return (vals * scale.unsqueeze(-1)).reshape(out, -1).to(dtype)


def fake_quantize_nvfp4_activation(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """x [..., in] -> x quantized to NVFP4 and back, in x's dtype.

    What a W4A4 NVFP4 GEMM does to activations: `input_scale` is the static global scale
    (ModelOpt's activation amax / (6 * 448)); each block of 16 along `in` gets a dynamic fp8 scale."""
    k = x.shape[-1]
    if k % NVFP4_BLOCK:
        raise FormatError(f"nvfp4 activation: last dimension {k} is not a multiple of {NVFP4_BLOCK}")
    gs = input_scale.float().reshape(())
    blocks = x.float().reshape(*x.shape[:-1], k // NVFP4_BLOCK, NVFP4_BLOCK)
    bscale = (_nvfp4_block_scale(blocks.abs().amax(-1) / (E2M1_MAX * gs)).float() * gs).unsqueeze(-1)
    q = e2m1_round(blocks / bscale).mul_(bscale)
    return q.reshape(x.shape).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# int4 (AWQ)


def quantize_int4(w: torch.Tensor, group_size: int) -> Tensors:
    """w [out, in] -> {weight uint8 [out, in/2] (nibble = value + 8), weight_scale fp32 [out, in/group]}
    with symmetric scale = group_amax / 7 and values clamped to [-8, 7] (ModelOpt's rule)."""
    out, k = w.shape
    if group_size <= 0 or k % group_size or k % 2:
        raise FormatError(f"int4: group_size {group_size} must be positive and divide the input features {k} (even)")
    g = w.float().reshape(out, k // group_size, group_size)
    scale = g.abs().amax(-1) / INT4_MAX
    safe = torch.where(scale == 0, 1.0, scale).unsqueeze(-1)
    q = torch.round(g / safe).clamp(INT4_MIN, INT4_MAX).reshape(out, k)
    return {"weight": pack_nibbles((q + INT4_OFFSET).to(torch.uint8)), "weight_scale": scale}


def dequantize_int4(weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight uint8 [out, in/2] (value = nibble - 8), weight_scale [out, in/group] -> [out, in]."""
    _check_dtype("int4 weight", weight, torch.uint8)
    out, half = weight.shape
    k = half * 2
    if weight_scale.dim() != 2 or weight_scale.shape[0] != out or k % weight_scale.shape[1]:
        raise FormatError(f"int4 weight_scale shape {tuple(weight_scale.shape)} does not tile weight "
                          f"[{out}, {k}] (packed {tuple(weight.shape)}); expected [{out}, {k}/group]")
    vals = unpack_nibbles(weight).float() - INT4_OFFSET
    group = k // weight_scale.shape[1]
    return (vals.reshape(out, -1, group) * weight_scale.float().unsqueeze(-1)).reshape(out, k).to(dtype)


def int4_from_modelopt(packed: torch.Tensor) -> torch.Tensor:
    """ModelOpt's export layout -> runtime layout.

    ModelOpt packs two's-complement int4 along the OUTPUT dimension: byte [r, c] holds rows 2r (low
    nibble) and 2r+1 (high nibble) of column c, shape [out/2, in]. The runtime packs along the input
    dimension ([out, in/2], offset binary) so a GEMM reads a row's K values contiguously and fused
    q|k|v rows concatenate without splitting a byte."""
    _check_dtype("int4 weight (ModelOpt layout)", packed, torch.uint8)
    half_out, k = packed.shape
    pairs = torch.stack((packed & 0xF, packed >> 4), dim=1).reshape(half_out * 2, k)  # [out, in] rows 2r, 2r+1
    signed = pairs.to(torch.int16) - ((pairs >= 8).to(torch.int16) << 4)  # two's complement nibble -> -8..7
    return pack_nibbles((signed + INT4_OFFSET).to(torch.uint8))


def int4_to_modelopt(weight: torch.Tensor) -> torch.Tensor:
    """Runtime int4 layout [out, in/2] -> ModelOpt's export layout [out/2, in] (inverse of int4_from_modelopt)."""
    _check_dtype("int4 weight", weight, torch.uint8)
    out = weight.shape[0]
    if out % 2:
        raise FormatError(f"int4: ModelOpt's layout packs output rows in pairs; {out} rows is odd")
    nib = (unpack_nibbles(weight).to(torch.int16) - INT4_OFFSET) & 0xF  # two's complement nibble
    nib = nib.to(torch.uint8).reshape(out // 2, 2, -1)
    return nib[:, 0] | (nib[:, 1] << 4)


# ---------------------------------------------------------------------------------------------
# int8


def quantize_int8_per_row(w: torch.Tensor) -> Tensors:
    """w [out, in] -> {weight int8 [out, in], weight_scale fp32 [out]} with scale = row_amax / 127."""
    scale = w.float().abs().amax(dim=1) / INT8_MAX
    safe = torch.where(scale == 0, 1.0, scale)
    q = torch.round(w.float() / safe[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return {"weight": q, "weight_scale": scale}


def dequantize_int8(weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight int8 [out, in], weight_scale fp32 [out] or [] -> [out, in]."""
    _check_dtype("int8 weight", weight, torch.int8)
    s = weight_scale.float().reshape(-1)
    if s.numel() not in (1, weight.shape[0]):
        raise FormatError(f"int8 weight_scale has {s.numel()} values; expected 1 or {weight.shape[0]}")
    return (weight.float() * s.reshape(-1, 1)).to(dtype)


# ---------------------------------------------------------------------------------------------
# registry


def _check_dtype(what: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype:
        raise FormatError(f"{what}: expected {dtype}, got {t.dtype} with shape {tuple(t.shape)}")


def _with_pre_quant_scale(w: torch.Tensor, tensors: Tensors) -> torch.Tensor:
    # The linear computes W (s * x) = (W diag s) x, so the smoothing folds into the weight columns.
    pqs = tensors.get("pre_quant_scale")
    return w if pqs is None else w * pqs.float().reshape(1, -1)


@dataclass(frozen=True)
class WeightFormat:
    """One runtime weight format: which tensors a linear stores and how to get its dense weight."""

    name: str
    required: tuple[str, ...]
    optional: tuple[str, ...]
    dense: Callable[[Tensors], torch.Tensor]  # fp32 [out, in], pre_quant_scale folded in
    quantize: Callable[..., Tensors]  # reference quantizer: weight [out, in] -> runtime tensors (weight part)
    activation: str  # what the format does to activations: "none" | "fp8" | "int8" | "nvfp4"

    def check(self, tensors: Tensors, where: str = "linear") -> None:
        missing = [n for n in self.required if n not in tensors]
        extra = sorted(set(tensors) - set(self.required) - set(self.optional) - {"bias"})
        if missing or extra:
            raise FormatError(f"{where}: format {self.name!r} needs {list(self.required)} (optional "
                              f"{list(self.optional)}); missing {missing}, unexpected {extra}")

    def dequantize(self, tensors: Tensors, dtype: torch.dtype = torch.float32, where: str = "linear") -> torch.Tensor:
        """The dense weight [out, in] this linear multiplies by (activation quantization not modelled)."""
        self.check(tensors, where)
        return self.dense(tensors).to(dtype)


FORMATS: dict[str, WeightFormat] = {
    f.name: f
    for f in (
        WeightFormat("none", ("weight",), (), lambda t: t["weight"].float(),
                     lambda w: {"weight": w}, "none"),
        WeightFormat("fp8", ("weight", "weight_scale", "input_scale"), (),
                     lambda t: dequantize_fp8(t["weight"], t["weight_scale"]), quantize_fp8_per_row, "fp8"),
        WeightFormat("nvfp4", ("weight", "weight_scale", "weight_scale_2"), ("input_scale",),
                     lambda t: dequantize_nvfp4(t["weight"], t["weight_scale"], t["weight_scale_2"]),
                     quantize_nvfp4, "nvfp4"),
        WeightFormat("int4_awq", ("weight", "weight_scale"), ("pre_quant_scale",),
                     lambda t: _with_pre_quant_scale(dequantize_int4(t["weight"], t["weight_scale"]), t),
                     quantize_int4, "none"),
        WeightFormat("w4a8_awq", ("weight", "weight_scale", "input_scale"), ("pre_quant_scale", "weight_scale_2"),
                     lambda t: _with_pre_quant_scale(dequantize_int4(t["weight"], t["weight_scale"]), t),
                     quantize_int4, "fp8"),
        WeightFormat("int8_sq", ("weight", "weight_scale", "input_scale"), ("pre_quant_scale",),
                     lambda t: _with_pre_quant_scale(dequantize_int8(t["weight"], t["weight_scale"]), t),
                     quantize_int8_per_row, "int8"),
    )
}


def get_format(name: str) -> WeightFormat:
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        raise FormatError(f"unknown weight format {name!r}; allowed: {' | '.join(FORMATS)}") from None


def dequantize(fmt: str, tensors: Tensors, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dense weight [out, in] of one linear stored in runtime format `fmt` (see the module docstring)."""
    return get_format(fmt).dequantize(tensors, dtype)
