"""The CPU kernels (plugins/cpu) against their PyTorch references, bit for bit, and the engine with and
without them: the same tokens and logprobs, bit for bit.

The kernels are compiled here by the machine's C compiler (a fraction of a second, cached by source
hash); a machine without one runs the references, which the last tests show is the same engine."""
from __future__ import annotations

import collections
import subprocess
from pathlib import Path

import pytest
import torch

from plugins.cpu import build, ops
from plugins.reference import cpu as ref

# The kernels must be built and loaded wherever the suite runs (CI has gcc): a test that silently
# compared the references with themselves would pass without them.
LIB = ops.library()
assert LIB is not None, "plugins/cpu: the CPU kernels did not build or load (see the warning above)"


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def _same(got: torch.Tensor | None, want: torch.Tensor) -> None:
    assert got is not None, "the kernel refused a layout it should take"
    assert got.shape == want.shape and got.dtype == torch.float32
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    diff = (_bits(got) != _bits(want)) & ~nan
    assert not bool(diff.any()), f"{int(diff.sum())} values differ, e.g. {got[diff][:4]} vs {want[diff][:4]}"


def _every_float_pattern(n: int, seed: int) -> torch.Tensor:
    """``n`` float32 bit patterns drawn uniformly: every exponent, subnormals, infinities and NaNs."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**31, 2**31, (n,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("scale", [1.0, 0.0123, 3.7, 2.0 ** -10, 1e-30, 5000.0])
def test_fake_quant_gives_the_reference_bits_for_every_kind_of_value(scale):
    s = torch.tensor(scale)
    x = torch.cat([_every_float_pattern(1 << 20, 0),
                   # the e4m3 grid and the midpoints between its values (ties to even), saturation
                   torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().nan_to_num(0.0) * scale,
                   torch.linspace(-500, 500, 100003) * scale,
                   torch.tensor([0.0, -0.0, 448.0, 449.0, 464.0, -464.0, 2 ** -9, 2 ** -10, 3 * 2 ** -11]) * scale])
    _same(ops.fake_quant_fp8(x, s), ref.fake_quant_fp8_ref(x, s))
    _same(ops.fake_quant_fp8(x, scale), ref.fake_quant_fp8_ref(x, s))   # the scale as a float


@pytest.mark.parametrize("cols", [1, 7, 8, 9, 13, 576])
def test_fake_quant_reads_strided_rows_and_row_tails(cols):
    g = torch.Generator().manual_seed(cols)
    s = torch.tensor(0.05)
    qkv = torch.randn(5, 3 * cols, generator=g) * 20
    for x in (qkv[:, cols:2 * cols], qkv[:1, :cols], qkv[:0, :cols], qkv.view(5, 3, cols)[:, 1:]):
        _same(ops.fake_quant_fp8(x, s), ref.fake_quant_fp8_ref(x, s))
    _same(ops.fake_quant_fp8(qkv[0], s), ref.fake_quant_fp8_ref(qkv[0], s))   # 1-D


def test_mul_fake_quant_gives_the_reference_bits():
    g = torch.Generator().manual_seed(1)
    s = torch.tensor(0.02)
    for t, n in ((1, 1536), (16, 1536), (3, 13), (0, 8)):
        gate_up = torch.randn(t, 2 * n, generator=g) * 4
        a = torch.nn.functional.silu(gate_up[:, :n])
        b = gate_up[:, n:]
        _same(ops.mul_fake_quant_fp8(a, b, s), ref.mul_fake_quant_fp8_ref(a, b, s))


@pytest.mark.parametrize("head_dim", [64, 16, 6, 2])
def test_rope_gives_the_reference_bits(head_dim):
    g = torch.Generator().manual_seed(head_dim)
    for t in (1, 7):
        qkv = torch.randn(t, (9 + 3 + 3) * head_dim, generator=g) * 3
        x = qkv[:, :12 * head_dim].view(t, 12, head_dim)        # q | k of a fused qkv: strided rows
        angles = torch.randn(t, head_dim, generator=g) * 100
        cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)
        _same(ops.rope(x, cos, sin), ref.rope_ref(x, cos, sin))


def test_layouts_and_dtypes_the_kernels_do_not_take_return_none():
    x = torch.randn(4, 6, 8)
    s = torch.tensor(0.1)
    assert ops.fake_quant_fp8(x.bfloat16(), s) is None
    assert ops.fake_quant_fp8(x.transpose(1, 2), s) is None           # inner dims not contiguous
    assert ops.mul_fake_quant_fp8(x, x[:, :3], s) is None               # shapes differ
    assert ops.rope(x.transpose(0, 1), x[:, :1], x[:, :1]) is None       # heads not contiguous in a row
    assert ops.rope(x, x[:, :1].transpose(0, 2), x[:, :1]) is None       # cos not contiguous


def test_a_library_built_from_other_source_is_refused(tmp_path):
    out = tmp_path / "other.so"
    subprocess.run([build.compiler(), *build.FLAGS, '-DKILN_SOURCE_HASH="0000"', str(build.SOURCE), "-o", str(out)],
                   check=True)
    with pytest.raises(build.CpuKernelBuildError, match="built from source 0000"):
        build._open(out)


def test_no_compiler_is_a_clear_error_and_the_loader_falls_back(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(build.ENV_DIR, str(tmp_path))                    # an empty cache: must compile
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(build.CpuKernelBuildError, match="no-such-cc"):
        build.ensure()
    monkeypatch.setattr(build, "_loaded", [])
    assert build.load() is None
    assert "CPU kernels not loaded" in caplog.text
    assert not list(tmp_path.iterdir())                                  # no half-written library left
    monkeypatch.setattr(build, "_loaded", [])
    monkeypatch.setenv(build.ENV_DISABLE, "0")
    monkeypatch.delenv("CC")
    assert build.load() is None                                          # disabled: not even built


def test_the_cache_is_filled_once_and_named_by_the_source(tmp_path, monkeypatch):
    monkeypatch.setenv(build.ENV_DIR, str(tmp_path))
    path = build.ensure()
    assert path.parent == tmp_path and build.source_hash() in path.name
    mtime = path.stat().st_mtime_ns
    assert build.ensure() == path and path.stat().st_mtime_ns == mtime  # cached: not compiled again
    assert build._open(path).kiln_cpu_source_hash() == build.source_hash().encode()


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
    from harness.bench import cpu_kernels

    res = cpu_kernels.run(Path(build_bundle("smollm2-135m-fp8", LIGHT)), batch=2, rounds=2, max_tokens=2)
    assert [len(v) for v in res["output_tok_s"].values()] == [2, 2]
    assert all(x > 0 for v in res["output_tok_s"].values() for x in v)
    assert res["speedup_of_means"] == round(res["mean_tok_s"]["kernels"] / res["mean_tok_s"]["pytorch_ops"], 3)
    assert ops.library() is LIB


@pytest.mark.slow
def test_the_fp8_engine_gives_the_same_tokens_and_logprobs_with_and_without_the_kernels(build_bundle):
    """The default bundle (fp8 weights, activations and KV cache) on CPU: every kernel runs in its
    layers (counted), and greedy tokens and logprobs are those of the PyTorch ops, bit for bit."""
    from backend.engine.executor import Executor
    from backend.engine.sampling_params import SamplingParams

    bundle = Path(build_bundle("smollm2-135m-fp8", LIGHT))
    ex = Executor(bundle, start=False, verify_hashes=False, cpu_dtype="float32", enable_prefix_caching=False)
    layers = ex.spec.model.num_layers
    prompts = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5] * 7, list(range(300, 340))]   # three lengths, one step
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    runs = {}
    for kernels in (True, False):
        counting = _Counting(LIB)
        with ops.using(counting if kernels else None):
            runs[kernels] = [(r.token_ids, [lp for lp, _ in r.logprobs]) for r in ex.generate(prompts, params)]
        if kernels:
            calls = layers * params.max_tokens   # at least one step per token, every layer in each
            # per layer and step: the qkv, o and gate_up inputs, k and v; rope; SwiGLU's product for down
            assert counting.calls["kiln_fake_quant_fp8"] >= 5 * calls
            assert counting.calls["kiln_rope"] >= calls
            assert counting.calls["kiln_mul_fake_quant_fp8"] >= calls
    assert runs[True] == runs[False]


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
