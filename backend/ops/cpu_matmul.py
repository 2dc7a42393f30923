"""Dense matmuls on CPU: the weight storage and kernel that make few-row GEMMs fast.

Decoding multiplies one row per sequence by every weight; an EAGLE verify pass multiplies 2-6. On
the x86 CPUs we run on (PyTorch's MKL build; measured first on an AVX2-only one), ``F.linear`` over the row-major
float32 weight is far from memory-bound for those shapes: two rows cost 1.7x one and three 2.2x,
which alone cancels what speculation saves. Better paths, by what the weight holds:

* ``PanelWeight`` (CPUs with AVX-512): Kiln's own GEMM (plugins/cpu/gemm.c) over fp16 values or,
  for fp8 bundles, the e4m3 codes themselves at one byte each, widened in registers; the codes' row
  scale is applied in its store. The same bits as FBGEMM's fp16 GEMM below (both sum each output
  as one FMA chain over k), faster at every row count measured: SmolLM2's 30 layers of fp8 linears
  at 16 rows in 18.4 ms against FBGEMM's 27.6, at one row 6.2 against 17.3, at 512 rows 357 against
  412 (docs/perf/cpu_linear-xeon.json, 2-core Intel Xeon).
* ``HalfWeight`` (other x86 CPUs): a float32 weight whose every value is exactly a float16 (all of
  a bf16 checkpoint's matrices in practice: bf16's 8-bit significand fits fp16's 11 bits, and
  SmolLM2's weights lie in fp16's range; fp8 and int8 codes) is packed by FBGEMM as fp16 and
  multiplied by its fp16 GEMM, which widens the weights in registers and keeps activations and
  accumulation in fp32. Half the bytes read, and a kernel made for small batches: the cost barely
  grows up to three rows.
* otherwise (values that need fp32: dequantized NVFP4/INT4, fp32 checkpoints) the weight is stored
  column-major (``[in, out]`` contiguous, viewed as ``[out, in]``) and multiplied by oneDNN's
  matmul at every row count (faster than MKL at every count measured, and batch-invariant).

Measured on SmolLM2-135M's 30 layers of linears (docs/perf/cpu_linear.json, ``python -m
harness.perf.kernels.cpu_kernels linear``, 2-core AMD EPYC VM, 2 threads, 2026-11-26), ms, MKL row-major /
oneDNN column-major / FBGEMM fp16: 1 row 48 / 43 / 12, 2 rows 80 / 36 / 12, 3 rows 108 / 39 / 12,
5 rows 56 / 36 / 14, 32 rows 113 / 63 / 45, 512 rows 796 / 619 / 633. Results are ``F.linear``'s up
to fp32 summation order (tests/runtime/test_model_hf_parity.py bounds the error against float64).

Batch invariance (docs/contracts.md): a row's result must not depend on the other rows of the
matmul (the step's other sequences). The kernels used here give that, bit for bit, at every row
count (tests/runtime/test_cpu_matmul.py, test_batch_invariance.py, tests/kernels/test_cpu_gemm.py):
Kiln's GEMM by construction (one FMA chain per output, whatever the blocking), FBGEMM's fp16 GEMM padded to a
multiple of three rows where a count would end in a block of one or two (``_fp16_rows``: on AVX2 those
sum in another order), and oneDNN's matmul over a column-major weight given at least two rows (``linear`` runs a single row as two).
MKL does not: its blocking, and so the order in which a row is summed, follows the row count. So
the column-major path no longer hands 33 rows and more to MKL, as it did where MKL measured faster
on an AVX2 machine: a decode step of more than 32 sequences gave each of them other logits than a
smaller one. On the development VM oneDNN is faster than MKL at every row count measured (above).

Only float32 compute: what a CPU computes in unless ``engine.cpu_dtype`` chose bf16
(backend/runtime/cpu_dtype.py, which times these float32 kernels against oneDNN's bf16 ``F.linear``
on the model's own layer), and the only dtype measured here. Elsewhere (GPU, bf16) ``prepare``
returns the weight unchanged and ``linear`` is ``F.linear``. (Reordering a bf16 weight once into
oneDNN's blocked layout, ``torch.ops.mkldnn._reorder_linear_weight``, was tried: with the weights
cold in memory, as a decode step reads them, SmolLM2's 120 linears took 14-16 ms at one or two rows
against F.linear's 7.4-8.1, and the same from 16 rows on; measured 2026-11-27.)
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from plugins import registry

# Which of the CPU GEMMs this machine has is the kernel table's answer (plugins/registry.py, kind
# "cpu": Kiln's AVX-512 panel GEMM, oneDNN's linear, FBGEMM's fp16 GEMM); the storage a weight takes
# follows from it (``prepare``). The panel GEMM is asked when a weight is stored, not at import: the
# answer loads (and the first time compiles) the CPU kernel library.
_panel_pack = registry.load("panel_pack", "cpu")
_panel_unpack = registry.load("panel_unpack", "cpu")
_panel_gemm = registry.load("panel_gemm", "cpu")
_DNN = registry.load_if_available("onednn_linear", "cpu")
_FP16 = (None if not registry.available("fp16_gemm", "cpu") else
         tuple(registry.load(op, "cpu") for op in ("fp16_pack", "fp16_gemm", "fp16_unpack")))


def _panel() -> bool:
    return registry.available("panel_gemm", "cpu")


class HalfWeight:
    """A float32 ``[out, in]`` weight held as FBGEMM-packed fp16 (exact: see ``prepare``).

    Not a tensor: only ``linear`` multiplies by it; ``shape``, ``dtype`` (the compute dtype,
    float32) and ``device`` answer what owners ask of a weight, ``unpack`` gives the values back."""

    __slots__ = ("packed", "shape", "dtype", "device")

    def __init__(self, w: torch.Tensor) -> None:
        self.packed = _FP16[0](w.contiguous(), None)
        self.shape, self.dtype, self.device = w.shape, w.dtype, w.device

    def unpack(self) -> torch.Tensor:
        return _FP16[2](self.packed)[0].float()


class PanelWeight:
    """A float32 ``[out, in]`` weight held for Kiln's own AVX-512 GEMM (plugins/cpu/gemm.c): fp16
    values, or fp8 e4m3 codes at one byte each, in 16-column panels. Same sums, in the same order,
    as FBGEMM's fp16 GEMM on AVX-512 (tests/kernels/test_cpu_gemm.py), with the per-row scale of
    quantized weights applied in the kernel's store; see ``linear``.

    Like ``HalfWeight``, not a tensor: ``shape``, ``dtype`` (float32, the compute dtype), ``device``
    and ``unpack``."""

    __slots__ = ("panels", "fmt", "shape", "dtype", "device")

    def __init__(self, w: torch.Tensor) -> None:
        """``w``: float8_e4m3fn codes as they are, or a float32 weight every value of which is an fp16."""
        self.panels, self.fmt = _panel_pack(w if w.dtype == torch.float8_e4m3fn else w.to(torch.float16))
        self.shape, self.dtype, self.device = w.shape, torch.float32, w.device

    def unpack(self) -> torch.Tensor:
        return _panel_unpack(self.panels, self.fmt, self.shape[0])


Weight = torch.Tensor | HalfWeight | PanelWeight


def is_packed(w) -> bool:
    """Whether ``w`` is already in a CPU kernel's own storage (then shared, never copied)."""
    return isinstance(w, (HalfWeight, PanelWeight))


