"""A started executor's loop thread loads the engine itself, hands load errors to the caller, and is
stopped at interpreter exit (backend/engine/loop_thread.py says why: one OpenMP team per process)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from backend.engine.executor import Executor
from backend.engine.sampling_params import SamplingParams
from backend.runtime.spec import EngineError

REPO = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def _loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kiln-executor"]


def test_the_loop_thread_builds_the_engine_it_steps(make_executor, monkeypatch):
    import backend.engine.executor as executor_module
    built_on: list[threading.Thread] = []
    real = executor_module.runner_class

    def recording(runtime):
        cls = real(runtime)

        def build(*args, **kwargs):
            built_on.append(threading.current_thread())
            return cls(*args, **kwargs)
        return build

    monkeypatch.setattr(executor_module, "runner_class", recording)
    started = make_executor()
    assert built_on == [started._thread] and started._thread.name == "kiln-executor"
    manual = make_executor(start=False)   # no thread: the caller builds and steps
    assert built_on[1] is threading.current_thread() and manual._thread is None
    # both give the same greedy tokens
    assert started.generate([[1, 2, 3]], GREEDY)[0].token_ids == manual.generate([[1, 2, 3]], GREEDY)[0].token_ids


def test_a_load_error_is_raised_to_the_caller_and_no_thread_is_left(smollm2_bundle, weights_fp32):
    before = set(_loop_threads())
    with pytest.raises(EngineError, match="engine.max_batch_size: 0"):
        Executor(smollm2_bundle, dtype=torch.float32, weights=weights_fp32, verify_hashes=False, max_batch_size=0)
    assert set(_loop_threads()) == before


def test_a_script_that_never_shuts_down_has_its_loop_joined_at_exit(smollm2_bundle):
    # atexit runs handlers last-registered first: this one, registered before the executor module
    # is imported, runs after the executor's and sees whether the loop thread is still there.
    script = textwrap.dedent(f"""
        import atexit, threading
        atexit.register(lambda: print("loop threads at exit:",
                                      sum(t.name == "kiln-executor" for t in threading.enumerate())))
        from backend.engine.executor import Executor
        from backend.engine.sampling_params import SamplingParams
        ex = Executor({str(smollm2_bundle)!r}, dtype="float32", verify_hashes=False, max_kv_tokens=256)
        ex.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        print("generated")
        """)
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.splitlines()[-2:] == ["generated", "loop threads at exit: 0"], run.stdout
