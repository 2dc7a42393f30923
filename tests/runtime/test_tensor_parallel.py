"""Tensor parallelism (#20) on the real model: per-rank bundle files, and a TP forward on CPU with gloo.

The pure sharding tests are test_tp_shard.py. These build the real SmolLM2
(9 heads, 3 KV heads, vocab 49152) with engine.tp_size=3 (one weights file per rank), check the rank
files against the tp_size=1 bundle's tensors re-sharded, and run them in three processes joined by
gloo, the real distributed engine, against the unsharded model in this process, both driven by the
same greedy loop.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from backend.bundle_schema import ModelConfig
from backend.runtime.tp_shard import shard_tensor
from tests.runtime.graph_helpers import share_quantize
from tests.runtime.test_tp_shard import _same

TP = 3
STEPS = 16
# fp32 on both sides; only the order of the sums differs (partial o/down products all-reduced, each
# rank's attention over its heads): measured max |TP3 - TP1| 1e-4 to 1e-3 on logits of magnitude ~20
LOGIT_ATOL = 1e-2
# fp8 bundle: activations are quantized to fp8 before every linear, so a last-bit difference (the
# sum order) can move a code one step; SmolLM2's outlier channels (|x| ~ 2e3 into layer 11's down)
# turn that into logit differences of ~1, as a 1e-5 relative perturbation of TP1's own embeddings
# does (measured: TP3 top-1 0.94, KL 0.024; TP1 with that noise 0.89, 0.027). Greedy paths may
# then part at near-ties, so TP3 is teacher-forced on TP1's tokens and held to the noise band and
# far below the fp8 format's own verify gate against bf16 (top-1 0.80, KL 0.12).
FP8_MIN_TOP1, FP8_MAX_MEAN_KL = 0.9, 0.05
# The same measure for the formats with group, block or smoothing scales (fp8 KV cache in all three,
# so a last-bit difference can move a cached K/V code too). Measured (2 cores, one thread per rank),
# TP3 vs TP1 teacher-forced, on the test's 2 prompts | on all 4 | TP1 with 1e-5 embedding noise vs
# TP1 on all 4 (the fp8 test's yardstick, run by hand), as top-1 / mean KL:
#   int4_awq (W4A16)              1.000 / 2e-4  | 0.984 / 4.2e-4 | 1.000 / 1.8e-3
#   int8_sq  (int8 activations)   0.969 / 4e-3  | 0.938 / 4.8e-3 | 0.906 / 9.7e-3
#   nvfp4    (W4A4: activations e2m1 per block of 16) 0.938 / 0.035 | 0.906 / 0.11 | 0.891 / 0.097
# (max |logits diff| 0.9 to 1.6, nvfp4 11, as under the noise.) So TP3 sits inside last-bit noise: held to
# about twice the noise's KL and a top-1 with room for other machines' sum orders (a misplaced scale
# gives garbage: top-1 near 0, KL >> 1). Two prompts, not four: nvfp4's emulated activation
# quantization makes each run slow on CPU. All far inside the formats' own verify gates against bf16
# (builder/stages/verify.py; nvfp4 KL 0.6).
# down's tensors in those bundles: the group/block scales, pre-quant and per-tensor scales split or copied
DOWN_TENSORS = {"int4_awq": {"weight", "weight_scale", "pre_quant_scale"},
                "nvfp4": {"weight", "weight_scale", "weight_scale_2", "input_scale"},
                "int8_sq": {"weight", "weight_scale", "input_scale", "pre_quant_scale"}}
TP3_BOUNDS = {"int4_awq": (0.9, 0.005), "int8_sq": (0.85, 0.02), "nvfp4": (0.8, 0.2)}   # (min top-1, max KL)
LIGHT = ["quantization.calibration.num_samples=4", "quantization.calibration.max_seq_len=64", "verify.enabled=false"]
# (config, overrides) of the tp_size=1 bundles; the tp_size=3 ones add engine.tp_size=3
BUNDLES = {"none": ("smollm2-135m-bf16", ["verify.enabled=false"]), "fp8": ("smollm2-135m-fp8", LIGHT),
           # the LIGHT builds of tests/builder/test_quantized_bundles.py (shared cache); int4_awq's group 64
           # divides each rank's 192 (o) and 512 (down) input features
           "int4_awq": ("smollm2-135m-int4-awq", LIGHT), "nvfp4": ("smollm2-135m-nvfp4", LIGHT),
           "int8_sq": ("smollm2-135m-fp8", LIGHT + ["quantization.format=int8_sq"])}
# what every rank holds whole: norms, per-tensor scales, and the row-parallel linears' per-output-row
# scales and biases (o/down outputs are all-reduced, so each rank keeps every output row's)
REPLICATED = re.compile(r"(^|\.)(norm|input_norm|post_attn_norm)\.weight$|\.(input_scale|k_scale|v_scale)$"
                        r"|\.(o|down)\.(weight_scale|bias)$")
TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
         "Q: What is 12 + 30?\nA:"]


def _bundles(build_bundle, fmt: str) -> tuple[Path, Path]:
    """(the tp_size=1 bundle, the same config built with engine.tp_size=3)."""
    config, overrides = BUNDLES[fmt]
    one = Path(build_bundle(config, overrides))
    three = overrides + [f"engine.tp_size={TP}"]
    share_quantize(one, config, three)
    return one, Path(build_bundle(config, three))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["none", "fp8"])
def test_tp3_bundle_is_the_tp1_tensors_resharded(build_bundle, fmt):
    """engine.tp_size=3: rank<i>.safetensors instead of weights.safetensors, each hashed in engine.json,
    each exactly tp_shard's split of the tp_size=1 bundle's tensors; whole-model readers (ModelRunner's
    load_weights: the verify stage, a tp_size=1 run; the layer-by-layer verify path) get them back."""
    from safetensors.torch import load_file

    from backend import bundle
    from backend.runtime.layerwise import LayerwiseRunner
    from backend.runtime.native import load_weights
    from backend.runtime.spec import load_engine_spec
    one, three = _bundles(build_bundle, fmt)
    b = bundle.load_bundle(three)                          # every file's sha256 checked
    assert b.manifest.weights == bundle.rank_weights(TP) and b.manifest.format_version == 2
    assert b.engine.tp_size == TP and set(bundle.rank_weights(TP)) <= set(b.manifest.files)
    assert not (three / bundle.WEIGHTS).exists()
    from builder.report import human_bytes, rank_memory_line
    line = rank_memory_line(b.manifest, three)              # what the build summary prints
    assert line.startswith(f"memory per rank (tp_size 3): weights {human_bytes(b.weight_paths[0].stat().st_size)} ")
    assert line.endswith("per token (1 of 3 KV heads)")
    config = bundle.read(one).model
    full = load_weights(one, torch.device("cpu"))
    for r, path in enumerate(b.weight_paths):
        got = load_file(str(path))
        assert set(got) == set(full)
        bad = [n for n, t in full.items() if not _same(got[n], shard_tensor(n, t, config, TP, r))]
        assert not bad, f"rank {r}: {bad[:3]}"
    back = load_weights(three, torch.device("cpu"))
    assert set(back) == set(full) and all(_same(back[n], full[n]) for n in full)
    layer = LayerwiseRunner(load_engine_spec(three))._read(prefix="layers.7.")
    assert layer.keys() == {n for n in full if n.startswith("layers.7.")}
    assert all(_same(t, full[n]) for n, t in layer.items())


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["none", "fp8"])
def test_each_rank_loads_only_its_file_and_holds_a_third(build_bundle, fmt, monkeypatch):
    """Measured from the tensors each ``TPRunner`` loaded: it opened only its rank file, and the numel
    of its split tensors is exactly 1/3 of the model's; what it holds whole are norms and scales."""
    import safetensors.torch
    from safetensors import safe_open

    from backend.runtime import tp
    from backend.runtime.spec import EngineError, load_engine_spec
    one, three = _bundles(build_bundle, fmt)
    with safe_open(str(one / "weights.safetensors"), "pt") as f:
        shapes = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
    opened, loaded = [], []
    load_file, rank_weights = safetensors.torch.load_file, tp._rank_weights
    monkeypatch.setattr(safetensors.torch, "load_file", lambda f, device="cpu": opened.append(Path(f).name)
                        or load_file(f, device=device))
    monkeypatch.setattr(tp, "_rank_weights", lambda *a: loaded.append(rank_weights(*a)) or loaded[-1])
    spec = load_engine_spec(three)
    split_numel, whole_bytes = [], []
    for r in range(TP):
        runner = tp.TPRunner(spec, TP, r, num_blocks=2, dtype=torch.float32)
        assert opened == [f"rank{r}.safetensors"] and runner.kv_caches[0][0].shape[2] == 1   # 3 KV heads / 3
        held = loaded.pop()
        whole = {n for n, t in held.items() if tuple(t.shape) == shapes[n]}
        assert {n for n in whole if not REPLICATED.search(n)} == set()
        split_numel.append(sum(held[n].numel() for n in set(held) - whole))
        whole_bytes.append(sum(held[n].numel() * held[n].element_size() for n in whole))
        opened.clear()
        del runner
    total = sum(torch.Size(s).numel() for n, s in shapes.items() if not REPLICATED.search(n))
    assert split_numel == [total // TP] * TP and total % TP == 0
    print(f"{fmt}: each rank holds {split_numel[0]:,} of {total:,} split elements, {whole_bytes[0]:,} bytes whole")
    assert whole_bytes[0] < 0.01 * sum(torch.Size(s).numel() for s in shapes.values())
    with pytest.raises(EngineError, match=r"split for tp_size=3 .*; tp_size=1 cannot load them"):
        rank_weights(spec, 1, 0, None)


def _tp1(bundle: Path, prompts: list[list[int]], forced=None, noise: float = 0.0):
    """The unsharded model; ``noise``: the embeddings times ``1 + noise * N(0, 1)`` (a last-bits
    perturbation, to measure how far such differences alone move this bundle's logits)."""
    from backend.runtime.native import ModelRunner, load_weights
    from backend.runtime.spec import load_engine_spec
    from backend.runtime.tp_generate import greedy
    spec = load_engine_spec(bundle, {"max_kv_tokens": 1024, "max_batch_size": 4})
    weights = None
    if noise:
        weights = load_weights(spec.path, torch.device("cpu"))
        e = weights["embed_tokens.weight"].float()
        g = torch.Generator().manual_seed(0)
        weights["embed_tokens.weight"] = e * (1 + noise * torch.randn(e.shape, generator=g))
    runner = ModelRunner(spec, dtype=torch.float32, weights=weights)
    return runner.model.config, greedy(runner.execute, runner.block_size, prompts, STEPS, forced=forced)


def _tp3(runs: list[tuple[Path, list[list[int]], list[list[int]] | None]], tmp_path: Path) -> list[list[dict]]:
    """``runs``: (bundle, prompts, forced tokens or None), run one after another by ``greedy_worker`` in
    ONE spawn of the TP ranks -> per run, what each rank saved."""
    from backend.runtime.tp import spawn
    from tests.runtime.tp_helpers import greedy_worker_runs
    args = []
    for i, (bundle, prompts, forced) in enumerate(runs):
        blocks = -(-(max(map(len, prompts)) + STEPS) // 16) + 1
        args.append((str(bundle), prompts, STEPS, blocks, "float32", str(tmp_path / f"tp{i}"), None, forced))
    spawn(greedy_worker_runs, TP, (args,))
    return [[torch.load(f"{tmp_path / f'tp{i}'}.rank{r}", weights_only=False) for r in range(TP)]
            for i in range(len(runs))]


# The teacher-forced TP3 runs of test_tp3_matches_tp1_fp8_bundle and test_tp3_matches_tp1_grouped_and_smoothed_bundles,
# with how many of TEXTS each takes (two for the grouped formats: see above)
GROUPED = ["int4_awq"]
FORCED_PROMPTS = {"fp8": 4, **{fmt: 2 for fmt in GROUPED}}


@pytest.fixture(scope="module")
def forced_tp3(build_bundle, tokenizer, tmp_path_factory):
    """fmt -> (TP1 config, TP1's greedy results, the three ranks' outputs teacher-forced on TP1's tokens)
    for every format of FORCED_PROMPTS, all TP3 runs in one spawn: each spawn re-imports torch in three
    processes and joins a gloo group before its first step (~10 s on 2 cores, more beside another pytest
    worker), and the two tests spawned one each. Each run still builds its own ranks from its own
    tp_size=3 bundle (greedy_worker, as before)."""
    runs = {}
    for fmt, n in FORCED_PROMPTS.items():
        one, three = _bundles(build_bundle, fmt)
        prompts = [tokenizer.encode(t).ids for t in TEXTS[:n]]
        config, ref = _tp1(one, prompts)
        runs[fmt] = (three, prompts, config, ref)
    ranks = _tp3([(three, prompts, [g.tokens for g in ref]) for three, prompts, _, ref in runs.values()],
                 tmp_path_factory.mktemp("tp3"))
    return {fmt: (config, ref, got) for (fmt, (_, _, config, ref)), got in zip(runs.items(), ranks)}


def _agreement(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, float]:
    """Logits ``b`` against the reference ``a`` (rows = positions): top-1 agreement, mean KL(a || b)
    in nats, max absolute difference."""
    lp_a, lp_b = a.log_softmax(-1), b.log_softmax(-1)
    return (float((a.argmax(-1) == b.argmax(-1)).float().mean()),
            float((lp_a.exp() * (lp_a - lp_b)).sum(-1).clamp_min(0).mean()), float((a - b).abs().max()))


def _check_held(config: ModelConfig, ranks: list[dict]) -> None:
    """Every rank holds 1/TP of each sharded weight and of the KV heads (its model's tensors' shapes)."""
    c, h = config, config.hidden_size
    for rank in ranks:
        held = rank["held"]
        assert held["embed_tokens"] == held["lm_head"] == (c.vocab_size // TP, h)
        assert held["kv_cache"][2] == c.num_kv_heads // TP
        for i in range(c.num_layers):
            assert held[f"layers.{i}.qkv"] == ((c.q_size + 2 * c.kv_size) // TP, h)
            assert held[f"layers.{i}.o"] == (h, c.q_size // TP)
            assert held[f"layers.{i}.gate_up"] == (2 * c.intermediate_size // TP, h)
            assert held[f"layers.{i}.down"] == (h, c.intermediate_size // TP)


@pytest.mark.slow
def test_tp3_matches_tp1_fp8_bundle(build_bundle, tokenizer, forced_tp3):
    bundle, _ = _bundles(build_bundle, "fp8")
    prompts = [tokenizer.encode(t).ids for t in TEXTS]
    config, ref, ranks = forced_tp3["fp8"]
    _, noisy = _tp1(bundle, prompts, forced=[g.tokens for g in ref], noise=1e-5)
    a = torch.cat([g.logits for g in ref])
    got = {}
    for name, b in (("TP3", torch.cat([g["logits"] for g in ranks[0]["results"]])),
                    ("TP1 + 1e-5 noise", torch.cat([g.logits for g in noisy]))):
        top1, kl, diff = _agreement(a, b)
        got[name] = top1, kl
        print(f"fp8 bundle in fp32, teacher-forced, {name} vs TP1: top-1 {top1:.3f}, mean KL {kl:.2g}, "
              f"max |logits diff| = {diff:.3g}")
    (top1, kl), (noise_top1, noise_kl) = got["TP3"], got["TP1 + 1e-5 noise"]
    # within the band last-bit noise gives this bundle ON THIS CPU, and far inside the fp8 format's verify
    # gate: TP3's top-1 moves with the machine's kernels (0.94 where measured above; 0.891 on an AVX2-only
    # EPYC, 2026-11-27, the noise band 0.891 there too), so top-1 is held to the band measured in this run
    # (less two positions), KL to both
    band = min(FP8_MIN_TOP1, noise_top1 - 2 / a.shape[0])
    assert top1 >= band and kl <= FP8_MAX_MEAN_KL and kl <= 2 * noise_kl, (top1, band, kl, noise_kl)
    _check_held(config, ranks)


@pytest.mark.slow
def test_executor_tp3_serves_tp1_tokens_its_driver_follows_and_a_dead_worker_fails_loudly(
        make_executor, build_bundle, smollm2_bundle, tokenizer, varied_prompts):
    """``Executor`` of a bundle built with engine.tp_size=3: the scheduler, block manager and sampler on
    rank 0, the model on three ranks (each reading its rank file); a batch of mixed prompts (chunked
    prefill, batched decode) gives TP1's tokens. Then its runner, ``TPDriver``, on its own: this process is
    rank 0 and broadcasts each step's inputs to two spawned workers; driven by the greedy loop, the same
    greedy tokens as TP1, logits within LOGIT_ATOL; a killed worker makes the next step raise (no hang),
    and shutdown leaves no process, no store and no group behind (and this thread's torch threads as
    they were).

    One start of the workers serves both (they were two tests, each spawning two workers that import torch
    and load their weights). The driver ran the single-file bundle with tp_size 3 asked at run time, each
    rank reading it whole and keeping its share: the rank files read here are bit for bit that share
    (test_tp3_bundle_is_the_tp1_tensors_resharded: tp_shard's split, which the run-time path applies,
    shard_weights), and that path itself runs in test_tp_lifecycle.py (this model) and test_tp_fused.py
    (TP against TP1 logits)."""
    import time

    import torch.distributed as dist

    from backend.engine.executor import Executor
    from backend.engine.sampling_params import SamplingParams
    from backend.runtime.spec import EngineError
    from backend.runtime.tp_driver import TPDriver
    from backend.runtime.tp_generate import greedy
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [varied_prompts[i] for i in (0, 1, 10, 12)]
    engine = {"max_kv_tokens": 2048, "max_batch_size": 8, "max_num_tokens": 64}
    want = [r.token_ids for r in make_executor(**engine).generate(prompts, params)]
    greedy_prompts = [tokenizer.encode(t).ids for t in TEXTS[:2]]
    _, ref = _tp1(smollm2_bundle, greedy_prompts)
    threads = torch.get_num_threads()
    # a thread count the driver would not choose (it takes cores / ranks, at least 1), so that its
    # restoring this one at shutdown is seen (a pytest worker runs 1 thread, which it may choose)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // TP) + 1)
    mine = torch.get_num_threads()
    # start=False: generate steps it on this thread, so the driver is built here and its thread setting
    # is this thread's (restored by shutdown, checked below)
    ex = Executor(_bundles(build_bundle, "none")[1], dtype=torch.float32, verify_hashes=False, start=False, **engine)
    driver = ex.runner
    try:
        assert isinstance(driver, TPDriver) and ex.spec.engine.tp_size == TP
        assert ex.runner.num_blocks >= 2048 // ex.runner.block_size
        assert [r.token_ids for r in ex.generate(prompts, params)] == want
        # every request finished: the greedy loop may use the cache's blocks 0..
        got = greedy(driver.execute, driver.block_size, greedy_prompts, STEPS)
        assert [g.tokens for g in got] == [g.tokens for g in ref]
        diff = max(float((a.logits - b.logits).abs().max()) for a, b in zip(ref, got))
        print(f"bf16 bundle in fp32, {len(greedy_prompts)} prompts x {STEPS} steps: "
              f"max |logits TP3 - TP1| = {diff:.3g}")
        assert diff < LOGIT_ATOL
        assert driver.runner.kv_caches[0][0].shape[2] == 1                  # 3 KV heads / 3 ranks
        driver.workers[0].kill()
        start = time.monotonic()
        with pytest.raises(EngineError, match="tensor parallelism: "):
            greedy(driver.execute, driver.block_size, greedy_prompts[:1], 2)
        assert time.monotonic() - start < 30
    finally:
        ex.shutdown()
        restored = torch.get_num_threads()
        torch.set_num_threads(threads)
    assert not any(p.is_alive() for p in driver.workers)
    assert not Path(driver._tmp).exists() and not dist.is_initialized()
    assert restored == mine


@pytest.mark.slow
def test_executor_refuses_a_tp_size_that_does_not_divide_the_heads(smollm2_bundle):
    from backend.engine.executor import Executor
    from backend.runtime.spec import EngineError
    with pytest.raises(EngineError, match=r"engine.tp_size: tp_size=2 does not divide the model's 9 attention heads"):
        Executor(smollm2_bundle, dtype=torch.float32, verify_hashes=False, tp_size=2, start=False)


@pytest.mark.slow
# int8_sq and nvfp4 (measured above) are not run here, to keep the suite's time (~30 s each: int8_sq's
# bundle is a quantize build of its own, nvfp4's activations are emulated per block of 16); their
# sharding is checked per tensor (dense shares, the runtime linears' partial sums) by the pure tests
# above. Add them to GROUPED to run them.
@pytest.mark.parametrize("fmt", GROUPED)
def test_tp3_matches_tp1_grouped_and_smoothed_bundles(build_bundle, forced_tp3, fmt):
    """The formats whose scales are more than per row: AWQ's group scales and pre-quant scales on o/down,
    nvfp4's fp8 block scales and global scale, SmoothQuant's smoothing scales. Built with tp_size=3,
    each rank file is the tp_size=1 bundle's tensors re-sharded, bit for bit, and three gloo ranks
    teacher-forced on TP1's greedy tokens give TP1's logits within the format's noise band."""
    from safetensors.torch import load_file

    from backend import bundle
    from backend.runtime.native import load_weights
    one, three = _bundles(build_bundle, fmt)
    b = bundle.load_bundle(three)
    config = bundle.read(one).model
    full = load_weights(one, torch.device("cpu"))
    # what the row-parallel split has to get right, present in the real bundle
    assert {n.rsplit(".", 1)[1] for n in full if n.startswith("layers.0.down.")} == DOWN_TENSORS[fmt]
    for r, path in enumerate(b.weight_paths):
        got = load_file(str(path))
        assert set(got) == set(full)
        bad = [n for n, t in full.items() if not _same(got[n], shard_tensor(n, t, config, TP, r))]
        assert not bad, f"rank {r}: {bad[:3]}"
    _, ref, ranks = forced_tp3[fmt]
    top1, kl, diff = _agreement(torch.cat([g.logits for g in ref]),
                                torch.cat([g["logits"] for g in ranks[0]["results"]]))
    print(f"{fmt} bundle in fp32, teacher-forced, TP3 vs TP1: top-1 {top1:.3f}, mean KL {kl:.2g}, "
          f"max |logits diff| = {diff:.3g}")
    min_top1, max_kl = TP3_BOUNDS[fmt]
    assert top1 >= min_top1 and kl <= max_kl
    _check_held(config, ranks)
