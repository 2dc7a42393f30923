"""Linear layers by quantization format: ONE registry, keyed by the format names of the bundle.

Each class builds from the tensors the bundle stores for one linear (docs/contracts.md section 3,
names without the ``layers.{i}.qkv.`` prefix) and exposes ``forward(x [T, in]) -> [T, out]``.

Where the hardware has no native kernel for a format (every format on CPU), the weight is
dequantized ONCE at load to the model dtype (per-row formats, fp8 and int8, keep their codes on CPU
and scale the output rows: the codes are exact in fp16, which FBGEMM's GEMM reads fastest), and
activation quantization (W8A8 / W4A8 formats) is emulated by a quantize-dequantize round trip so
accuracy measured here (the build's verify stage) reflects what the quantized engine computes on a GPU.

On an NVIDIA GPU the 4-bit formats keep their packed weights (a quarter of the bf16 bytes, which is
what decode is bound by) and run the W4A16 Triton GEMM that ``plugins.registry`` names for the
format; FP8 runs ``torch._scaled_mm`` on Hopper or newer. NVFP4 activations are not quantized there:
Hopper has no FP4 tensor cores, so the GPU path is W4A16 (at least as accurate as the W4A4 the verify
stage measures).
"""
from __future__ import annotations

from typing import ClassVar

import torch

from backend.ops import cpu_matmul, fp8
from backend.ops.fp8 import FP8, FP8_MAX
from quant import formats


class LinearFormatError(ValueError):
    """A bundle's linear tensors do not match its declared quantization format."""


def _need(tensors: dict[str, torch.Tensor], name: str, fmt: str, where: str) -> torch.Tensor:
    if name not in tensors:
        raise LinearFormatError(f"{where}: format {fmt!r} needs tensor {name!r}; "
                                f"found: {', '.join(sorted(tensors)) or 'none'}")
    return tensors[name]


# Per-tensor static fp8 e4m3 activation quantization, returned dequantized in ``x``'s dtype
# (by table lookup on CPU: backend/ops/fp8.py).
fake_quant_fp8 = fp8.fake_quant


def has_fp8_matmul(device: torch.device) -> bool:
    """``torch._scaled_mm`` needs fp8 tensor cores: compute capability 8.9 (Ada) or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def small_m_kernel(device: torch.device) -> bool:
    """FP8 GEMMs of at most ``plugins.gemm_fp8_small.MAX_M`` rows (decode steps) run that Triton kernel
    on NVIDIA GPUs: ``torch._scaled_mm``'s tiles are sized for large M, and at small M a GEMM only
    streams its weight. Everywhere else (CPU) nothing changes."""
    return device.type == "cuda"


def _kernel(fmt: str, device: torch.device, dtype: torch.dtype):
    """The registry's Triton GEMM for a packed format (imported only when kernels are used)."""
    from plugins import registry
    return registry.get("linear", device, dtype, fmt, kind="triton")


def _w4a16_locks(n: int, device: torch.device) -> torch.Tensor:
    """The split-K counters of the small-M W4A16 GEMM (plugins/gemm_w4a16_small.py) for a weight of n
    rows: int32 zeros the kernel leaves at zero, kept by the linear (no zeroing launch per call, and
    allocated before any CUDA graph capture)."""
    from plugins.gemm_w4a16_small import lock_count
    return torch.zeros(lock_count(n), dtype=torch.int32, device=device)


def _add_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias


# Formats whose packed weights have a GEMM kernel in plugins.registry (see make_linear).
PACKED_KERNEL_FORMATS = ("nvfp4", "int4_awq", "w4a8_awq")


