"""What test_tensor_parallel.py's spawned ranks import by name (``backend.runtime.tp.spawn`` pickles its
target by reference; this module keeps their imports to what the worker needs)."""
from __future__ import annotations


def greedy_worker_runs(rank: int, tp_size: int, runs: list[tuple]) -> None:
    """``backend.runtime.tp_generate.greedy_worker`` once per entry of ``runs`` (its arguments after
    ``rank, tp_size``), one after another in the same ranks: each run builds its own ``TPRunner`` from its
    own bundle, over the one gloo group of this spawn (a spawn re-imports torch in every rank and joins
    the group before anything runs)."""
    from backend.runtime.tp_generate import greedy_worker
    for args in runs:
        greedy_worker(rank, tp_size, *args)
