"""One decode step of the Llama-3.1-8B-shaped FP8 engine, fused vs unfused kernels, against the
bandwidth floor measured in the same run: `python -m harness.perf.step.decode_perf [--out F]` on a GPU.

In one run (part `perf` of harness/gpucheck/device.sh, sized for its 9-minute call):
  1. the fused-kernel tests on the GPU (tests/kernels/test_fused_layer.py, interpreter off);
  2. device-to-device copy bandwidth and the floor = bytes of weights read per token / bandwidth;
  3. for batch 1, 64 and 512 (``--batches``), contexts of ``--context`` tokens: one decode step
     (``ModelRunner.execute``) with the fused layer (``model.fused = True``: norm+quant, rope+KV write,
     attention writing the O projection's fp8 input, silu*up+quant) and the unfused one (the plain
     PyTorch ops around the same GEMMs and attention kernels), each eager and replayed as a CUDA
     graph (median of ``--iters``, CUDA events); batch 1 graphed vs the floor;
  4. a kernel-by-kernel profile of one eager step of each (torch.profiler: GPU time and calls per
     kernel name, summed over the step's layers, top ``--top``).
Writes build/perf/decode-perf-<gpu>.json. ``--dry-run`` runs the same code on CPU with a two-layer
tiny model under the Triton interpreter (no timing is meaningful): a check that the script works.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from harness.perf.lib import models
from harness.perf.lib.timing import median_ms

TINY = dict(models.TINY, max_position_embeddings=2048)   # the dry run's model: room for its context


def decode_inputs(runner, batch: int, context: int):
    """Metadata of one decode step: `batch` sequences with `context` cached tokens each, own blocks."""
    import torch

    from backend.ops.attention.metadata import AttentionMetadata
    dev, bs, i32 = runner.device, runner.block_size, torch.int32
    nblk = -(-(context + 1) // bs)
    if batch * nblk > runner.num_blocks:
        raise SystemExit(f"decode_perf: {batch} x {context} tokens need {batch * nblk} KV blocks; "
                         f"the pool has {runner.num_blocks}")
    tables = torch.arange(batch * nblk, dtype=i32, device=dev).view(batch, nblk)
    slots = tables[:, context // bs].long() * bs + context % bs
    meta = AttentionMetadata(
        positions=torch.full((batch,), context, dtype=torch.long, device=dev), slot_mapping=slots,
        block_tables=tables, seq_lens=torch.full((batch,), context + 1, dtype=i32, device=dev),
        query_start_loc=torch.arange(batch + 1, dtype=i32, device=dev),
        context_lens=torch.full((batch,), context, dtype=i32, device=dev), num_prefills=0, num_prefill_tokens=0,
        num_decode_tokens=batch, max_query_len=1, max_seq_len=context + 1)
    ids = torch.randint(0, runner.spec.model.vocab_size, (batch,), device=dev)
    return ids, meta, torch.arange(batch, device=dev)


def time_step(runner, batch: int, context: int, iters: int) -> dict:
    """ms of one decode step: eager, and replayed as a CUDA graph (GPU only)."""
    import torch
    ids, meta, rows = decode_inputs(runner, batch, context)
    step = lambda: runner.execute(ids, meta, rows)   # noqa: E731
    res = {"eager_ms": median_ms(step, iters, warmup=3 if runner.device.type == "cuda" else 0, device=runner.device)}
    if runner.device.type == "cuda":
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        res["graph_ms"] = median_ms(g.replay, iters, warmup=3 if runner.device.type == "cuda" else 0, device=runner.device)
        del g
    return res


def profile_step(runner, batch: int, context: int, top: int) -> list[dict]:
    """GPU time per kernel name over one eager step (after a warm-up step)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    ids, meta, rows = decode_inputs(runner, batch, context)
    runner.execute(ids, meta, rows)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        runner.execute(ids, meta, rows)
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
    rows_out = []
    for e in prof.key_averages():
        dev_us = getattr(e, "device_time_total", None)
        if dev_us is None:
            dev_us = getattr(e, "cuda_time_total", 0)
        if runner.device.type == "cuda" and not dev_us:
            continue
        if runner.device.type == "cuda" and e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        rows_out.append({"name": e.key[:120], "calls": e.count, "gpu_us": round(dev_us, 1),
                         "cpu_us": round(e.cpu_time_total, 1)})
    rows_out.sort(key=lambda r: -(r["gpu_us"] or r["cpu_us"]))
    return rows_out[:top]


