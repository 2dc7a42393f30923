"""CPU linear benchmark: Kiln's CPU linear path (``backend/ops/cpu_matmul.py``) against ``F.linear``
over row-major weights, SmolLM2-135M shapes, 30 layers: ``python -m harness.perf.kernels.cpu_linear``.
Writes build/perf/cpu_linear.json. The storages compared: MKL over the row-major float32 weight,
oneDNN over a column-major one, FBGEMM's fp16 GEMM, and on AVX-512 CPUs Kiln's own GEMM
(plugins/cpu/gemm.c) over fp16 panels and over the e4m3 codes themselves."""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from backend.ops.cpu_matmul import _DNN, _FP16, HalfWeight, PanelWeight, linear
from plugins.cpu import gemm as cpu_gemm


def _measure(rows: tuple[int, ...] = (1, 2, 3, 4, 5, 8, 16, 32, 64, 128, 512), reps: int = 5) -> list[dict]:
    """Time SmolLM2-135M's linears over 30 layers of distinct weights (480 MB in fp32: streamed from
    memory as in a real decode step; one layer repeated would sit in cache and flatter every kernel),
    the storages interleaved (a shared machine's noise moves whole runs), best of ``reps``. The weights are
    fp8 e4m3 codes, as an fp8 bundle's are (every storage but the e4m3 one holds their values, exact
    in fp16 as a bf16 checkpoint's weights are); the per-row scale is left out of every way."""
    torch.manual_seed(0)
    shapes = [(1728, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
    codes = [(torch.randn(s) * 3).to(torch.float8_e4m3fn) for _ in range(30) for s in shapes]
    rowmajor = [c.float() for c in codes]
    ways = {"mkl_row_major_ms": (F.linear, rowmajor)}
    if _DNN is not None:
        ways["onednn_column_major_ms"] = (linear, [w.t().contiguous().t() for w in rowmajor])
    if _FP16 is not None:
        ways["fbgemm_fp16_ms"] = (linear, [HalfWeight(w) for w in rowmajor])
    if cpu_gemm.available():
        ways["kiln_fp16_ms"] = (linear, [PanelWeight(w) for w in rowmajor])
        ways["kiln_e4m3_ms"] = (linear, [PanelWeight(c) for c in codes])
    out = []
    for m in rows:
        xs = [torch.randn(m, s[1]) for s in shapes]
        best = dict.fromkeys(ways, float("inf"))
        for _ in range(reps):
            for key, (fn, ws) in ways.items():
                t = time.perf_counter()
                for i, w in enumerate(ws):
                    fn(xs[i % 4], w)
                best[key] = min(best[key], (time.perf_counter() - t) * 1e3)
        out.append({"rows": m, **{k: round(v, 2) for k, v in best.items()}})
        print(f"rows={m:4d}  " + "   ".join(f"{k[:-3]} {v:7.1f} ms" for k, v in best.items()), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    from harness.perf.lib.results import header, write_result
    ap = argparse.ArgumentParser(description="Benchmark Kiln's CPU linear path against F.linear over "
                                             "row-major weights (SmolLM2-135M shapes, 30 layers).")
    ap.add_argument("--out", "--output", dest="out", default=None,
                    help="result JSON (default build/perf/cpu_linear.json)")
    args = ap.parse_args(argv)
    res = {**header("cpu_linear", "harness.perf.kernels.cpu_linear", argv, torch=torch),
           "what": "SmolLM2-135M linears (qkv, o, gate_up, down), 30 layers of distinct fp8 e4m3 code weights "
                   "(exact in fp16), float32 compute, best of 5; onednn_column_major is oneDNN at every row "
                   "count; kiln_* (AVX-512 CPUs) plugins/cpu/gemm.c over fp16 panels and over the codes",
           "results": _measure()}
    write_result(res, args.out, "cpu_linear.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
