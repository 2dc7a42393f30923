"""The CPU kernels on torch tensors: each takes float32 CPU tensors and returns a new contiguous
float32 tensor, or None where it does not apply (no library: see build.py; another dtype or device;
a layout it does not take), and the caller runs its PyTorch ops instead (the same numbers:
plugins/reference/cpu.py defines them).

Why: a float32 decode step on CPU is bound by how many ops it dispatches (a SmolLM2 layer ran ~127);
fp8 fake quantization alone was ~13 of them, 4-6 times a layer. One ctypes call costs a few
microseconds, whatever the row count; at prefill sizes the kernels are also faster than the ops.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from . import build

_F32 = torch.float32
_state: list = []   # [library or None] after the first call
_attention: list = []   # [library or None] while ``using`` sets the attention kernel apart
_row_threads: list = []   # [n] while ``row_threads`` sets the elementwise kernels' thread count
_SAME = object()


def library():
    """The loaded kernels, or None (built and loaded on first use: build.load)."""
    if not _state:
        _state.append(build.load())
    return _state[0]


def attention_library():
    """The library ``paged_attention`` calls: ``library()`` unless ``using`` set it apart."""
    return _attention[0] if _attention else library()


@contextlib.contextmanager
def using(lib, attention=_SAME) -> Iterator[None]:
    """Run with ``lib`` as the loaded kernels (None: the PyTorch ops), then with what was there: for
    benchmarks and tests that compare the two ways in one process. ``attention``: the library for the
    attention kernel alone, when it differs (its PyTorch path gives other bits: attention.c)."""
    before, before_attention = library(), list(_attention)
    _state[:] = [lib]
    _attention[:] = [] if attention is _SAME else [attention]
    try:
        yield
    finally:
        _state[:] = [before]
        _attention[:] = before_attention


@contextlib.contextmanager
def row_threads(n: int) -> Iterator[None]:
    """Give the elementwise kernels ``n`` threads instead of PyTorch's count (kernels.c shares a
    prefill-sized call's rows out between them; the bits are the same either way): for the benchmark
    that compares one thread with the team in one process (``harness.perf.kernels.cpu_kernels --row-threads``)."""
    before = list(_row_threads)
    _row_threads[:] = [n]
    try:
        yield
    finally:
        _row_threads[:] = before


def _threads() -> int:
    return _row_threads[0] if _row_threads else torch.get_num_threads()


def _rows(x: torch.Tensor) -> tuple[int, int, int] | None:
    """``(rows, cols, row stride)`` reading ``x`` as rows of its dims after the first, if the kernels
    can read it in place: float32 on CPU, every dim but the first contiguous (a column slice of a
    fused GEMM output is; its rows are ``stride`` floats apart)."""
    if x.dtype is not _F32 or x.device.type != "cpu" or x.dim() == 0:
        return None
    if x.dim() == 1:
        return (1, x.shape[0], x.shape[0]) if x.stride(0) == 1 or x.shape[0] < 2 else None
    cols = 1
    for d in range(x.dim() - 1, 0, -1):
        if x.shape[d] != 1 and x.stride(d) != cols:
            return None
        cols *= x.shape[d]
    return x.shape[0], cols, (x.stride(0) if x.shape[0] > 1 else cols)


def fake_quant_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor | None:
    """``fake_quant_fp8_ref(x, scale)``; rows of ``x`` may be strided (a column slice)."""
    lib = library()
    rx = _rows(x) if lib is not None else None
    if rx is None:
        return None
    rows, cols, stride = rx
    y = torch.empty(x.shape, dtype=_F32)
    if rows and cols:
        lib.kiln_fake_quant_fp8(x.data_ptr(), stride, y.data_ptr(), rows, cols, float(scale), _threads())
    return y


def mul_fake_quant_fp8(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor | None:
    """``mul_fake_quant_fp8_ref(a, b, scale)`` for ``a``, ``b`` of one shape (rows may be strided)."""
    lib = library()
    if lib is None or a.shape != b.shape:
        return None
    ra, rb = _rows(a), _rows(b)
    if ra is None or rb is None:
        return None
    y = torch.empty(a.shape, dtype=_F32)
    if ra[0] and ra[1]:
        lib.kiln_mul_fake_quant_fp8(a.data_ptr(), ra[2], b.data_ptr(), rb[2], y.data_ptr(), ra[0], ra[1], float(scale),
                                    _threads())
    return y


def write_kv_fp8(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor, k_scale: float, v_scale: float) -> bool:
    """``k_cache[slots] = fake_quant_fp8_ref(k, k_scale)``, the same for ``v`` (a slot < 0: not
    written), in one call: ``k``, ``v`` ``[T, ...]`` float32 (rows may be strided), the caches float32
    contiguous, ``[slots, ...]`` with ``k``'s row size, ``slots`` int64 ``[T]``. False where it does not
    apply (nothing written): the caller runs fake_quant and index_copy_."""
    lib = library()
    if lib is None or k.shape != v.shape or k_cache.shape != v_cache.shape:
        return False
    rk, rv = _rows(k), _rows(v)
    if (rk is None or rv is None or k_cache.dtype is not _F32 or v_cache.dtype is not _F32
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or k_cache.numel() != k_cache.shape[0] * rk[1]
            or slots.dtype is not torch.int64 or slots.shape != (rk[0],) or not slots.is_contiguous()):
        return False
    if rk[0] and rk[1]:
        lib.kiln_write_kv_fp8(k.data_ptr(), rk[2], v.data_ptr(), rv[2], k_cache.data_ptr(), v_cache.data_ptr(),
                              slots.data_ptr(), rk[0], rk[1], float(k_scale), float(v_scale), _threads())
    return True


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """``rope_ref(x, cos, sin)``: ``x [T, H, D]`` with contiguous heads (rows may be strided: the q|k
    columns of a fused qkv), ``cos``/``sin`` ``[T, 1, D]`` or ``[T, D]`` contiguous -> ``[T, H, D]``."""
    lib = library()
    if lib is None or x.dim() != 3 or x.dtype is not _F32 or x.device.type != "cpu":
        return None
    t, h, d = x.shape
    if (d % 2 or x.stride(2) != 1 or x.stride(1) != d or cos.dtype is not _F32 or sin.dtype is not _F32
            or not cos.is_contiguous() or not sin.is_contiguous() or cos.numel() != t * d or sin.numel() != t * d):
        return None
    y = torch.empty(t, h, d, dtype=_F32)
    if y.numel():
        lib.kiln_rope(x.data_ptr(), x.stride(0) if t > 1 else h * d, cos.data_ptr(), sin.data_ptr(), y.data_ptr(),
                      t, h, d, _threads())
    return y


# The sum order kiln_add_rms_norm reproduces is that of ATen's sum kernel over 8-float vectors: its
# AVX2 and default builds. ATen has no AVX-512 sum kernel (SumKernel.cpp registers none: slower and
# less accurate there), so a process running its AVX-512 kernels still sums with the AVX2 one:
# measured bit for bit on a Xeon with AVX-512 (tests/kernels/test_cpu_kernels.py runs wherever the
# suite runs). Any other capability (another architecture's vectors): PyTorch's own ops run.
_SUM_ORDER_KNOWN = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512", "DEFAULT", "NO AVX")
# ATen reduces serially below this many elements (at::internal::GRAIN_SIZE); above it, rows are shared
# out among threads whole while there are at least as many rows as threads, else a row is split.
_GRAIN = 32768


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 scale: torch.Tensor | float | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``add_rms_norm_ref(x, delta, weight, eps, scale)``: ``(h, y)``, ``h = x + delta`` (``x`` itself when
    ``delta`` is None), ``y`` RMSNorm of ``h``, fake-quantized with ``scale`` when one is given. ``x``,
    ``delta`` ``[T, H]`` (rows may be strided), ``weight [H]`` contiguous, H >= 8."""
    lib = library()
    if lib is None or not _SUM_ORDER_KNOWN or x.dim() != 2 or weight.dtype is not _F32 or weight.dim() != 1:
        return None
    rx = _rows(x)
    rd = _rows(delta) if delta is not None else (0, 0, 0)
    if (rx is None or rd is None or rx[1] < 8 or weight.shape[0] != rx[1] or not weight.is_contiguous()
            or (delta is not None and delta.shape != x.shape)):
        return None
    rows, cols, stride = rx
    if rows * cols >= _GRAIN and rows < torch.get_num_threads():
        return None   # ATen would split the sum of a row between threads: another order
    y = torch.empty(rows, cols, dtype=_F32)
    h = torch.empty(rows, cols, dtype=_F32) if delta is not None else x
    if rows:
        lib.kiln_add_rms_norm(x.data_ptr(), stride, delta.data_ptr() if delta is not None else None, rd[2],
                              h.data_ptr() if delta is not None else None, weight.data_ptr(), y.data_ptr(),
                              rows, cols, float(eps), scale is not None, float(scale) if scale is not None else 0.0,
                              _threads())
    return h, y


