"""Launch-configuration sweep for `make bench-kernels BENCH_ARGS=--sweep` (GPU only).

For each tuned kernel (plugins.tuning), time every candidate configuration on the benchmark's shape
and report them all with the fastest; plugins/tuning.py is then edited by hand from the result, so a
change of tuning is a reviewed commit with its measurement. Candidates are compiled first in parallel
worker processes (Triton's JIT compiles serially; a shared cache makes the timed runs cache hits).
A candidate that fails (too much shared memory, a compile error) is recorded with its error.

    python -m harness.perf.kernels.sweep RESULT KEY        # a sweep's winner as KILN_TUNING JSON
    python -m harness.perf.kernels.sweep ncu [--case fp8-b512-ctx1536] [--cfg '{...}' ...]

``ncu``: one FP8-KV paged-decode case for Nsight Compute (`ncu -k regex:paged_decode_kernel
--launch-skip 3 --launch-count 1 --section ... python3 -m harness.perf.kernels.sweep ncu --cfg '{...}'`).
The sweep says which launch configuration is fastest; this says why: achieved DRAM bandwidth,
occupancy and what the warps wait on, for the configurations named. Each --cfg (a JSON object of
plugins.tuning "paged_decode_fp8" values) runs the case 4 times, eagerly, so ncu can skip the warm-up
launches and profile one.
"""
from __future__ import annotations

import itertools
import os
from concurrent.futures import ProcessPoolExecutor

from plugins import tuning


def _grid(**axes) -> list[dict]:
    keys = list(axes)
    return [dict(zip(keys, vals)) for vals in itertools.product(*(axes[k] for k in keys))]


CANDIDATES = {
    "paged_decode": _grid(tile=[64, 128], num_warps=[4, 8], num_stages=[2, 3], programs_per_sm=[2]),
    "paged_prefill": _grid(rows=[64, 128], tile_n=[64, 128], num_warps=[4, 8], num_stages=[2, 3]),
    # the dot dtypes (plugins/paged_decode.py): bf16, fp16 (dot_f16), fp16 with V read as 16-bit words
    "paged_decode_fp8": [dict(c, **m) for m in ({"dot_f16": 0, "v_u16": 0}, {"dot_f16": 1, "v_u16": 0},
                                                {"dot_f16": 1, "v_u16": 1})
                         # the H200 sweep's four best launch shapes (docs/perf/kernels-sweep-h200.json): a GPU
                         # run's minutes go to the dot dtypes
                         for c in ({"tile": 64, "num_warps": 4, "num_stages": 2}, {"tile": 128, "num_warps": 4, "num_stages": 2},
                                   {"tile": 128, "num_warps": 4, "num_stages": 3}, {"tile": 128, "num_warps": 8, "num_stages": 2})
                         for c in [dict(c, programs_per_sm=2)]],
    "w4a16_small_m": _grid(block_n=[32, 64, 128], block_k=[128, 256], num_warps=[4], num_stages=[3, 4],
                           programs_per_sm=[2], max_splits=[8]),
    "w4a16_gemv": _grid(enabled=[1], block_n=[8, 16, 32], block_k=[256, 512], num_warps=[4], num_stages=[1, 3],
                        programs_per_sm=[4], max_splits=[8]),
    "w4a16_large": _grid(block_m=[64, 128], block_n=[64, 128], block_k=[64, 128], num_warps=[4, 8],
                         num_stages=[3], split_k=[1]),
    "fp8_small_m": _grid(block_n=[32, 64, 128], block_k=[128, 256], num_warps=[4], num_stages=[3, 4, 6],
                         programs_per_sm=[2], max_splits=[8]),
    "fp8_gemv": _grid(enabled=[1], block_n=[8, 16, 32], block_k=[256, 512, 1024], num_warps=[4], num_stages=[1, 3],
                      programs_per_sm=[4], max_splits=[8]),
}
# runtime-only knobs swept at the winner of the compiled ones (no recompiles)
EXTRA = {"paged_decode": _grid(programs_per_sm=[1, 4]),
         # split_programs_per_sm only matters where the batch leaves SMs idle (the b1 ctx8192 variant)
         # heads_first: the (KV head, sequence) launch order, at the winner
         "paged_decode_fp8": _grid(heads_first=[1]) + _grid(programs_per_sm=[1, 4]) + _grid(split_programs_per_sm=[2, 8]),
         "w4a16_small_m": _grid(programs_per_sm=[1, 4], max_splits=[4, 16]),
         "w4a16_gemv": _grid(programs_per_sm=[2, 8]),
         "fp8_small_m": _grid(programs_per_sm=[1, 4], max_splits=[4, 16]),
         "fp8_gemv": _grid(programs_per_sm=[2, 8])}