class QuantLinear:
    """Base: a dequantized (or native) weight, an optional bias, and ``forward``."""

    format: ClassVar[str]
    weight: cpu_matmul.Weight  # [out, in] in the compute dtype (dequantized where no native kernel)
    bias: torch.Tensor | None
    # Per-output-row scale applied after the matmul, when ``weight`` holds per-row quantization
    # codes rather than their dequantized values (see ``_per_row_codes``).
    out_scale: torch.Tensor | None = None
    # Whether ``weight`` holds codes every one of which an fp16 represents (fp8 e4m3, int8): then
    # ``cpu_matmul.prepare`` need not check it value by value (half a second a SmolLM2 load).
    codes_exact_fp16: bool = False

    def __init__(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
                 where: str = "linear", kernels: bool = False, aot=None) -> None:
        self.where = where
        self.dtype = dtype
        self.kernels = kernels          # run the format's Triton GEMM on packed weights (see make_linear)
        self.aot = aot                  # the bundle's cubins for those GEMMs (None = Triton JIT)
        self.bias = tensors["bias"].to(device=device, dtype=dtype) if "bias" in tensors else None
        try:
            formats.get_format(self.format).check(tensors, where)
            self._load(tensors, dtype, device)
        except formats.FormatError as exc:
            raise LinearFormatError(str(exc)) from exc
        # A float32 weight on CPU takes the storage of its fastest kernel (backend/ops/cpu_matmul.py:
        # packed where exact in fp16, else column-major); packed 4-bit, native fp8 and GPU weights
        # come back untouched.
        self.weight = cpu_matmul.prepare(self.weight, exact_fp16=self.codes_exact_fp16)

    def _load(self, tensors, dtype, device) -> None:
        raise NotImplementedError

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def _per_row_codes(self, codes: torch.Tensor, row_scale: torch.Tensor, dtype, device) -> bool:
        """Keep per-row-scaled codes (fp8, int8) as the weight and scale output rows instead of
        dequantizing: ``(diag(s) Q) x = diag(s) (Q x)``, equal up to rounding. Done where a packed CPU
        GEMM runs (Kiln's AVX-512 one, which also takes fp8 codes at one byte each, else FBGEMM's fp16
        one): the codes are exact in fp16, the dequantized values are not, so this is what gives
        quantized bundles the fast CPU path. False (nothing set) elsewhere."""
        if not cpu_matmul.packs_fp16(device, dtype):
            return False
        s = row_scale.to(device=device, dtype=dtype).reshape(-1)
        if s.numel() not in (1, codes.shape[0]):
            raise LinearFormatError(f"{self.where}.weight_scale: {s.numel()} values; expected 1 or one per "
                                    f"output row ({codes.shape[0]})")
        codes = codes.to(device)
        if codes.dtype == FP8 and cpu_matmul.packs_e4m3(device, dtype):
            # the codes as they are, one byte each (Kiln's AVX-512 GEMM widens them in registers)
            self.weight = cpu_matmul.prepare_from(codes, "e4m3 panels", lambda: cpu_matmul.PanelWeight(codes))
        else:
            # fp8 codes widened by fp8.dequantize's table (scale 1: the same values, 4x faster than .to),
            # then packed; remembered by the codes, so an engine built again from them skips both
            self.weight = cpu_matmul.prepare_from(
                codes, f"codes as {dtype}",
                lambda: (fp8.dequantize(codes, torch.ones(()), dtype) if codes.dtype == FP8
                         else codes.to(dtype=dtype)), exact_fp16=codes.dtype in (FP8, torch.int8))
        self.codes_exact_fp16 = codes.dtype in (FP8, torch.int8)   # e4m3: 3 mantissa bits, |x| <= 448
        self.out_scale = s.expand(codes.shape[0]).contiguous() if s.numel() == 1 else s
        return True

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T + bias`` over the dequantized weight (or the codes, then row-scaled)."""
        return cpu_matmul.linear(x, self.weight, self.bias, scale=self.out_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # Not `__call__ = forward`: that would bind the base forward and ignore subclass overrides.
        return self.forward(x)


class DenseLinear(QuantLinear):
    """Unquantized: ``weight [out, in]`` in the model dtype."""
    format = "none"

    def _load(self, tensors, dtype, device) -> None:
        self.weight = _need(tensors, "weight", self.format, self.where).to(device=device, dtype=dtype)


class FP8Linear(QuantLinear):
    """W8A8 fp8 e4m3: per-row weight scale, per-tensor static input scale. Natively (sm_89+):
    ``torch._scaled_mm``, or for at most 16 rows on NVIDIA GPUs the small-M Triton GEMM
    (``plugins/gemm_fp8_small.py``, one launch with its split-K; see ``small_m_kernel``)."""
    format = "fp8"

    def _load(self, tensors, dtype, device) -> None:
        w = _need(tensors, "weight", self.format, self.where).to(device)
        ws = _need(tensors, "weight_scale", self.format, self.where).to(device).float().reshape(-1)
        self.input_scale = _need(tensors, "input_scale", self.format, self.where).to(device).float().reshape(())
        if w.dtype != FP8:
            raise LinearFormatError(f"{self.where}.weight: fp8 format expects float8_e4m3fn, got {w.dtype}")
        if ws.numel() == 1:
            ws = ws.expand(w.shape[0])
        self.native = has_fp8_matmul(device)
        # the scale as a Python float for the CPU kernels (read once here, not at every call)
        self.input_scale_value = float(self.input_scale)
        if self.native:
            # _scaled_mm wants the weight column-major ([in, out] view of a row-major [out, in]).
            self.weight_fp8 = w
            self.weight_scale = ws.reshape(1, -1).contiguous()
            self.weight = w  # shape only
            self.small_m = None
            if small_m_kernel(device):
                from plugins import gemm_fp8_small, registry
                self.small_m = registry.get("fp8_gemm_small_m", device, dtype, kind="triton")
                self.small_m_rows = gemm_fp8_small.MAX_M
                # the kernel's split-K arrival counters: zero between launches (it resets them)
                self._locks = torch.zeros(gemm_fp8_small.lock_count(w.shape[0]), dtype=torch.int32, device=device)
        elif not self._per_row_codes(w, ws, dtype, device):
            self.weight = formats.dequantize_fp8(w, ws, dtype=dtype)

    @property
    def emulated(self) -> bool:
        """Whether activations are fake-quantized (no fp8 matmul here): then ``forward_fake_quantized``
        takes an input that already is."""
        return not self.native

    def forward_fake_quantized(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` for an input already fake-quantized with ``input_scale`` (a fused CPU kernel did
        it: ``plugins.cpu.ops.mul_fake_quant_fp8``); same numbers. Emulated linears only."""
        return self.matmul(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.native:
            return self.matmul(fake_quant_fp8(x, self.input_scale, self.input_scale_value))
        xq = (x.float() / self.input_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return self.forward_fp8(xq)

    def forward_fp8(self, xq: torch.Tensor) -> torch.Tensor:
        """``xq [T, in]``: the input already quantized with ``input_scale`` (float8_e4m3fn, by a fused
        norm or activation kernel) -> ``[T, out]`` in the model dtype; same numbers as ``forward``."""
        if not self.native:
            return self.matmul(fp8.dequantize(xq, self.input_scale, self.dtype))
        if self.small_m is not None and xq.shape[0] <= self.small_m_rows:
            out = self.small_m(xq, self.weight_fp8, self.weight_scale, self.input_scale, self.dtype,
                               locks=self._locks, aot=self.aot)
            return out + self.bias if self.bias is not None else out
        out = torch._scaled_mm(xq, self.weight_fp8.t(), scale_a=self._scale_rows(xq.shape[0]),
                               scale_b=self.weight_scale, out_dtype=self.dtype)
        return out + self.bias if self.bias is not None else out

    def _scale_rows(self, rows: int) -> torch.Tensor:
        """The per-tensor input scale as the ``[rows, 1]`` row-wise scale ``_scaled_mm`` pairs with the
        row-wise weight scale: a slice of one column kept for the largest row count so far (no
        kernel per call; grown in eager warm-up, before any CUDA graph capture)."""
        col = getattr(self, "_scale_col", None)
        if col is None or col.shape[0] < rows:
            col = self._scale_col = self.input_scale.reshape(1, 1).repeat(max(rows, 64), 1)
        return col[:rows]


class NVFP4Linear(QuantLinear):
    """NVFP4: e2m1 weights with fp8 per-16 block scales and a global scale, dequantized here.

    Activations are fake-quantized to NVFP4 with the static ``input_scale`` (W4A4) to mirror
    Blackwell's native path; with no ``input_scale`` this is weight-only (W4A16)."""
    format = "nvfp4"

    def _load(self, tensors, dtype, device) -> None:
        w = _need(tensors, "weight", self.format, self.where)
        bs = _need(tensors, "weight_scale", self.format, self.where)
        gs = _need(tensors, "weight_scale_2", self.format, self.where)
        if self.kernels:
            self.packed = {"weight": w.to(device), "weight_scale": bs.to(device),
                           "weight_scale_2": gs.to(device).float().reshape(())}
            self.weight = self.packed["weight"]   # [out, in/2]: out_features only
            self.gemm = _kernel(self.format, device, dtype)
            self._locks = _w4a16_locks(w.shape[0], device)
            self.input_scale = None               # W4A16: see the module docstring
            return
        self.weight = formats.dequantize_nvfp4(w, bs, gs, dtype=dtype).to(device)
        self.input_scale = tensors.get("input_scale")
        if self.input_scale is not None:
            self.input_scale = self.input_scale.to(device).float().reshape(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels:
            return _add_bias(self.gemm(x, **self.packed, aot=self.aot, locks=self._locks), self.bias)
        if self.input_scale is not None:
            x = formats.fake_quantize_nvfp4_activation(x, self.input_scale)
        return self.matmul(x)


class Int4AWQLinear(QuantLinear):
    """INT4 AWQ (W4A16): packed nibbles minus 8, per-group scales, optional pre-quant smoothing."""
    format = "int4_awq"

    def _load(self, tensors, dtype, device) -> None:
        w = _need(tensors, "weight", self.format, self.where)
        s = _need(tensors, "weight_scale", self.format, self.where)
        pqs = tensors.get("pre_quant_scale")
        self.input_scale = None
        if self.kernels:
            self.packed = {"weight": w.to(device), "weight_scale": s.to(device=device, dtype=dtype)}
            if pqs is not None:
                self.packed["pre_quant_scale"] = pqs.to(device=device, dtype=dtype)
            self.weight = self.packed["weight"]
            self.gemm = _kernel(self.format, device, dtype)
            self._locks = _w4a16_locks(w.shape[0], device)
            return
        self.weight = formats.dequantize_int4(w, s, dtype=dtype).to(device)
        if pqs is not None:
            # Folding the smoothing scale into the weight columns is exact: W (s * x) = (W diag s) x.
            self.weight = (self.weight.float() * pqs.to(device).float().view(1, -1)).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels:
            return _add_bias(self.gemm(x, **self.packed, aot=self.aot, locks=self._locks), self.bias)
        return self.matmul(x)


class W4A8AWQLinear(Int4AWQLinear):
    """INT4 AWQ weights with fp8 activations (static per-tensor ``input_scale``)."""
    format = "w4a8_awq"

    def _load(self, tensors, dtype, device) -> None:
        w = _need(tensors, "weight", self.format, self.where)
        s = _need(tensors, "weight_scale", self.format, self.where)
        # The activation is smoothed, then quantized: keep the smoothing separate from the weight.
        pqs = tensors.get("pre_quant_scale")
        self.pre_quant_scale = pqs.to(device=device, dtype=dtype) if pqs is not None else None
        self.input_scale = _need(tensors, "input_scale", self.format, self.where).to(device).float().reshape(())
        if self.kernels:
            self.packed = {"weight": w.to(device), "weight_scale": s.to(device=device, dtype=dtype),
                           "input_scale": self.input_scale, "pre_quant_scale": self.pre_quant_scale}
            self.weight = self.packed["weight"]
            self.gemm = _kernel(self.format, device, dtype)
            self._locks = _w4a16_locks(w.shape[0], device)
            return
        self.weight = formats.dequantize_int4(w, s, dtype=dtype).to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels:
            return _add_bias(self.gemm(x, **self.packed, aot=self.aot, locks=self._locks), self.bias)
        if self.pre_quant_scale is not None:
            x = x * self.pre_quant_scale
        return self.matmul(fake_quant_fp8(x, self.input_scale))


class Int8SQLinear(QuantLinear):
    """INT8 SmoothQuant W8A8: per-row int8 weights, per-tensor static int8 activations."""
    format = "int8_sq"

    def _load(self, tensors, dtype, device) -> None:
        w = _need(tensors, "weight", self.format, self.where).to(device)
        ws = _need(tensors, "weight_scale", self.format, self.where).to(device).float().reshape(-1)
        if w.dtype != torch.int8:
            raise LinearFormatError(f"{self.where}.weight: int8_sq format expects int8, got {w.dtype}")
        if not self._per_row_codes(w, ws, dtype, device):
            self.weight = formats.dequantize_int8(w, ws, dtype=dtype)
        self.input_scale = _need(tensors, "input_scale", self.format, self.where).to(device).float().reshape(())
        pqs = tensors.get("pre_quant_scale")
        self.pre_quant_scale = pqs.to(device=device, dtype=dtype) if pqs is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_quant_scale is not None:
            x = x * self.pre_quant_scale
        q = (x.float() / self.input_scale).round_().clamp_(-128, 127)
        return self.matmul((q * self.input_scale).to(x.dtype))


LINEAR_FORMATS: dict[str, type[QuantLinear]] = {
    cls.format: cls
    for cls in (DenseLinear, FP8Linear, NVFP4Linear, Int4AWQLinear, W4A8AWQLinear, Int8SQLinear)
}


def make_linear(fmt: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                device: torch.device | str, where: str = "linear", kernels: bool | None = None,
                aot=None) -> QuantLinear:
    """Build the linear for ``fmt``. A linear stored unquantized (an excluded module) is detected by
    its floating-point weight with no scales, whatever the bundle's format.

    ``kernels``: keep 4-bit weights packed and run the registry's Triton GEMM. None = on an NVIDIA GPU
    only (on CPU the kernels would need the Triton interpreter; tests pass True under it).
    ``aot``: the bundle's ``plugins.launcher.KernelSet``, whose W4A16 cubins the GEMM then launches."""
    if fmt not in LINEAR_FORMATS:
        raise LinearFormatError(f"engine.json: quantization.format: {fmt!r} has no runtime linear; "
                                f"allowed: {', '.join(LINEAR_FORMATS)}")
    weight = tensors.get("weight")
    if weight is not None and weight.is_floating_point() and weight.dtype != FP8 and "weight_scale" not in tensors:
        fmt = "none"
    device = torch.device(device)
    if kernels is None:
        kernels = device.type == "cuda"
    return LINEAR_FORMATS[fmt](tensors, dtype, device, where, kernels=kernels and fmt in PACKED_KERNEL_FORMATS,
                               aot=aot)