# Threads the last paged_attention call ran on (the kernel shares a call's work out itself): for tests.
last_attention_threads = 0


def attention_rows(query_start_loc: list[int], context_lens: list[int]) -> torch.Tensor:
    """``[3, T]`` int64 for ``paged_attention``: each query row's sequence, cache position (its step's
    first position plus its place in the step) and its step's first position."""
    seq, pos, ctx = [], [], []
    for i, c in enumerate(context_lens):
        n = query_start_loc[i + 1] - query_start_loc[i]
        seq += [i] * n
        pos += range(c, c + n)
        ctx += [c] * n
    return torch.tensor([seq, pos, ctx], dtype=torch.int64).view(3, -1)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    rows: torch.Tensor, tree: torch.Tensor | None, scale: float) -> torch.Tensor | None:
    """Attention of ``q [T, Hq, D]`` over the paged float32 caches ``[blocks, block_size, Hkv, D]``
    (kernel: plugins/cpu/attention.c), ``rows`` from ``attention_rows``, ``tree`` None or ``[T, M]``
    bool (which of its step's tokens a row sees) -> ``[T, Hq, D]``; None where it does not apply."""
    lib = attention_library()
    if lib is None or q.dim() != 3 or q.dtype is not _F32 or q.device.type != "cpu":
        return None
    t, hq, d = q.shape
    bs, hkv = k_cache.shape[1:3]
    if (k_cache.dtype is not _F32 or v_cache.dtype is not _F32 or k_cache.shape != v_cache.shape
            or k_cache.shape[3] != d or d % 8 or hq % hkv or q.stride(2) != 1 or q.stride(1) != d
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or block_tables.dtype is not torch.int32 or not block_tables.is_contiguous() or rows.shape != (3, t)):
        return None
    if tree is not None:
        tree = tree.contiguous().view(torch.uint8)
    out = torch.empty(t, hq, d, dtype=_F32)
    args = (q.data_ptr(), q.stride(0) if t > 1 else hq * d, k_cache.data_ptr(), v_cache.data_ptr(),
            block_tables.data_ptr(), block_tables.shape[1], rows[0].data_ptr(), rows[1].data_ptr(),
            rows[2].data_ptr(), tree.data_ptr() if tree is not None else None,
            tree.shape[1] if tree is not None else 0, out.data_ptr())
    ran = lib.kiln_paged_attention(*args, t, hq, hkv, d, bs, float(scale), torch.get_num_threads()) if t else 1
    if ran < 0:
        raise MemoryError("plugins/cpu: kiln_paged_attention could not allocate its scratch")
    global last_attention_threads
    last_attention_threads = ran
    return out
