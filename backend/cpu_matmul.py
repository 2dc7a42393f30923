"""Dense matmuls on CPU: the weight layout and kernel that make few-row GEMMs fast.

Decoding multiplies one row per sequence by every weight; an EAGLE verify pass multiplies 2-6. On
the x86 CPUs we run on (AVX2, no AVX-512; PyTorch's MKL build), ``F.linear`` over the row-major
``[out, in]`` weight is far from memory-bound for those shapes: two rows cost 1.7x one and three
2.1x, which alone cancels what speculation saves. oneDNN's matmul over the same weight stored
column-major (``[in, out]`` contiguous, viewed as ``[out, in]``) is faster for every row count up to
a few dozen, and grows more gently: 1.3x for two rows, 1.4x for three. Measured on
SmolLM2-135M's 30 layers of linears (docs/perf/cpu_linear.json, ``python -m backend.cpu_matmul``):
1 row 46 -> 27 ms, 2 rows 79 -> 34, 3 rows 96 -> 37, 5 rows 62 -> 45, 8 rows 75 -> 49; the 49152-row
lm_head 10 -> 4 ms for one row. From a few dozen rows on (prefill) MKL's GEMM is as fast, so the
kernel is chosen by row count over the one stored layout, and no weight is kept twice (except a
tied lm_head, see backend/model/llama.py). The price: MKL over the column-major layout is 4-10 %
slower than over rows at 64-128 rows, level at 512.

Only float32: it is what CPUs without native bf16 compute in (``runner.compute_dtype``), and the
only dtype measured here. Elsewhere (GPU, bf16) both functions leave everything as it was.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# Rows up to which oneDNN is used: ahead of MKL up to 32 rows, behind from 64.
SMALL_ROWS = 32


def _onednn_linear():
    """PyTorch's oneDNN linear, or None in a build without it (then F.linear does everything)."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


_DNN = _onednn_linear()


def applies(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether weights on ``device`` in ``dtype`` take the column-major layout and oneDNN path."""
    return _DNN is not None and torch.device(device).type == "cpu" and dtype == torch.float32


def is_column_major(w: torch.Tensor) -> bool:
    return w.dim() == 2 and w.stride(0) == 1 and w.stride(1) == w.shape[0]


def prepare(w: torch.Tensor) -> torch.Tensor:
    """``w [out, in]`` -> the same values, column-major where ``applies``; otherwise ``w`` itself.

    Idempotent, so a weight shared between owners (a tied lm_head, a draft reusing the target's)
    is converted once and stays one tensor."""
    if not applies(w.device, w.dtype) or w.dim() != 2 or is_column_major(w):
        return w
    return w.t().contiguous().t()


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)``, through oneDNN for a few rows over a ``prepare``d weight."""
    if (_DNN is not None and x.device.type == "cpu" and x.dtype == torch.float32
            and is_column_major(w) and x.numel() <= SMALL_ROWS * x.shape[-1]):
        return _DNN(x, w, bias, "none", [], "")
    return F.linear(x, w, bias)


def _measure(rows: tuple[int, ...] = (1, 2, 3, 4, 5, 8, 16, 32, 64, 128, 512), reps: int = 6) -> list[dict]:
    """Time SmolLM2-135M's linears over 30 layers of distinct weights (480 MB: streamed from DRAM as
    in a real decode step; one layer's weights repeated would sit in cache and flatter every kernel),
    both layouts interleaved (this VM's noise moves whole runs), best of ``reps``."""
    import time
    torch.manual_seed(0)
    shapes = [(1728, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
    rowmajor = [torch.randn(s) for _ in range(30) for s in shapes]
    colmajor = [prepare(w) for w in rowmajor]
    out = []
    for m in rows:
        xs = [torch.randn(m, s[1]) for s in shapes]
        best = {"mkl_row_major_ms": float("inf"), "kiln_ms": float("inf")}
        for _ in range(reps):
            for key, ws, fn in (("mkl_row_major_ms", rowmajor, F.linear), ("kiln_ms", colmajor, linear)):
                t = time.perf_counter()
                for i, w in enumerate(ws):
                    fn(xs[i % 4], w)
                best[key] = min(best[key], (time.perf_counter() - t) * 1e3)
        out.append({"rows": m, **{k: round(v, 2) for k, v in best.items()}})
        print(f"rows={m:4d}  MKL row-major {best['mkl_row_major_ms']:8.1f} ms   "
              f"kiln {best['kiln_ms']:8.1f} ms", flush=True)
    return out


if __name__ == "__main__":
    import argparse
    import datetime as dt
    import json
    import os
    import pathlib
    import platform

    from backend.perfinfo import cpu_model, git_commit
    ap = argparse.ArgumentParser(description="Benchmark Kiln's CPU linear path against F.linear over "
                                             "row-major weights (SmolLM2-135M shapes, 30 layers).")
    ap.add_argument("--out", default="docs/perf/cpu_linear.json", help="where to write the results")
    args = ap.parse_args()
    res = {"benchmark": "cpu_linear", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "command": "python -m backend.cpu_matmul --out " + args.out, "commit": git_commit(),
           "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
                       "python": platform.python_version(), "torch": torch.__version__},
           "what": "SmolLM2-135M linears (qkv, o, gate_up, down), 30 layers of distinct weights, float32, best of 6",
           "small_rows_threshold": SMALL_ROWS, "results": _measure()}
    pathlib.Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {args.out}")