def run_fused_tests() -> dict:
    from harness.perf.kernels.gpu_kernels import gpu_tests
    return gpu_tests(["tests/kernels/test_fused_layer.py", "tests/kernels/test_paged_decode.py", "-q", "-p",
                      "no:cacheprovider", "-x"], 6000)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.perf.step.decode_perf", description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 512])
    ap.add_argument("--context", type=int, default=1024, help="cached tokens per sequence (default 1024)")
    ap.add_argument("--iters", type=int, default=30, help="timed steps per configuration (median)")
    ap.add_argument("--top", type=int, default=25, help="kernels kept in each profile")
    ap.add_argument("--modes", nargs="+", choices=["fused", "unfused"], default=["fused", "unfused"],
                    help="decoder layers to time (default both; the speedup needs both)")
    ap.add_argument("--skip-tests", action="store_true", help="do not run the fused-kernel tests first")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU: tiny model, Triton interpreter, 1 iteration (checks the script, times nothing)")
    ap.add_argument("--out", "--output", dest="out", help="result JSON (default build/perf/decode-perf-<gpu>.json)")
    a = ap.parse_args(argv)
    if a.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        a.batches, a.context, a.iters, a.skip_tests = [1, 2], 40, 1, True
    import torch
    if not a.dry_run and not torch.cuda.is_available():
        print("decode_perf: no NVIDIA GPU visible; run on the GPU machine (or --dry-run here)", file=sys.stderr)
        return 2
    import json

    from backend.runtime.native import ModelRunner
    from backend.runtime.spec import load_engine_spec
    from harness.perf.lib.results import gpu_slug, header, write_result
    device = torch.device("cpu" if a.dry_run else "cuda")
    res = {**header("decode-perf", "harness.perf.step.decode_perf", argv, torch=torch),
           "what": "one decode step, fused vs unfused decoder layer, vs the bandwidth floor",
           "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)",
           "context": a.context, "batches": a.batches, "kiln_tuning": os.environ.get("KILN_TUNING") or None}
    if not a.skip_tests:
        res["tests"] = run_fused_tests()
        print(f"fused kernel tests on the GPU: {res['tests']['summary']}", flush=True)
    if device.type == "cuda":
        from harness.perf.kernels.gpu_kernels import copy_bandwidth_gbs
        res["copy_gbs"] = copy_bandwidth_gbs()
    m = dict(models.LLAMA31_8B, **(TINY if a.dry_run else {}))
    need = max(a.batches) * (-(-(a.context + 1) // 16)) * 16 + 64
    engine = {"max_batch_size": max(a.batches), "max_num_tokens": max(256, max(a.batches)), "max_seq_len": a.context + 16,
              "max_input_len": a.context + 8, "kv_block_size": 16, "kv_cache_dtype": "fp8_e4m3",
              "max_kv_tokens": need, "attention_backend": "triton", "cuda_graphs": False}
    weights = models.synthetic_fp8_weights(m, device=device.type)
    wbytes = models.weight_bytes_per_token(weights)
    res["weights_gib"] = wbytes / 2**30
    kv_bytes = a.context * m["num_layers"] * 2 * m["num_kv_heads"] * m["head_dim"]   # fp8 KV: 1 byte each
    res["kv_gib_per_sequence"] = kv_bytes / 2**30
    if "copy_gbs" in res:
        res["floor_ms_per_token"] = wbytes / (res["copy_gbs"] * 1e9) * 1e3
        print(f"copy {res['copy_gbs']:.0f} GB/s, weights {res['weights_gib']:.2f} GiB -> floor "
              f"{res['floor_ms_per_token']:.3f} ms/token", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = models.manifest_bundle(m, engine, Path(tmp) / "engine")
        runner = ModelRunner(load_engine_spec(path), device, torch.bfloat16, weights=weights)
        del weights
        assert runner.model.fused, "the triton attention backend runs the fused layer"
        for mode in a.modes:
            runner.model.fused = mode == "fused"
            for b in a.batches:
                r = time_step(runner, b, a.context, a.iters)
                if "floor_ms_per_token" in res and "graph_ms" in r:
                    r["graph_vs_floor"] = r["graph_ms"] / res["floor_ms_per_token"]
                    # a large batch also reads every sequence's KV: the step's own floor counts both
                    r["step_floor_ms"] = (wbytes + b * kv_bytes) / (res["copy_gbs"] * 1e9) * 1e3
                    r["graph_vs_step_floor"] = r["graph_ms"] / r["step_floor_ms"]
                res[f"{mode}_b{b}"] = r
                print(f"{mode} batch {b}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()), flush=True)
            res[f"profile_{mode}_b1"] = profile_step(runner, 1, a.context, a.top)
        runner.model.fused = True
        # where a throughput run's time goes: the fused step at the largest batch, kernel by kernel
        if max(a.batches) > 1 and "fused" in a.modes:
            res[f"profile_fused_b{max(a.batches)}"] = profile_step(runner, max(a.batches), a.context, a.top)
        for b in a.batches if len(a.modes) == 2 else ():
            f, u = res[f"fused_b{b}"], res[f"unfused_b{b}"]
            key = "graph_ms" if "graph_ms" in f else "eager_ms"
            res[f"speedup_b{b}"] = u[key] / f[key]
            print(f"batch {b}: fused {f[key]:.3f} ms vs unfused {u[key]:.3f} ms ({key}) -> {res[f'speedup_b{b}']:.2f}x",
                  flush=True)
    if device.type == "cuda":
        res["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if a.dry_run and not a.out:
        print(json.dumps({k: v for k, v in res.items() if not k.startswith("profile")}, indent=1))
        return 0
    write_result(res, a.out, f"decode-perf-{gpu_slug(res['gpu'])}.json", indent=1)
    return 0 if res.get("tests", {}).get("passed", True) else 1


if __name__ == "__main__":
    sys.exit(main())
