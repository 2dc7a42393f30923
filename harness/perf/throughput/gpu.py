"""The executor on an NVIDIA GPU with a Llama-3.1-8B-shaped FP8 engine of random weights:
`python -m harness.perf.throughput.gpu [--isl 1000 --osl 1000 --num-requests 3000 --time-limit S] [--out F]`.

Speed does not depend on weight values (random weights are fine for speed), and no 8B
checkpoint can reach the GPU machine, so the weights are generated on the GPU in the bundle's runtime
layout (FP8 per-row weights, static input scales, FP8 KV scales) and handed to the Executor with a
manifest-only bundle. Measures, in one run:
  * single stream: decode ms per token against the bandwidth floor (bytes of weights read per token /
    measured device-to-device copy bandwidth); goal: within 15% of the floor;
  * throughput the way TensorRT-LLM's perf overview measures it (`trtllm-bench throughput`: 3000
    requests for ISL + OSL <= 2048, all submitted at once, ignore_eos, output tokens/s; it publishes
    15,220 tok/s on H100 and 17,744 on H200 for Llama-3.1-8B FP8 at 1000/1000): the KV pool is
    `--kv-fraction` (engine.kv_cache_free_mem_fraction, 0.95 like its kv_cache_free_gpu_mem_fraction)
    of the device memory free after the weights, max_batch_size is far above what that pool holds and
    the scheduler admits a request only when its whole life fits (guaranteed_no_evict, TensorRT-LLM's
    default capacity policy), so concurrency is bounded by KV capacity alone; CUDA graphs are captured
    up to the largest batch that runs. A run cut by `--time-limit` (or by `--budget-s`, the whole
    command's budget) reports what it did in that time and says so: requests completed, output tokens
    generated in the window, the effective limit.
`--dry-run`: a tiny model on CPU and a few short requests (the KV pool sized to hold 3 of them at
once): the benchmark's plumbing, for tests.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from harness.perf.lib.models import LLAMA31_8B, TINY, manifest_bundle, synthetic_fp8_weights, weight_bytes_per_token


def single_stream(ex, vocab: int, prompt_len: int = 128, out_len: int = 256) -> dict:
    import random

    from backend.engine.sampling_params import SamplingParams
    rng = random.Random(1)
    prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    ex.generate([prompt[:16]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm-up
    stamps = []
    h = ex.submit(prompt, params)
    t0 = time.perf_counter()
    for ev in h:
        stamps.extend([time.perf_counter()] * len(ev.token_ids))
    decode_ms = (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3
    return {"prompt_len": prompt_len, "output_len": len(stamps), "ttft_ms": (stamps[0] - t0) * 1e3,
            "decode_ms_per_token": decode_ms, "tok_s": 1e3 / decode_ms}


def overlap_ab(ex, vocab: int, *stream_args) -> dict:
    """The single stream with the overlapped loop (engine.overlap_scheduling) and without, on the same
    engine in the same run: batch 1 is where the host's share of a step shows most."""
    from backend.engine.overlap import OverlapLoop
    default = ex.overlap
    res = {}
    try:
        for name, loop in (("on", default or OverlapLoop(ex.table, ex.inputs, ex.runner, ex.sampler)), ("off", None)):
            ex.overlap = loop    # between generations the loop thread has no step in flight
            res[name] = single_stream(ex, vocab, *stream_args)
    finally:
        ex.overlap = default
    res["off_over_on"] = res["off"]["decode_ms_per_token"] / res["on"]["decode_ms_per_token"]
    return res