def _case(name: str, variant: str):
    """A zero-argument function running kernel `name` on its benchmark shape (variant picks the KV dtype
    or the 4-bit format)."""
    from harness.perf.kernels import cases
    if name.startswith("paged_decode"):
        if "-b" in variant:   # "<kv>-b<batch>-ctx<ctx>": graphed over cache copies (the host out of the time)
            kv, b, c = variant.split("-")
            return cases.graphed(cases.decode_calls(int(b[1:]), int(c[3:]), kv)[0])[0]
        return cases.decode_case(kv=variant)
    if name == "paged_prefill":
        return cases.prefill_case()
    if name.startswith("fp8_"):
        # variant "m<M>-<N>x<K>": the small-M FP8 GEMM over weight copies (streamed from HBM), replayed as
        # a CUDA graph (eager, the host's launch cost would be what is timed)
        m, nk = variant[1:].split("-")
        n, k = map(int, nk.split("x"))
        return cases.graphed(cases.fp8_small_m_case(int(m), n, k)[0])[0]
    if name in ("w4a16_small_m", "w4a16_gemv"):
        # variant "<fmt>-m<M>": the small-M W4A16 GEMM on 4096x4096 over weight copies, graphed
        fmt, m = variant.split("-")
        return cases.graphed(cases.w4a16_small_m_calls(int(m[1:]), 4096, 4096, fmt)[0])[0]
    return cases.w4a16_case(256, 4096, 4096, variant)


# FP8 KV: a throughput run's decode step (533 sequences at 1000-2000 tokens on an H100, KV-bound) and the
# the b64 ctx2048 goal, both graphed over cache copies
VARIANTS = {"paged_decode": ("bf16",), "paged_decode_fp8": ("fp8-b512-ctx1536", "fp8-b64-ctx2048"),
            "paged_prefill": ("bf16",),
            "w4a16_small_m": ("int4_awq-m1", "nvfp4-m1", "nvfp4-m16"), "w4a16_gemv": ("int4_awq-m1", "nvfp4-m1"),
            "w4a16_large": ("int4_awq",), "fp8_small_m": ("m1-4096x4096", "m16-4096x4096", "m4-14336x4096"),
            "fp8_gemv": ("m1-4096x4096", "m1-14336x4096")}


def _warm(job: tuple[str, str, dict]) -> str | None:
    name, variant, cfg = job
    import torch
    try:
        with tuning.override(name, **cfg):
            _case(name, variant)()
        torch.cuda.synchronize()
        return None
    except Exception as exc:  # noqa: BLE001 - recorded per candidate
        return f"{type(exc).__name__}: {str(exc)[:200]}"


