"""`make bench-kernels` needs a GPU: without one it must stop at once with a clear message (status 2)."""
import os

import pytest
import torch

from harness.perf.kernels import gpu_kernels as bench


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_bench_refuses_without_gpu(capsys):
    assert bench.main([]) == 2
    assert "no NVIDIA GPU visible" in capsys.readouterr().err


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="--dry-run is the CPU (interpreter) check of the bench; on a GPU the bench itself runs")
def test_dry_run_runs_the_graphed_cases_on_cpu(capsys):
    """--dry-run: the FP8-KV decode and small-M W4A16 cases the GPU bench graphs, once each at toy sizes
    in the interpreter, against their references (split-K counters back at 0)."""
    assert bench.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "dry-run: ok" in out and out.count("dry-run w4a16") == 6 and out.count("dry-run decode") == 2


def test_sweep_cases_name_tuned_kernels():
    """Every sweep entry is a plugins.tuning key, and its runtime-only extras are keys of that entry."""
    from harness.perf.kernels import sweep as kernel_sweep
    from plugins import tuning
    assert set(kernel_sweep.CANDIDATES) == set(kernel_sweep.VARIANTS) <= set(tuning.GPU)
    for name, extras in kernel_sweep.EXTRA.items():
        for extra in extras:
            assert set(extra) <= set(tuning.get(name)), (name, extra)
    for name, cands in kernel_sweep.CANDIDATES.items():
        assert set(cands[0]) <= set(tuning.get(name)), name


def test_kiln_tuning_env_replaces_values_and_refuses_unknown_keys():
    """KILN_TUNING (how a lent GPU's benchmark runs a sweep's winner) changes only what it names, and a
    typo is an error naming the allowed keys, never silently ignored."""
    import copy

    from harness.perf.kernels import sweep as kernel_sweep
    from plugins import tuning
    saved = copy.deepcopy(tuning.GPU)
    try:
        tuning.apply_env({"KILN_TUNING": '{"paged_decode_fp8": {"dot_f16": 1, "tile": 64}}'})
        assert tuning.get("paged_decode_fp8")["dot_f16"] == 1 and tuning.get("paged_decode_fp8")["tile"] == 64
        assert tuning.get("paged_decode") == saved["paged_decode"]
        with pytest.raises(ValueError, match="allowed: tile, num_warps"):
            tuning.apply_env({"KILN_TUNING": '{"paged_decode_fp8": {"dotf16": 1}}'})
        with pytest.raises(ValueError, match="no kernel 'paged'"):
            tuning.apply_env({"KILN_TUNING": '{"paged": {}}'})
    finally:
        tuning.GPU.clear()
        tuning.GPU.update(saved)
    # the sweep's winner in that form: the fastest candidate's tuning keys, not its time
    res = {"paged_decode_fp8/fp8-b512-ctx1536": {"best": {"tile": 64, "dot_f16": 1, "ms": 0.5}}}
    assert kernel_sweep.winner(res, "paged_decode_fp8/fp8-b512-ctx1536") == {"paged_decode_fp8": {"tile": 64, "dot_f16": 1}}
    with pytest.raises(KeyError, match="sweep has no"):
        kernel_sweep.winner(res, "paged_decode_fp8/other")
