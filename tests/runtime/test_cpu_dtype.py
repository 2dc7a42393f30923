"""engine.cpu_dtype (backend/runtime/cpu_dtype.py, layer_probe.py): the choice's logic with injected CPU
flags and timings (no timed assertion), and the real probe and runner on the real SmolLM2 bundle."""
from __future__ import annotations

import pytest
import torch

from backend.runtime import cpu_dtype, layer_probe
from backend.runtime.native import ModelRunner, load_weights
from backend.runtime.spec import EngineError, load_engine_spec

CPU = torch.device("cpu")
BF16_CPU = frozenset({"fpu", "avx2", "avx512f", "avx512_bf16"})
AVX2_CPU = frozenset({"fpu", "avx2", "fma"})


def _timings(fp32_ms: float, bf16_ms: float):
    def time_layers(dtypes):
        assert dtypes == (torch.float32, torch.bfloat16)
        return {"float32": {"1 seq": fp32_ms, "16 seq": 2 * fp32_ms},
                "bfloat16": {"1 seq": bf16_ms, "16 seq": 2 * bf16_ms}}
    return time_layers


TIMED: list = []


def _never(dtypes):
    TIMED.append(dtypes)   # choose() catches a failed timing: the tests look at this list
    raise AssertionError("nothing should be timed here")


def test_cpu_flags_come_from_cpuinfo_text():
    text = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile\n\nprocessor\t: 1\nflags\t: fpu\n"
    assert cpu_dtype.cpu_flags(text) == {"fpu", "avx2", "avx512f", "avx512_bf16", "amx_tile"}
    assert cpu_dtype.bf16_flags(cpu_dtype.cpu_flags(text)) == ("avx512_bf16",)
    assert cpu_dtype.bf16_flags(frozenset({"avx2", "amx_bf16"})) == ("amx_bf16",)
    assert cpu_dtype.bf16_flags(AVX2_CPU) == ()


def test_auto_times_both_on_a_bf16_cpu_and_takes_bf16_only_beyond_the_margin():
    won = cpu_dtype.choose("auto", torch.bfloat16, CPU, _timings(10.0, 8.0), BF16_CPU, bf16_invariant=True)
    assert won.dtype == torch.bfloat16 and won.asked == "auto" and "0.80x" in won.reason
    assert won.timings_ms["bfloat16"] == {"1 seq": 8.0, "16 seq": 16.0}
    tie = cpu_dtype.choose("auto", torch.bfloat16, CPU, _timings(10.0, 9.5), BF16_CPU, bf16_invariant=True)
    assert tie.dtype == torch.float32 and "0.95x" in tie.reason   # a near tie keeps fp32's numerics
    lost = cpu_dtype.choose("auto", torch.bfloat16, CPU, _timings(10.0, 13.0), BF16_CPU, bf16_invariant=True)
    assert lost.dtype == torch.float32 and set(lost.as_dict()["timings_ms"]) == {"float32", "bfloat16"}


def test_auto_keeps_fp32_where_bf16_would_break_batch_invariance():
    faster = cpu_dtype.choose("auto", torch.bfloat16, CPU, _timings(10.0, 5.0), BF16_CPU, bf16_invariant=False)
    assert faster.dtype == torch.float32 and "0.50x" in faster.reason and "batch invariance" in faster.reason
    assert faster.timings_ms["bfloat16"]["1 seq"] == 5.0   # what bf16 would gain here is still reported
    # tests/runtime/test_batch_invariance.py's bf16-compute case is what allows the default
    default = cpu_dtype.choose("auto", torch.bfloat16, CPU, _timings(10.0, 5.0), BF16_CPU)
    assert default.dtype == (torch.bfloat16 if cpu_dtype.BF16_KEEPS_BATCH_INVARIANCE else torch.float32)


def test_a_failed_timing_keeps_fp32_and_says_why():
    choice = cpu_dtype.choose("auto", torch.bfloat16, CPU, _never, BF16_CPU)
    assert choice.dtype == torch.float32 and "timing failed (AssertionError: nothing should be timed" in choice.reason
    TIMED.clear()


