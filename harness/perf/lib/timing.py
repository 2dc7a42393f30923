"""The one timing helper of the benchmarks: milliseconds per call of a function.

    median_ms(fn, iters=50, warmup=5)                 # GPU: CUDA events around each call, the median
    median_ms(fn, iters=30, warmup=0, device="cpu")   # CPU: wall clock over all calls, the mean

On a GPU each call is timed by events on the stream (the host's launch cost overlaps the device's
work, as in serving), after ``warmup`` untimed calls (compilation, allocator). On a CPU one call is
too short for the clock and too noisy alone, so the calls are timed together.
"""
from __future__ import annotations

import time


def median_ms(fn, iters: int = 50, warmup: int = 5, device: str = "cuda") -> float:
    if getattr(device, "type", device) != "cuda":
        for _ in range(warmup):
            fn()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters * 1e3
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]
