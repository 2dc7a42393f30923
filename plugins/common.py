"""Helpers shared by the kernels: fp8 rounding that is exact everywhere, and small host utilities."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def round_to_e4m3(x):
    """fp32 x -> fp32 holding the nearest float8_e4m3fn value (round-to-nearest-even, saturated at 448).

    Why by hand: Triton's interpreter truncates f32 -> fp8e4nv casts (e.g. 1.99 -> 1.0) and does not
    saturate, so casting the already-rounded value keeps CPU tests and GPU runs bit-identical.
    """
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    bits = x.to(tl.int32, bitcast=True)
    # normal range: keep 3 mantissa bits of fp32's 23, rounding half to even
    lsb = (bits >> 20) & 1
    rounded = ((bits + 0x7FFFF + lsb) & ~0xFFFFF).to(tl.float32, bitcast=True)
    # subnormal range of e4m3 (|x| < 2^-6): a fixed step of 2^-9, ties to even, sign kept (also of -0)
    a = tl.abs(x) * 512.0
    r = tl.floor(a + 0.5)
    r = tl.where((r - a == 0.5) & (r % 2.0 == 1.0), r - 1.0, r)
    sub = ((r / 512.0).to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < 0.015625, sub, rounded)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def scale_tensor(scale, device) -> torch.Tensor:
    """A per-layer scale (None, float or 0-d tensor) as a 1-element fp32 tensor the kernels read."""
    if scale is None:
        return torch.ones(1, dtype=torch.float32, device=device)
    if isinstance(scale, torch.Tensor):
        return scale.reshape(1).to(device=device, dtype=torch.float32)
    return torch.full((1,), float(scale), dtype=torch.float32, device=device)


def check(cond: bool, msg: str) -> None:
    """User-facing argument check: a one-line ValueError (asserts are for our own invariants)."""
    if not cond:
        raise ValueError(msg)


# ---- one launch path for JIT and ahead-of-time kernels -------------------------------------------

# version of the per-kernel .json written by plugins.aot and read by plugins.launcher
AOT_META_VERSION = 1

TORCH_TO_TRITON = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
                   torch.float8_e4m3fn: "fp8e4nv", torch.uint8: "u8", torch.int32: "i32", torch.int64: "i64"}


def variant_key(fn_name: str, constexprs: dict, num_warps: int, num_stages: int) -> str:
    """The identity of one compiled kernel variant: AOT entries are looked up by it at launch."""
    consts = ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in sorted(constexprs.items()))
    return f"{fn_name}[{consts}]w{num_warps}s{num_stages}"


@dataclass(frozen=True)
class Variant:
    """One kernel at fixed constexprs, with the Triton types of its runtime arguments (for AOT)."""
    fn: object                 # the @triton.jit function
    types: dict                # runtime argument name -> Triton type ("*bf16", "i32", "fp32", ...)
    constexprs: dict
    num_warps: int = 4
    num_stages: int = 3
    # integer arguments compiled as multiples of 16 (what Triton's JIT infers from the values it sees):
    # without it the compiler cannot prove row starts 16-byte aligned and loads one byte at a time, and
    # loads that feed tl.dot are not pipelined. plugins.launcher refuses (-> JIT) a call that breaks it.
    divisible: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        return variant_key(self.fn.__name__, self.constexprs, self.num_warps, self.num_stages)

    def signature(self) -> dict:
        """Every argument of the kernel, in order: its type, or "constexpr"."""
        names = self.fn.arg_names
        missing = set(names) - set(self.types) - set(self.constexprs)
        extra = (set(self.types) | set(self.constexprs)) - set(names)
        assert not missing and not extra, f"{self.fn.__name__}: missing {missing}, unknown {extra}"
        return {n: ("constexpr" if n in self.constexprs else self.types[n]) for n in names}


def launch(fn, grid: tuple, args: tuple, constexprs: dict, num_warps: int = 4, num_stages: int = 3, aot=None):
    """Run `fn` on `grid` with its runtime `args` (in order) and `constexprs`: through the bundle's
    ahead-of-time cubin when `aot` (a plugins.launcher.KernelSet) has this variant, else by JIT."""
    if aot is not None and aot.launch(variant_key(fn.__name__, constexprs, num_warps, num_stages), grid, args):
        return
    fn[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)


# A model dtype (engine.json model.dtype) as a Triton type name.
ACT_TYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@dataclass(frozen=True)
class EngineShapes:
    """What decides which kernel variants an engine needs. The caller builds it from the bundle's
    manifest (builder/stages/compile.py: kernel_shapes); plugins never read engine.json."""
    act: str                   # activation dtype as a Triton type name: "bf16" | "fp16" | "fp32"
    kv: str                    # KV cache element type: act or "fp8e4nv"
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    block_size: int
    quant_format: str
    group_size: int | None
    speculative: bool
    # what the architecture adds (defaults: a Llama-shaped model): some layer attends within a sliding
    # window (the window kernels are planned beside the full ones), and q/k RMS norms fused into the
    # rope + KV write: "none", "rms" (x_normed * w, Qwen3) or "rms_1p" (x_normed * (1 + w), Gemma 3)
    sliding_window: bool = False
    qk_norm: str = "none"
    # a mixture-of-experts MLP (plugins/fused_moe.py): experts per layer (0: a dense MLP) and each
    # expert's intermediate size (one rank's)
    num_experts: int = 0
    moe_intermediate_size: int = 0


def linear_in_features(e: EngineShapes) -> set[int]:
    """Every K (in_features) a linear of an engine with shapes `e` can have: QKV and gate/up (hidden), O
    (heads x head_dim), down (intermediate), and an EAGLE head's fused inputs (2 or 3 x hidden)."""
    ks = {e.hidden_size, e.intermediate_size, e.num_heads * e.head_dim}
    if e.speculative:
        ks |= {2 * e.hidden_size, 3 * e.hidden_size}
    return ks


def divisible_args(values: dict[str, set[int]]) -> tuple[str, ...]:
    """The integer arguments every value of which is a multiple of 16: what a Variant may declare
    `divisible` (compiled as multiples of 16) because the engine's shapes guarantee it. The launcher
    still checks each call and sends one that breaks it to JIT."""
    return tuple(n for n, vals in values.items() if vals and all(int(v) % 16 == 0 for v in vals))
