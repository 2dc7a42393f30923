"""The engine with and without the CPU kernels (plugins/cpu): the same tokens and logprobs, bit for bit,
with every elementwise kernel running in its layers; the attention kernel against the SDPA tiles it
replaces on every call of an engine run; the on/off benchmark; the builder's compile stage."""
from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch

from plugins.cpu import build, ops

# built and loaded wherever the suite runs (CI has gcc): see test_cpu_kernels.py
LIB = ops.library()
assert LIB is not None, "plugins/cpu: the CPU kernels did not build or load (see the warning above)"


class _Counting:
    """The loaded library, counting calls by function name."""

    def __init__(self, lib) -> None:
        self.lib, self.calls = lib, collections.Counter()

    def __getattr__(self, name):
        self.calls[name] += 1
        return getattr(self.lib, name)


LIGHT = ["quantization.calibration.num_samples=4", "quantization.calibration.max_seq_len=64",
         "verify.enabled=false"]   # tests/runtime/test_batch_invariance.py's: the build is shared


@pytest.mark.slow
def test_the_on_off_benchmark_runs_both_ways_and_leaves_the_kernels_on(build_bundle):
    from harness.perf.kernels import cpu_kernels

    res = cpu_kernels.run(Path(build_bundle("smollm2-135m-fp8", LIGHT)), batch=2, rounds=2, max_tokens=2)
    assert [len(v) for v in res["output_tok_s"].values()] == [2, 2]
    assert all(x > 0 for v in res["output_tok_s"].values() for x in v)
    assert res["speedup_of_means"] == round(res["mean_tok_s"]["kernels"] / res["mean_tok_s"]["pytorch_ops"], 3)
    long = cpu_kernels.long_prefill(Path(build_bundle("smollm2-135m-fp8", LIGHT)), tokens=40, rounds=2)
    assert long["prompt_tokens"] == 40 and [len(v) for v in long["prefill_s"].values()] == [2, 2]
    assert all(x > 0 for v in long["prefill_s"].values() for x in v)
    rows = cpu_kernels.row_threads(Path(build_bundle("smollm2-135m-fp8", LIGHT)), batch=2, rounds=2)
    assert [len(v) for v in rows["prefill_s"].values()] == [2, 2] and rows["prompt_tokens"] > 2
    assert all(x > 0 for v in rows["prefill_s"].values() for x in v)
    assert ops.library() is LIB and ops.attention_library() is LIB and ops._threads() == torch.get_num_threads()


def _greedy(ex, prompts, max_tokens=6):
    from backend.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=1)
    return [(r.token_ids, [lp for lp, _ in r.logprobs]) for r in ex.generate(prompts, params)]


@pytest.fixture(scope="module")
def fp8_engine(build_bundle):
    from backend.engine.executor import Executor

    bundle = Path(build_bundle("smollm2-135m-fp8", LIGHT))
    return Executor(bundle, start=False, verify_hashes=False, cpu_dtype="float32", enable_prefix_caching=False)


PROMPTS = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5] * 7, list(range(300, 340))]   # three lengths, one step


@pytest.mark.slow
def test_the_fp8_engine_gives_the_same_tokens_and_logprobs_with_and_without_the_elementwise_kernels(fp8_engine):
    """The default bundle (fp8 weights, activations and KV cache) on CPU: every elementwise kernel runs
    in its layers (counted), and greedy tokens and logprobs are those of the PyTorch ops, bit for bit
    (the attention kernel runs both times: its PyTorch path gives other bits, next test)."""
    layers, max_tokens = fp8_engine.spec.model.num_layers, 6
    counting = _Counting(LIB)
    with ops.using(counting):
        on = _greedy(fp8_engine, PROMPTS, max_tokens)
    with ops.using(None, attention=LIB):
        off = _greedy(fp8_engine, PROMPTS, max_tokens)
    calls = layers * max_tokens   # at least one step per token, every layer in each
    # per layer and step: the o input; k and v with their cache write; the two norms (with the qkv and
    # gate_up inputs' quantization); rope; SwiGLU's product for down; attention
    assert counting.calls["kiln_fake_quant_fp8"] >= calls
    assert counting.calls["kiln_write_kv_fp8"] >= calls
    assert counting.calls["kiln_add_rms_norm"] >= 2 * calls
    assert counting.calls["kiln_rope"] >= calls
    assert counting.calls["kiln_mul_fake_quant_fp8"] >= calls
    assert counting.calls["kiln_paged_attention"] >= calls
    assert on == off


@pytest.mark.slow
def test_the_attention_kernel_agrees_with_pytorchs_tiles_on_every_call_of_an_engine_run(fp8_engine, monkeypatch):
    """The attention kernel against the PyTorch path it replaces (SDPA over padded tiles), on the
    engine's own calls: prefill, decode and mixed steps, three prompt lengths. They add in other orders,
    so within float32 rounding of each other, not bit for bit: measured against the call's largest
    output (an output near zero is a sum that cancelled, whose rounding is that of its terms; on an
    Intel Xeon one 0.0021 came out 2.9e-6 off beside outputs of 4.3, a few float32 steps of those).
    Greedy tokens are not compared: the fp8 activations' rounding turns the last bit of a difference
    into another token within a few steps."""
    from backend.ops.attention import torch_backend

    forward, worst, calls = torch_backend.TorchAttentionBackend.forward, [0.0], collections.Counter()

    def both(self, q, *args):
        got = forward(self, q, *args)
        self._rows = None
        with ops.using(LIB, attention=None):
            want = forward(self, q, *args)
        self._rows = None
        meta = args[2]
        calls["prefill" if meta.num_prefills else "decode"] += 1
        worst[0] = max(worst[0], float((got - want).abs().max() / want.abs().max()))
        return got

    monkeypatch.setattr(torch_backend.TorchAttentionBackend, "forward", both)
    _greedy(fp8_engine, PROMPTS, 4)
    assert calls["prefill"] >= fp8_engine.spec.model.num_layers and calls["decode"] >= 3 * fp8_engine.spec.model.num_layers
    assert worst[0] < 1e-5, worst[0]   # float32 steps are 6e-8 of a value: ~160 of them


def test_the_builder_compiles_the_kernels_or_says_why_not(tmp_path, monkeypatch):
    """The compile stage (``make build``) fills the cache on the machine that builds, so serving there
    loads without compiling; without a compiler the build goes on and its log says so."""
    import types

    from builder.stages import compile as compile_stage

    lines: list[str] = []
    ctx = types.SimpleNamespace(log=lines.append)
    monkeypatch.setenv(build.ENV_DIR, str(tmp_path / "ok"))
    compile_stage._build_cpu_kernels(ctx)
    assert build.library_path().exists() and lines == [f"CPU kernels: {build.library_path()}"]
    monkeypatch.setenv(build.ENV_DIR, str(tmp_path / "no-cc"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    compile_stage._build_cpu_kernels(ctx)
    assert lines[1].startswith("CPU kernels not built: C compiler") and "no-such-cc" in lines[1]
    assert not build.library_path().exists()
