"""A torch.profiler window inside a running benchmark: where an engine's steps spend their time.

    window = ProfileWindow(start_s=60, seconds=3)      # in the benchmark's polling loop:
    window.tick(elapsed_s, ex.stats())                  # opens, then closes the profiler
    window.result()                                     # -> dict (None until it ran)

The executor runs in its own thread: the profiler, opened from the benchmark's thread, records every
CUDA kernel of the process in the window (CUPTI sees all streams) but not the engine thread's CPU ops,
so this measures the device side. It answers the question a throughput run's step timings raise (an
engine decode step took 36.8 ms on an H100 where the same model step, graphed alone, took 27.2 ms):
is the GPU idle part of each step (host-bound, a sync), or do its kernels run longer? ``gpu_busy``
is the kernels' summed time over the window's wall time (above 1 only where kernels overlap); the
kernel table is per name, summed over the window, with the steps the window held.
"""
from __future__ import annotations

import time


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