def applies(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether weights on ``device`` in ``dtype`` are re-stored for the CPU kernels."""
    return (_DNN is not None or _FP16 is not None or _panel()) and torch.device(device).type == "cpu" \
        and dtype == torch.float32


def packs_fp16(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether fp16-exact weights on ``device`` in ``dtype`` get a packed storage (``PanelWeight`` on
    AVX-512 CPUs, else ``HalfWeight``)."""
    return (_FP16 is not None or _panel()) and applies(device, dtype)


def packed_type() -> type:
    """The class fp16-exact float32 weights take on this CPU (where ``packs_fp16``)."""
    return PanelWeight if _panel() else HalfWeight


def packs_e4m3(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether fp8 e4m3 codes can be stored as they are (``PanelWeight``: Kiln's AVX-512 GEMM)."""
    return _panel() and applies(device, dtype)


def is_column_major(w) -> bool:
    return isinstance(w, torch.Tensor) and w.dim() == 2 and w.stride(0) == 1 and w.stride(1) == w.shape[0]


def _exact_in_fp16(w: torch.Tensor) -> bool:
    return bool(torch.equal(w.to(torch.float16).float(), w))


# What ``prepare`` made of a source tensor, by (id(source), what was derived from it): (weak reference to
# it, its _version then, the storage choice then, the result). An engine built again in this process from
# the same weight tensors (a reload; the executors a test builds over shared weights) takes the result
# instead of checking and packing every weight again, which was 95% of building a SmolLM2 executor
# (1.5-2 s on one AMD EPYC core). An entry goes with its source (weakref.finalize); a source changed in
# place since (its _version moved), an inference tensor (no version counter) or a storage choice that
# changed since (a kernel turned off) is converted anew.
_PREPARED: dict[tuple[int, str], tuple[weakref.ref, int, tuple, Weight]] = {}


def _storage_choice(w: torch.Tensor) -> tuple:
    return (packed_type() if packs_fp16(w.device, w.dtype) else None, _DNN is not None)


def _kept_as_is(w: Weight) -> bool:
    """Whether ``prepare`` returns ``w`` itself: already in a kernel's storage, or no CPU kernel's."""
    return is_packed(w) or not applies(w.device, w.dtype) or w.dim() != 2 or is_column_major(w)


def prepare(w: Weight, exact_fp16: bool = False) -> Weight:
    """``w [out, in]`` -> the same values in the storage its CPU kernel wants where ``applies``
    (a ``HalfWeight`` when every value is exactly an fp16, else column-major); otherwise ``w``.
    ``exact_fp16``: the caller knows every value is an fp16 (quantization codes), so none is checked.

    Idempotent, so a weight shared between owners (a tied lm_head, a draft reusing the target's)
    is converted once and stays one object; while ``w`` lives and is unchanged, preparing it again
    returns the same result (``_PREPARED``)."""
    return w if _kept_as_is(w) else prepare_from(w, "", lambda: w, exact_fp16)


def prepare_from(source: torch.Tensor, derived: str, make, exact_fp16: bool = False) -> Weight:
    """``prepare(make())``, remembered by ``source``, the live tensor ``make`` derives its float32 weight
    from (``derived`` names how: fp8 codes widened to float32 are a temporary that dies after each
    build, the codes stay), so building again skips ``make`` too."""
    key = (id(source), derived)
    version = None if source.is_inference() else source._version
    hit = _PREPARED.get(key)
    # (the choice for the remembered result's device and dtype: those of what make() gave)
    if (hit is not None and hit[0]() is source and version is not None and hit[1] == version
            and hit[2] == _storage_choice(hit[3])):
        return hit[3]
    w = make()
    choice = _storage_choice(w)
    if _kept_as_is(w):
        out = w                          # (make() packed it itself: fp8 codes for the AVX-512 GEMM)
    elif packs_fp16(w.device, w.dtype) and (exact_fp16 or _exact_in_fp16(w)):
        out = PanelWeight(w) if _panel() else HalfWeight(w)
    else:
        out = w.t().contiguous().t() if _DNN is not None else w
    # (only the CPU's own storages: a GPU weight made from a host tensor is not kept alive by its source)
    if out is not source and version is not None and applies(w.device, w.dtype):
        if hit is None or hit[0]() is not source:
            weakref.finalize(source, _PREPARED.pop, key, None)
        _PREPARED[key] = (weakref.ref(source), version, choice, out)
    return out


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None,
           scale: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` through the kernel ``w``'s storage was chosen for; ``scale`` (float32
    ``[out]``) multiplies each output column before the bias is added (quantized weights' row scales)."""
    if isinstance(w, PanelWeight):
        x2 = x if x.dtype == torch.float32 else x.float()
        x2 = x2.reshape(-1, x.shape[-1]) if x2.dim() != 2 else x2
        y = _panel_gemm(x2 if x2.is_contiguous() else x2.contiguous(), w.panels, w.fmt, w.shape[0], scale)
        y = y if x.dim() == 2 else y.view(*x.shape[:-1], w.shape[0])
        return y if bias is None else y.add_(bias)
    y = _linear(x, w, bias if scale is None else None)
    if scale is None:
        return y
    # in place: the product is a new tensor (or a view of one), nobody else holds it
    y = y.mul_(scale)
    return y if bias is None else y.add_(bias)


def _linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(w, HalfWeight):
        # a decode step's [rows, in] float32 input as it is: each no-op conversion or view is one more
        # dispatched op, 121 linears a step
        x2 = x if x.dtype == torch.float32 else x.float()
        if x2.dim() == 2:
            y = _fp16_rows(x2, w)
        else:
            y = _fp16_rows(x2.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], w.shape[0])   # 0 rows too
        return y if bias is None else y + bias
    if _DNN is not None and x.device.type == "cpu" and x.dtype == torch.float32 and is_column_major(w):
        # Every row count (see batch invariance above), but never one row: oneDNN multiplies a single
        # row with another kernel, which sums in another order (measured at 1536 input features and
        # more); two rows cost the same as one (the weight is read once) and agree with any count.
        if x.numel() == x.shape[-1]:
            return _DNN(_twice(x.reshape(1, -1)), w, bias, "none", [], "")[:1].view(*x.shape[:-1], -1)
        return _DNN(x, w, bias, "none", [], "")
    if x.device.type == "cpu" and x.dtype == torch.bfloat16 and x.numel() == x.shape[-1]:
        # bf16 compute (engine.cpu_dtype): F.linear switches kernels for a single row too (measured:
        # SmolLM2's down projection, 1536 inputs, gave a decode row other bits alone than among 9,
        # which broke batch invariance from layer 21); two rows agree with any count.
        return F.linear(_twice(x.reshape(1, -1)), w, bias)[:1].view(*x.shape[:-1], -1)
    return F.linear(x, w, bias)


# FBGEMM's fp16 GEMM on AVX2 (no AVX-512) splits the rows into blocks and multiplies a block of one or
# two rows with other micro-kernels than blocks of three to six, which sum in another order: a row's
# result then depended on the row count (1, 2, and rows left over at the end of 7, 14, 31, 32, 37, 38,
# ...). Those counts all leave 1 or 2 over a multiple of six, so such a count is padded (zero rows) up
# to the next multiple of three and every other count runs as it is: every row of every count 1..130,
# 255-257, 511, 1000, 1024 then gave the bits of the row alone, at SmolLM2's four shapes and 4096x4096,
# one and two threads (2026-11-27, AMD EPYC with AVX2 only). Padding every count to a multiple of three,
# as before, gave the same bits but multiplied 18 rows for a 16-sequence decode step. On AVX-512
# machines all counts agreed already; the padding is harmless there.
FP16_BLOCK_ROWS = 6


def fp16_pad_rows(n: int) -> int:
    """Zero rows ``_fp16_rows`` adds to ``n``: up to the next multiple of three when ``n`` leaves 1 or
    2 rows over a multiple of FP16_BLOCK_ROWS, else none."""
    over = n % FP16_BLOCK_ROWS
    return 3 - over if over in (1, 2) else 0


def _fp16_rows(x: torch.Tensor, w: HalfWeight) -> torch.Tensor:
    """``x [n, in] @ w.T``, with the rows ``fp16_pad_rows`` asks for added (zeros) and dropped again."""
    n = x.shape[0]
    pad = fp16_pad_rows(n)
    if pad:
        x = F.pad(x, (0, 0, 0, pad))   # zero rows below; one op where new_zeros + cat were two
    y = _FP16[1](x.contiguous(), w.packed)
    return y[:n] if pad else y


def _twice(row: torch.Tensor) -> torch.Tensor:
    """``[1, n]`` -> ``[2, n]``, the row twice: ``torch.cat`` costs 2 us where ``repeat`` costs 11-40
    (120 linears a decode step)."""
    return torch.cat((row, row))