def throughput(ex, vocab: int, n: int, isl: int, osl: int, time_limit: float | None = None,
               poll_s: float = 0.05, window=None) -> dict:
    """``n`` requests of ``isl`` random prompt tokens and exactly ``osl`` output tokens, submitted at
    once; stops at ``time_limit`` seconds (None: when all finish) and cancels what is left. ``window``
    (``ProfileWindow`` below) profiles a few seconds of the run."""
    import math
    import random

    from backend.engine.sampling_params import SamplingParams
    rng = random.Random(2)
    population = range(vocab)
    prompts = [rng.choices(population, k=isl) for _ in range(n)]
    params = SamplingParams(max_tokens=osl, temperature=0.0, ignore_eos=True)
    before = ex.stats()
    t0 = time.perf_counter()
    if window is not None:
        # a window from the start opens before the first request: a short run can finish inside the
        # first poll, and a window opened there would hold none of its steps
        window.tick(0.0, ex.stats)
    # the events go to a callback that drops them, as a server's consumer takes them (trtllm-bench reads
    # its responses too): handles keeping 1000 events each would grow the heap Python's collector scans
    handles = [ex.submit(p, params, on_event=drop_event) for p in prompts]
    deadline = t0 + time_limit if time_limit is not None else math.inf
    pending = handles
    samples = [(0.0, before)]
    while pending:
        left = deadline - time.perf_counter()
        if left <= 0:
            break
        pending[0].wait(min(poll_s, left))
        pending = [h for h in pending if not h.finished]
        if time.perf_counter() - t0 - samples[-1][0] >= 1.0:
            samples.append((time.perf_counter() - t0, ex.stats()))
        if window is not None:
            window.tick(time.perf_counter() - t0, ex.stats)
    if window is not None:
        window.close(ex.stats())
    elapsed = time.perf_counter() - t0
    done = sum(h.finished for h in handles)
    after = ex.stats()
    generated = after["generated_tokens"] - before["generated_tokens"]
    for h in handles:
        if not h.finished:
            ex.cancel(h.request_id)
    return {"num_requests": n, "isl": isl, "osl": osl, "time_limit_s": time_limit, "completed_requests": done,
            "complete": done == n, "elapsed_s": elapsed, "output_tokens": generated,
            "output_tok_s": generated / elapsed, "completed_output_tok_s": done * osl / elapsed,
            # most sequences in one step of the engine's life (the single-stream run before has 1)
            "peak_running": after["peak_scheduled"], "preemptions": after["preemptions"] - before["preemptions"],
            "where_time_went": time_split(samples + [(elapsed, after)]),
            "profile_window": window.result() if window is not None else None}


def drop_event(event) -> None:
    """An ``on_event`` consumer that keeps nothing (the benchmarks' stand-in for a server's)."""


def time_split(samples: list[tuple[float, dict]]) -> dict:
    """Seconds, engine steps and ms per step of the run's one-second intervals that computed prompt
    tokens (prefill, maybe with decodes) and of those that only decoded, from the scheduler's counters
    sampled along the run: where a throughput run's time goes, without timing inside the engine."""
    out = {k: {"seconds": 0.0, "steps": 0, "prefill_tokens": 0, "decode_tokens": 0} for k in ("with_prefill", "decode_only")}
    for (t0, a), (t1, b) in zip(samples, samples[1:]):
        d = {k: b[k] - a[k] for k in ("steps", "prefill_tokens_computed", "decode_tokens_computed")}
        o = out["with_prefill" if d["prefill_tokens_computed"] else "decode_only"]
        o["seconds"] += t1 - t0
        o["steps"] += d["steps"]
        o["prefill_tokens"] += d["prefill_tokens_computed"]
        o["decode_tokens"] += d["decode_tokens_computed"]
    for o in out.values():
        o["ms_per_step"] = 1e3 * o["seconds"] / o["steps"] if o["steps"] else None
        o["decode_tokens_per_step"] = o["decode_tokens"] / o["steps"] if o["steps"] else None
    return out


RESERVE_S = 20.0   # of --budget-s: cancelling, shutdown and writing the result after the throughput run