def sweep(names: list[str] | None = None, workers: int | None = None) -> dict:
    from harness.perf.lib.timing import median_ms as _time_ms
    names = names or list(CANDIDATES)
    jobs = [(n, v, c) for n in names for v in VARIANTS[n] for c in CANDIDATES[n]]
    workers = workers or min(12, os.cpu_count() or 1)
    import multiprocessing as mp
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        errors = dict(zip(range(len(jobs)), pool.map(_warm, jobs)))
    out = {}
    for n in names:
        for v in VARIANTS[n]:
            rows = []
            for i, (jn, jv, cfg) in enumerate(jobs):
                if (jn, jv) != (n, v):
                    continue
                if errors[i]:
                    rows.append({**cfg, "error": errors[i]})
                    continue
                with tuning.override(n, **cfg):
                    rows.append({**cfg, "ms": _time_ms(_case(n, v), iters=20)})
            ok = [r for r in rows if "ms" in r]
            best = min(ok, key=lambda r: r["ms"]) if ok else None
            if best is not None:
                for extra in EXTRA.get(n, []):
                    cfg = {**{k: best[k] for k in CANDIDATES[n][0]}, **extra}
                    try:
                        with tuning.override(n, **cfg):
                            rows.append({**cfg, "ms": _time_ms(_case(n, v), iters=20)})
                    except Exception as exc:  # noqa: BLE001
                        rows.append({**cfg, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                ok = [r for r in rows if "ms" in r]
                best = min(ok, key=lambda r: r["ms"])
            out[f"{n}/{v}"] = {"best": best, "current": dict(tuning.get(n)), "candidates": rows}
            if best:
                print(f"  sweep {n}/{v}: best {best['ms']:.4f} ms with "
                      f"{ {k: best[k] for k in CANDIDATES[n][0]} }", flush=True)
    return out


def winner(result: dict, key: str) -> dict:
    """{kernel: values} of the fastest candidate of sweep entry `key` ("<kernel>/<variant>"), as
    KILN_TUNING takes it (plugins/tuning.py): a GPU host's benchmark runs the winner in the same call."""
    if key not in result:
        raise KeyError(f"sweep has no {key!r}; it has: {', '.join(result)}")
    best = result[key]["best"]
    if best is None:
        raise ValueError(f"sweep {key}: every candidate failed")
    name = key.split("/")[0]
    return {name: {k: v for k, v in best.items() if k in tuning.get(name)}}


def ncu(argv: list[str]) -> int:
    """The ``ncu`` command: the named case under each --cfg, 4 eager launches each."""
    import argparse
    import json
    import sys
    ap = argparse.ArgumentParser(prog="python -m harness.perf.kernels.sweep ncu",
                                 description="One FP8-KV paged-decode case for Nsight Compute.")
    ap.add_argument("--case", default="fp8-b512-ctx1536", help="<kv>-b<batch>-ctx<context> (default %(default)s)")
    ap.add_argument("--cfg", action="append", default=[], help="JSON tuning values; repeat for several")
    a = ap.parse_args(argv)
    import torch

    from harness.perf.kernels.cases import decode_calls
    if not torch.cuda.is_available():
        print("decode_ncu: no NVIDIA GPU visible; run on the GPU machine under ncu", file=sys.stderr)
        return 2
    kv, b, c = a.case.split("-")
    calls = decode_calls(int(b[1:]), int(c[3:]), kv, l2_bytes=1)[0]
    for cfg in a.cfg or ["{}"]:
        values = json.loads(cfg)
        with tuning.override("paged_decode_fp8", **values):
            for _ in range(4):
                calls[0]()
            torch.cuda.synchronize()
        print(f"decode_ncu: {a.case} {values} done", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import sys
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["ncu"]:
        return ncu(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m harness.perf.kernels.sweep",
                                 description="Print a sweep's winner as KILN_TUNING JSON.")
    ap.add_argument("result", help="a JSON written by `harness.perf.kernels.gpu_kernels --sweep-only` (its \"sweep\")")
    ap.add_argument("key", help="<kernel>/<variant>, e.g. paged_decode_fp8/fp8-b512-ctx1536")
    a = ap.parse_args(argv)
    try:
        print(json.dumps(winner(json.loads(open(a.result).read())["sweep"], a.key)))
    except (OSError, ValueError, KeyError) as exc:
        print(f"kernel_sweep: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
