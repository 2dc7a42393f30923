"""The whole engine step's host work, through ``Executor.step`` with a model that costs nothing.

``harness.perf.step.host_overhead``'s ``decode`` and ``churn`` scenarios time the scheduler, the block manager
and input preparation alone. A served step does more on the same thread, once per running request:
the sampler's per-row parameters, ``update``, the overlapped loop's late tokens (placeholders filled
one step later, ``backend/engine/late_tokens.py``) and one event per request to its handle. On a GPU
that work decides whether the host keeps up with the device at large batches: with overlap
scheduling it must fit inside the device's step, without it (speculative decoding) it adds to it.

Here the executor is real (bundle, scheduler, preparer, sampler, events, both loops) and only the
forward is replaced: ``runner.execute`` returns ``harness.perf.lib.models.StubModel``'s logits (vocabulary
``STUB_VOCAB``, so the greedy argmax stands in for a device op, not for a real vocabulary's sampling
on the CPU). Every request decodes greedily for the whole window (none finishes), as in the
``decode`` scenario.
"""
from __future__ import annotations

import contextlib
import random
import tempfile
import time
import types
from pathlib import Path

import numpy as np


@contextlib.contextmanager
def executor_stepper(overlap: bool, num_seqs: int, block_size: int, max_seq_len: int, max_num_tokens: int,
                     seed: int, engine=None):
    """An executor with ``num_seqs`` greedy requests of 32-512 prompt tokens, warmed up until every
    one decodes. Yields (executor, warm-up steps); shuts it down on exit. ``engine``: a namespace
    with ``Executor`` and ``SamplingParams`` (another revision's, ``overhead_ab``); None: this
    tree's. The other arguments are ``harness.perf.step.host_overhead``'s."""
    from harness.perf.lib.models import STUB_VOCAB, TINY, StubModel, manifest_bundle, synthetic_fp8_weights
    from harness.perf.throughput.gpu import drop_event
    if engine is None:
        from backend.engine.executor import Executor
        from backend.engine.sampling_params import SamplingParams
        engine = types.SimpleNamespace(Executor=Executor, SamplingParams=SamplingParams)

    model = dict(TINY, vocab_size=STUB_VOCAB, max_position_embeddings=max_seq_len)
    config = {"max_batch_size": num_seqs, "max_num_tokens": max_num_tokens, "max_seq_len": max_seq_len,
              "max_input_len": 512, "kv_block_size": block_size, "kv_cache_dtype": "fp8_e4m3",
              "enable_prefix_caching": True, "enable_chunked_prefill": True,
              "scheduler_policy": "max_utilization", "overlap_scheduling": overlap,
              "max_kv_tokens": num_seqs * max_seq_len + 64 * block_size}
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        bundle = manifest_bundle(model, config, Path(tmp) / "engine")
        ex = engine.Executor(bundle, weights=synthetic_fp8_weights(model, device="cpu"), start=False,
                             verify_hashes=False, speculative=False)
        try:
            stub = StubModel(max_num_tokens, STUB_VOCAB)
            ex.runner.execute = lambda ids, meta, rows, capture_hidden_layers=(): (stub(ids, meta, rows), {})
            # nobody finishes inside the window (as in the decode scenario)
            params = engine.SamplingParams(max_tokens=max_seq_len - 513, temperature=0.0, ignore_eos=True)
            for _ in range(num_seqs):
                # events go to a callback that drops them, as a server's consumer takes them: a handle
                # keeping them would grow the heap Python's collector scans, step after step
                ex.submit([rng.randrange(3, STUB_VOCAB) for _ in range(rng.randrange(32, 513))], params,
                          on_event=drop_event)
            warm = 0
            sched = ex.scheduler
            while sched.num_waiting or any(r.is_prefill for r in sched.running) or warm < 20:
                ex.step()
                warm += 1
                assert warm < 10_000
            yield ex, warm
        finally:
            ex.shutdown()


def run_executor_scenario(overlap: bool, num_seqs: int, steps: int, block_size: int, max_seq_len: int,
                          max_num_tokens: int, seed: int, profile=None) -> dict:
    """``num_seqs`` greedy requests decoding; ``steps`` executor steps timed (wall and thread CPU)."""
    with executor_stepper(overlap, num_seqs, block_size, max_seq_len, max_num_tokens, seed) as (ex, warm):
        wall, cpu = [], []
        if profile is not None:
            profile.enable()
        for _ in range(steps):
            c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            n = ex.step()
            wall.append(time.perf_counter_ns() - t0)
            cpu.append(time.thread_time_ns() - c0)
            assert n == num_seqs, f"{n} sequences in a step of the window; every one of {num_seqs} decodes"
        if profile is not None:
            profile.disable()
    w = np.array(wall, dtype=np.float64) / 1e6
    c = np.array(cpu, dtype=np.float64) / 1e6
    overlap = ex.overlap is not None
    return {"steps": steps, "warmup_steps": warm, "mean_batch_size": float(num_seqs),
            "loop": "overlapped" if overlap else "synchronous",
            "host_overhead_ms_per_step": {"mean": float(w.mean()), "p50": float(np.percentile(w, 50)),
                                          "p99": float(np.percentile(w, 99))},
            "cpu_ms_per_step": {"mean": float(c.mean()), "p50": float(np.percentile(c, 50)),
                                "p99": float(np.percentile(c, 99))},
            "us_per_sequence_p50": round(float(np.percentile(w, 50)) * 1e3 / num_seqs, 2)}


__all__ = ["executor_stepper", "run_executor_scenario"]