def kv_summary(runner, isl: int, osl: int, fraction: float | None) -> dict:
    """The KV pool and how many requests of isl + osl tokens it holds at once (the concurrency bound)."""
    bs = runner.block_size
    per_request = -(-(isl + osl) // bs)
    return {"kv_cache_free_mem_fraction": fraction, "blocks": runner.num_blocks, "tokens": runner.num_blocks * bs,
            "gib": runner.kv_cache_bytes / 2**30, "requests_at_once": runner.num_blocks // per_request}


def main(argv: list[str] | None = None) -> int:
    t_start = time.perf_counter()
    ap = argparse.ArgumentParser(prog="python -m harness.perf.throughput.gpu", description=__doc__.splitlines()[0])
    ap.add_argument("--isl", type=int, default=1000, help="prompt tokens per request (default 1000)")
    ap.add_argument("--osl", type=int, default=1000, help="output tokens per request (default 1000)")
    ap.add_argument("--num-requests", type=int, default=3000,
                    help="requests in the throughput run (default 3000: trtllm-bench's count for ISL + OSL <= 2048)")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="stop the throughput run after this many seconds and report what it did (default: none)")
    ap.add_argument("--max-seconds", dest="time_limit", type=float, help=argparse.SUPPRESS)   # the old name
    ap.add_argument("--budget-s", type=float, default=None,
                    help="wall-clock budget of the whole command: the throughput run's time limit is cut to end "
                         f"{RESERVE_S:.0f} s before it (harness/gpucheck/device.sh passes its part's limit)")
    ap.add_argument("--kv-fraction", type=float, default=0.95,
                    help="engine.kv_cache_free_mem_fraction: KV pool = this fraction of the device memory free "
                         "after the weights (default 0.95, as TensorRT-LLM's perf overview)")
    ap.add_argument("--max-batch-size", type=int, default=4096,
                    help="engine.max_batch_size (default 4096, the builder's maximum: far above what the KV pool "
                         "holds, so KV capacity alone bounds concurrency)")
    ap.add_argument("--scheduler-policy", default="guaranteed_no_evict",
                    choices=("guaranteed_no_evict", "max_utilization"),
                    help="engine.scheduler_policy (default guaranteed_no_evict, TensorRT-LLM's default)")
    ap.add_argument("--max-num-tokens", type=int, default=8192, help="token budget of one step")
    ap.add_argument("--profile-at", type=float, default=None, metavar="S",
                    help="torch.profiler over --profile-s seconds of the throughput run, starting S s in: GPU busy "
                         "fraction, kernels and host ops per step (ProfileWindow below)")
    ap.add_argument("--profile-s", type=float, default=3.0)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-eager", action="store_true", help="single stream with CUDA graphs only")
    ap.add_argument("--skip-overlap-ab", action="store_true",
                    help="no single-stream A/B of engine.overlap_scheduling on vs off")
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny model on CPU, a few short requests, the KV pool holding 3 at once (tests)")
    ap.add_argument("--out", "--output", dest="out", help="result JSON (default build/perf/gpu-bench-<gpu>.json; dry run: none)")
    a = ap.parse_args(argv)
    import torch
    if not a.dry_run and not torch.cuda.is_available():
        print("bench_gpu: no NVIDIA GPU visible (torch.cuda.is_available() is false); run on the GPU machine "
              "(or --dry-run on CPU)", file=sys.stderr)
        return 2
    from backend.engine.executor import Executor
    from harness.perf.kernels.gpu_kernels import copy_bandwidth_gbs
    from harness.perf.lib.results import header, write_checks, write_result
    res = header("gpu-bench", "harness.perf.throughput.gpu", argv, torch=torch)
    if a.dry_run:
        res, m, device = {**res, "gpu": None, "device": "cpu"}, dict(TINY), "cpu"
        if "--isl" not in (argv if argv is not None else sys.argv):
            a.isl, a.osl = 24, 8
        a.num_requests = min(a.num_requests, 8)
        res["model"] = "dry run: tiny Llama shape on CPU, random FP8 weights (per-row), FP8 KV"
    else:
        m, device = dict(LLAMA31_8B), "cuda"
        res["model"] = "Llama-3.1-8B shape, random FP8 weights (per-row), FP8 KV, lm_head bf16"
        res["copy_gbs"] = copy_bandwidth_gbs()
    # launch configurations replaced for this run (plugins/tuning.py apply_env), if any
    res["kiln_tuning"] = os.environ.get("KILN_TUNING") or None
    seq = a.isl + a.osl
    engine = {"max_batch_size": a.max_batch_size, "max_num_tokens": max(a.max_num_tokens, a.max_batch_size),
              "max_seq_len": seq, "max_input_len": a.isl, "kv_block_size": 16, "kv_cache_dtype": "fp8_e4m3",
              "kv_cache_free_mem_fraction": a.kv_fraction, "enable_prefix_caching": False,
              "enable_chunked_prefill": True, "scheduler_policy": a.scheduler_policy,
              "attention_backend": "auto" if a.dry_run else "triton"}
    if a.dry_run:
        # CPU has no free device memory to take a fraction of: a pool of 3 whole requests instead
        engine["max_kv_tokens"] = 3 * -(-seq // 16) * 16
    res["engine"] = dict(engine)
    t0 = time.perf_counter()
    weights = synthetic_fp8_weights(m, device=device)
    res["weights_gib"] = weight_bytes_per_token(weights) / 2**30
    if "copy_gbs" in res:
        res["floor_ms_per_token"] = weight_bytes_per_token(weights) / (res["copy_gbs"] * 1e9) * 1e3
        torch.cuda.empty_cache()   # memory the weights' generation cached counts as free for the KV pool
    with tempfile.TemporaryDirectory() as tmp:
        bundle = manifest_bundle(m, engine, Path(tmp) / "engine")
        ex = Executor(bundle, device=device, weights=weights, verify_hashes=False)
        del weights
        res["load_s"] = time.perf_counter() - t0
        res["kv"] = kv_summary(ex.runner, a.isl, a.osl, None if a.dry_run else a.kv_fraction)
        print(f"KV pool: {res['kv']['tokens']} tokens ({res['kv']['gib']:.1f} GiB) = {res['kv']['requests_at_once']} "
              f"requests of {a.isl}+{a.osl} at once; max_batch_size {a.max_batch_size}", flush=True)
        try:
            graphs = ex.runner.graphs
            modes = ("cuda_graphs",) if (a.skip_eager or graphs is None) else ("cuda_graphs", "eager")
            for mode in modes:
                ex.runner.graphs = graphs if mode == "cuda_graphs" else None   # eager: the same engine without them
                ss = single_stream(ex, m["vocab_size"], *((16, 8) if a.dry_run else ()))
                res[f"single_stream_{mode}"] = ss
                floor = res.get("floor_ms_per_token")
                ss["vs_floor"] = ss["decode_ms_per_token"] / floor if floor else None
                print(f"single stream ({mode}): {ss['decode_ms_per_token']:.2f} ms/token ({ss['tok_s']:.0f} tok/s)"
                      + (f", floor {floor:.2f} ms -> {ss['vs_floor']:.2f}x floor" if floor else ""), flush=True)
            ex.runner.graphs = graphs
            if not a.skip_overlap_ab:
                ab = res["single_stream_overlap_ab"] = overlap_ab(ex, m["vocab_size"], *((16, 8) if a.dry_run else ()))
                print(f"single stream, overlap scheduling on: {ab['on']['decode_ms_per_token']:.2f} ms/token, off: "
                      f"{ab['off']['decode_ms_per_token']:.2f} ms/token ({ab['off_over_on']:.2f}x)", flush=True)
            if not a.skip_throughput:
                limit, source = a.time_limit, "--time-limit" if a.time_limit is not None else None
                if a.budget_s is not None:
                    left = a.budget_s - (time.perf_counter() - t_start) - RESERVE_S
                    if limit is None or left < limit:
                        limit, source = max(0.0, left), "--budget-s"
                window = None
                if a.profile_at is not None:
                    window = ProfileWindow(a.profile_at, a.profile_s)
                tp = throughput(ex, m["vocab_size"], a.num_requests, a.isl, a.osl, limit, window=window)
                tp["time_limit_from"] = source
                tp["kv_requests_at_once"] = res["kv"]["requests_at_once"]
                res["throughput"] = tp
                state = ("complete" if tp["complete"] else
                         f"PARTIAL: {tp['completed_requests']}/{a.num_requests} finished within the {limit:.0f} s limit")
                print(f"throughput {a.num_requests} x {a.isl}/{a.osl}: {tp['output_tok_s']:.0f} output tok/s over "
                      f"{tp['elapsed_s']:.0f} s ({state}); peak running {tp['peak_running']} "
                      f"(KV bound {tp['kv_requests_at_once']}), preemptions {tp['preemptions']}", flush=True)
                pw = tp["profile_window"]
                if pw is not None:
                    print(f"  profile window at {pw['start_s']:.0f} s: {pw['steps']} steps in {pw['wall_s']:.2f} s "
                          f"({pw['ms_per_step']} ms/step), GPU kernels busy {pw['gpu_busy']} of the time; top kernels: "
                          + ", ".join(f"{k['name'][:40]} {k['gpu_us'] / 1e3:.1f} ms" for k in pw["kernels"][:5]),
                          flush=True)
                for kind, w in tp["where_time_went"].items():
                    if w["steps"]:
                        print(f"  {kind}: {w['seconds']:.0f} s, {w['steps']} steps, {w['ms_per_step']:.1f} ms/step, "
                              f"{w['decode_tokens_per_step']:.0f} decodes + {w['prefill_tokens'] / w['steps']:.0f} "
                              "prompt tokens per step", flush=True)
            res["cuda_graphs"] = (graphs.failed or {"captured": len(graphs.graphs),
                                                    "largest_bucket": graphs.captured_batch}) if graphs is not None else "off"
            if device == "cuda":
                res["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
        finally:
            ex.shutdown()
    res["wall_s"] = time.perf_counter() - t_start
    if a.dry_run:
        if a.out:   # a dry run measures nothing worth keeping: written only where asked
            write_result(res, a.out, indent=1)
        return 0
    return write_checks(res, a.out, "gpu-bench")


# --------------------------------------------------------------------------------------------------
# A torch.profiler window inside a running benchmark: where an engine's steps spend their time.
#
#     window = ProfileWindow(start_s=60, seconds=3)      # in the benchmark's polling loop:
#     window.tick(elapsed_s, ex.stats())                  # opens, then closes the profiler
#     window.result()                                     # -> dict (None until it ran)
#
# The executor runs in its own thread: the profiler, opened from the benchmark's thread, records every
# CUDA kernel of the process in the window (CUPTI sees all streams) but not the engine thread's CPU ops,
# so this measures the device side. It answers the question a throughput run's step timings raise (an
# engine decode step took 36.8 ms on an H100 where the same model step, graphed alone, took 27.2 ms):
# is the GPU idle part of each step (host-bound, a sync), or do its kernels run longer? ``gpu_busy``
# is the kernels' summed time over the window's wall time (above 1 only where kernels overlap); the
# kernel table is per name, summed over the window, with the steps the window held.

class ProfileWindow:
    def __init__(self, start_s: float, seconds: float = 3.0, top: int = 20) -> None:
        self.start_s, self.seconds, self.top = start_s, seconds, top
        self._prof = None
        self._t0 = None
        self._stats0 = None
        self._result: dict | None = None

    def tick(self, elapsed_s: float, stats) -> None:
        """Call from the benchmark's loop with its elapsed seconds and the engine's ``stats`` method
        (called only when the window opens or closes: it takes the engine's lock)."""
        if self._result is not None:
            return
        if self._prof is None and elapsed_s >= self.start_s:
            self._open(stats())
        elif self._prof is not None and time.perf_counter() - self._t0 >= self.seconds:
            self._close(stats())

    def close(self, stats: dict) -> None:
        """End the window early (the run ended inside it)."""
        if self._prof is not None and self._result is None:
            self._close(stats)

    def result(self) -> dict | None:
        return self._result

    def _open(self, stats: dict) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._prof = profile(activities=acts)
        self._prof.__enter__()
        self._t0, self._stats0 = time.perf_counter(), stats

    def _close(self, stats: dict) -> None:
        import torch
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - self._t0
        self._prof.__exit__(None, None, None)
        kernels = []
        for e in self._prof.key_averages():
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            dev = getattr(e, "device_time_total", None)
            kernels.append({"name": e.key[:120], "calls": e.count,
                            "gpu_us": round(dev if dev is not None else getattr(e, "cuda_time_total", 0.0), 1)})
        gpu_us = sum(k["gpu_us"] for k in kernels)
        steps = stats["steps"] - self._stats0["steps"]
        kernels = sorted(kernels, key=lambda r: -r["gpu_us"])[:self.top]
        self._result = {
            "start_s": self.start_s, "wall_s": round(wall, 3), "steps": steps,
            "ms_per_step": round(1e3 * wall / steps, 2) if steps else None,
            "decode_tokens": stats["decode_tokens_computed"] - self._stats0["decode_tokens_computed"],
            "prefill_tokens": stats["prefill_tokens_computed"] - self._stats0["prefill_tokens_computed"],
            "gpu_kernel_ms": round(gpu_us / 1e3, 2),
            "gpu_busy": round(gpu_us / 1e6 / wall, 3) if wall > 0 else None,
            "kernels": kernels}
        self._prof = None


if __name__ == "__main__":
    sys.exit(main())