def test_auto_times_nothing_where_bf16_is_not_a_candidate():
    no_bf16 = cpu_dtype.choose("auto", torch.bfloat16, CPU, _never, AVX2_CPU)
    assert no_bf16.dtype == torch.float32 and "no avx512_bf16" in no_bf16.reason and not no_bf16.timings_ms
    # an fp32 or fp16 model is not rounded to bf16 behind the user's back
    for model in (torch.float32, torch.float16):
        assert cpu_dtype.choose("auto", model, CPU, _never, BF16_CPU).dtype == torch.float32
    # the GPU computes in the model dtype, whatever the CPU key says
    gpu = cpu_dtype.choose("float32", torch.bfloat16, torch.device("cuda"), _never, BF16_CPU)
    assert gpu.dtype == torch.bfloat16 and gpu.asked == "device"
    assert not TIMED


@pytest.mark.parametrize("asked, dtype", [("float32", torch.float32), ("bfloat16", torch.bfloat16)])
def test_explicit_values_override_without_timing(asked, dtype):
    for flags in (BF16_CPU, AVX2_CPU):
        choice = cpu_dtype.choose(asked, torch.bfloat16, CPU, _never, flags)
        assert (choice.dtype, choice.asked, choice.timings_ms) == (dtype, asked, {})
    assert not TIMED


def test_unknown_values_are_refused_with_the_allowed_list():
    with pytest.raises(cpu_dtype.CpuDtypeError, match="engine.cpu_dtype: 'fp16'; allowed: auto, float32, bfloat16"):
        cpu_dtype.choose("fp16", torch.bfloat16, CPU, _never, BF16_CPU)


# ---- the real probe and runner --------------------------------------------------------------------

@pytest.fixture(scope="module")
def bf16_weights(smollm2_bundle):
    return load_weights(smollm2_bundle, CPU)   # as stored: bf16


@pytest.mark.slow
def test_probe_times_a_real_layer_in_each_dtype(smollm2_bundle, bf16_weights):
    spec = load_engine_spec(smollm2_bundle, {"max_kv_tokens": 512})
    before = torch.get_num_threads()
    t = layer_probe.time_layers(spec, bf16_weights, (torch.float32, torch.bfloat16), reps=3, budget_s=0.0)
    assert torch.get_num_threads() == before   # timed on one thread, restored
    shapes = [f"{rows} seq x {ctx} ctx" for rows, ctx in layer_probe.SHAPES]
    assert {k: list(v) for k, v in t.items()} == {"float32": shapes, "bfloat16": shapes}
    assert all(ms > 0 for v in t.values() for ms in v.values())


@pytest.mark.slow
def test_runner_computes_in_the_chosen_dtype_and_dtype_argument_wins(smollm2_bundle, bf16_weights):
    def runner(dtype=None, **engine):
        spec = load_engine_spec(smollm2_bundle, {"max_kv_tokens": 256, **engine})
        return ModelRunner(spec, "cpu", dtype, weights=bf16_weights)

    r = runner(cpu_dtype="bfloat16")
    assert r.dtype == r.model.dtype == r.kv_caches[0][0].dtype == torch.bfloat16
    assert r.dtype_choice.as_dict()["asked"] == "bfloat16"
    r = runner(torch.float32, cpu_dtype="bfloat16")   # tests pin float32 so: the argument wins
    assert r.dtype == r.model.dtype == torch.float32 and r.dtype_choice.asked == "dtype="
    auto = runner().dtype_choice          # whatever this machine measures, the runner follows it
    assert auto.asked == "auto" and auto.dtype in (torch.float32, torch.bfloat16)
    if auto.timings_ms and cpu_dtype.BF16_KEEPS_BATCH_INVARIANCE:
        assert cpu_dtype.pick(auto.timings_ms)[0] == str(auto.dtype).removeprefix("torch.")
    elif not cpu_dtype.BF16_KEEPS_BATCH_INVARIANCE:
        assert auto.dtype == torch.float32
    del r
    with pytest.raises(EngineError, match="engine.cpu_dtype: 'half'; allowed: auto, float32, bfloat16"):
        runner(cpu_dtype="half")
