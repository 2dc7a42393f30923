"""The compute dtype of an engine on a CPU (``engine.cpu_dtype``: auto | float32 | bfloat16).

Which is faster depends on the machine, and development machines differ from one day to the next:
on an AVX2-only CPU PyTorch emulates bf16 matmuls element by element (10x slower than fp32 at one
row, measured), while on an AVX-512 BF16 / AMX CPU oneDNN runs them natively, yet a whole decode
step in bf16 was still measured no faster than fp32 on such a machine (elementwise ops, attention and
conversions; fp32 linears run FBGEMM's fp16-packed GEMM, backend/ops/cpu_matmul.py). So ``auto``
decides by evidence, in two steps:

1. the CPU's flags (``/proc/cpuinfo``: ``avx512_bf16``, ``amx_bf16``; PyTorch's capability string
   reports only "AVX512" on some CPUs that have them, so it is not enough): without them bf16 is
   not a candidate and nothing is timed;
2. otherwise one decoder layer of the real model (its weights, its linears' storage, the attention
   backend) and the logits matmul are timed at load in each candidate (``layer_probe``: a decode
   step estimated at 1 and 16 sequences, interleaved, median of several repetitions), and bf16 is
   chosen only when it is faster by ``MARGIN``: fp32 is the exact upcast of a bf16 checkpoint and the
   numerics every parity test pins, so a tie keeps it. And only while bf16 keeps the batch
   invariance contract (``BF16_KEEPS_BATCH_INVARIANCE``, tested).

Only bf16 checkpoints (and quantized ones whose model dtype is bf16) are candidates for bf16 under
``auto``: computing an fp32 or fp16 model in bf16 would lose precision the user did not ask to
lose. ``float32`` / ``bfloat16`` are taken as given. The result (``DtypeChoice``) says what was
chosen, why, and the timings; ``python -m backend.generate --json`` prints it and the Triton engine
model exports it (``kiln_engine_compute_dtype``).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import torch

# engine.cpu_dtype -> the dtype it pins (None: decided at load)
CPU_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}
# CPU flags that give native bf16 matmuls (oneDNN uses AVX512-BF16 dot products or AMX tiles)
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# bf16 must take at most this share of fp32's time to be chosen (noise on a shared machine is
# several percent between interleaved repetitions; a tie keeps the exact fp32 numerics)
MARGIN = 0.9
# Whether bf16 compute keeps docs/contracts.md's batch invariance, so that auto may choose it. It did
# not at first (a lone decode row got other bits from bf16 F.linear's one-row kernel; cpu_matmul
# now runs one row as two); since then tests/runtime/test_batch_invariance.py passes with
# engine.cpu_dtype=bfloat16 for all five formats (2026-11-27; its fp8 bf16 case runs in CI). Set it
# False if that case fails: auto then measures and reports but computes in float32.
BF16_KEEPS_BATCH_INVARIANCE = True
CPUINFO = Path("/proc/cpuinfo")


class CpuDtypeError(ValueError):
    """engine.cpu_dtype holds a value this runtime does not know."""


@dataclass(frozen=True)
class DtypeChoice:
    """What the runner computes in and why. ``asked``: engine.cpu_dtype, or "dtype=" when the
    caller passed a dtype, or "device" on a GPU; ``timings_ms``: candidate -> {shape: median ms}."""
    dtype: torch.dtype
    asked: str
    reason: str
    timings_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    probe_s: float = 0.0          # what timing the candidates cost at load (0: nothing timed)

    def as_dict(self) -> dict:
        return {"dtype": _name(self.dtype), "asked": self.asked, "reason": self.reason,
                "timings_ms": {k: dict(v) for k, v in self.timings_ms.items()}, "probe_s": self.probe_s}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check(value: str) -> torch.dtype | None:
    """engine.cpu_dtype -> the dtype it pins, or None for auto; anything else is refused."""
    if value not in CPU_DTYPES:
        raise CpuDtypeError(f"engine.cpu_dtype: {value!r}; allowed: {', '.join(CPU_DTYPES)}")
    return CPU_DTYPES[value]


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The first processor's flags in ``/proc/cpuinfo`` text (read when not given; empty where
    there is no such file: not Linux)."""
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def bf16_flags(flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """The native-bf16 features this CPU has, from its flags; where there are no flags to read (not
    Linux), PyTorch's capability string when it names BF16 or AMX."""
    flags = cpu_flags() if flags is None else flags
    if not flags:
        cap = torch.backends.cpu.get_cpu_capability()
        return (f"torch capability {cap}",) if "BF16" in cap or "AMX" in cap else ()
    return tuple(f for f in BF16_FLAGS if f in flags)


def pick(timings_ms: Mapping[str, Mapping[str, float]], margin: float = MARGIN) -> tuple[str, str]:
    """Timings of float32 and bfloat16 (each: shape -> median ms) -> (the faster, the reason).
    A candidate's score is the sum over the shapes; bf16 wins only below ``margin`` x fp32's."""
    fp32 = sum(timings_ms["float32"].values())
    bf16 = sum(timings_ms["bfloat16"].values())
    ratio = bf16 / fp32 if fp32 > 0 else float("inf")
    if ratio <= margin:
        return "bfloat16", f"bf16 measured faster: {ratio:.2f}x fp32's decode-step time"
    return "float32", f"bf16 measured {ratio:.2f}x fp32's decode-step time (chosen at <= {margin})"


def choose(asked: str, model_dtype: torch.dtype, device: torch.device,
           time_layers: Callable[[tuple[torch.dtype, ...]], dict[str, dict[str, float]]] | None = None,
           flags: frozenset[str] | None = None, bf16_invariant: bool = BF16_KEEPS_BATCH_INVARIANCE) -> DtypeChoice:
    """The compute dtype for ``engine.cpu_dtype = asked``. ``time_layers(dtypes)`` -> {dtype name:
    {shape: median ms}} of one decoder layer in each (``layer_probe.time_layers``; tests inject
    timings); ``flags``: the CPU's (default: ``/proc/cpuinfo``); ``bf16_invariant``: whether auto
    may take bf16 (``BF16_KEEPS_BATCH_INVARIANCE``). On a GPU: the model dtype."""
    pinned = check(asked)
    if device.type != "cpu":
        return DtypeChoice(model_dtype, "device", f"{device.type}: the model dtype (engine.cpu_dtype is for CPUs)")
    if pinned is not None:
        return DtypeChoice(pinned, asked, "engine.cpu_dtype")
    if model_dtype != torch.bfloat16:
        # fp32 stays fp32; fp16 computes in fp32 (exact, and CPUs rarely have fp16 math)
        return DtypeChoice(torch.float32, asked, f"model dtype {_name(model_dtype)}: computed in float32")
    native = bf16_flags(flags)
    if not native:
        return DtypeChoice(torch.float32, asked, "no avx512_bf16 / amx_bf16 in the CPU flags: bf16 matmuls "
                                                 "would be emulated (several times slower than fp32)")
    if time_layers is None:
        return DtypeChoice(torch.float32, asked, f"{', '.join(native)} present; nothing timed: float32")
    start = time.perf_counter()
    try:
        timings = time_layers((torch.float32, torch.bfloat16))
    except Exception as exc:  # noqa: BLE001 - a failed measurement must cost speed, never the engine
        return DtypeChoice(torch.float32, asked, f"{', '.join(native)}; timing failed "
                                                 f"({type(exc).__name__}: {exc}): float32")
    name, why = pick(timings)
    if name == "bfloat16" and not bf16_invariant:
        name, why = "float32", (f"{why}, but bf16 compute does not keep batch invariance: float32 "
                                f"(engine.cpu_dtype: bfloat16 runs it anyway)")
    return DtypeChoice(CPU_DTYPES[name], asked, f"{', '.join(native)}; {why}", timings,
                       round(time.perf_counter() - start, 3))


def median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 4)
