"""Family bundles built with engine.tp_size=2 decode transformers' greedy tokens across two ranks joined
over gloo, as the tp_size=1 bundles do in test_family_parity.py: a Qwen3 (its per-head q/k norms copied to
both ranks, its heads split: the norms act on whichever heads a rank holds), and a multi-query Gemma 3
(one KV head for 4 query heads, which each rank holds whole: replicated, with its k norm and, in fp8,
its rows' scales)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.runtime.test_family_parity import NEW_TOKENS, _checkpoint, _hf_greedy, _hf_model

pytestmark = pytest.mark.slow
TP = 2


# fp8 weights and KV cache, lightly calibrated (the quantize stage; its accuracy is not what is tested)
FP8 = ("quantization.format=fp8", "quantization.kv_cache=fp8", "quantization.calibration.num_samples=4",
       "quantization.calibration.max_seq_len=64")


def _build_tp(src: Path, out: Path, tp: int = TP, quant: tuple[str, ...] = ()) -> Path:
    from builder.config import BuildConfig
    from builder.pipeline import run_pipeline

    cfg = BuildConfig.from_dict({}, f"{src.name}.yaml", [
        f"model.source={src}", "model.dtype=float32", "quantization.format=none", "quantization.kv_cache=none",
        *quant, "verify.enabled=false", "engine.max_seq_len=256", "engine.max_input_len=128",
        "engine.max_kv_tokens=2048", "engine.cpu_dtype=float32", f"engine.tp_size={tp}"])
    return run_pipeline(cfg, out, until="compile", log=lambda m: None).bundle


def test_qwen3_tp2_decodes_transformers_greedy_tokens(tmp_path, smollm2_hf_dir):
    from backend.runtime.tp import spawn
    from tests.runtime.tp_helpers import greedy_worker_runs

    src = _checkpoint("qwen3", tmp_path / "qwen3", Path(smollm2_hf_dir))
    bundle = _build_tp(src, tmp_path / "out")
    for rank in range(TP):       # each rank's file holds the whole [head_dim] norms and half the heads
        with safe_open(str(bundle / f"rank{rank}.safetensors"), "pt") as f:
            assert tuple(f.get_tensor("layers.0.q_norm.weight").shape) == (32,)
            assert f.get_tensor("layers.0.qkv.weight").shape[0] == (4 * 32 + 2 * 2 * 32) // TP
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 23)]
    blocks = -(-(max(map(len, prompts)) + NEW_TOKENS) // 16) + 1
    out = tmp_path / "tp"
    spawn(greedy_worker_runs, TP, ([(str(bundle), prompts, NEW_TOKENS, blocks, "float32", str(out), None, None)],))
    got = torch.load(f"{out}.rank0", weights_only=False)["results"]
    hf = _hf_model(src)
    for prompt, res in zip(prompts, got):
        assert res["tokens"] == _hf_greedy(hf, prompt)


GEMMA_PROMPTS = (23, 41)        # both past the 16-token window of the sliding layers
GEMMA_TOKENS = 16


@pytest.fixture(scope="module")
def gemma_mqa(tmp_path_factory, smollm2_hf_dir) -> dict[str, Path]:
    """Gemma 3 with 4 query heads over ONE KV head: the checkpoint, its fp32 tp_size=2 bundle, and fp8
    (weights and KV) bundles at tp_size 2 and 1 from one quantize stage."""
    import shutil

    tmp = tmp_path_factory.mktemp("gemma3-mqa")
    # the tokenizer's whole vocabulary: the fp8 build calibrates on real text
    vocab = json.loads((Path(smollm2_hf_dir) / "config.json").read_text())["vocab_size"]
    src = _checkpoint("gemma3", tmp / "gemma3", Path(smollm2_hf_dir), num_key_value_heads=1, vocab_size=vocab)
    fp8_tp2 = shutil.copytree(_build_tp(src, tmp / "fp8", quant=FP8), tmp / "fp8-tp2")
    return {"src": src, "plain": _build_tp(src, tmp / "none"), "fp8_tp2": fp8_tp2,
            "fp8_tp1": _build_tp(src, tmp / "fp8", tp=1, quant=FP8)}   # compiled again from the same quantize


def _gemma_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in GEMMA_PROMPTS]


def _tp2_greedy(bundle: Path, prompts: list[list[int]], out: Path) -> list[dict]:
    """Both ranks' saved outputs of a greedy run of ``bundle`` over gloo."""
    from backend.runtime.tp import spawn
    from tests.runtime.tp_helpers import greedy_worker_runs
    blocks = -(-(max(map(len, prompts)) + GEMMA_TOKENS) // 16) + 1
    spawn(greedy_worker_runs, TP, ([(str(bundle), prompts, GEMMA_TOKENS, blocks, "float32", str(out), None, None)],))
    ranks = [torch.load(f"{out}.rank{r}", weights_only=False) for r in range(TP)]
    assert all(r["held"]["kv_cache"][2] == 1 for r in ranks)          # [blocks, block, 1 KV head, head_dim]
    return ranks


def test_gemma3_one_kv_head_tp2_replicates_it_and_decodes_transformers_tokens(gemma_mqa, tmp_path):
    """tp_size=2 over one KV head: each rank holds that head (its k/v rows, the k norm) and 2 query heads,
    its KV cache one head wide, planned as one head; engine.json records it. Over gloo, transformers' greedy
    tokens on two prompts, every step's logits within 1e-4 of its full forward."""
    from backend import bundle as bundle_format
    from backend.ops.attention import get_backend
    from backend.runtime.kv_plan import CPU_RAM_FRACTION, kv_cache_dtypes, plan_kv_blocks
    from backend.runtime.spec import load_engine_spec
    from backend.runtime.tp_driver import plan_kv_blocks as tp_plan
    from builder.report import rank_memory_line
    from tests.runtime.hf_reference import hf_greedy

    plain = gemma_mqa["plain"]
    manifest = bundle_format.read(plain)
    assert manifest.engine.kv_heads_per_rank == 1
    assert bundle_format.read(gemma_mqa["fp8_tp1"]).engine.kv_heads_per_rank is None
    assert rank_memory_line(manifest, plain).endswith("per token (1 of 1 KV heads, each on 2 ranks)")
    d = 32
    for b in (plain, gemma_mqa["fp8_tp2"]):
        with safe_open(str(b / "rank0.safetensors"), "pt") as f0, safe_open(str(b / "rank1.safetensors"), "pt") as f1:
            w0, w1 = f0.get_tensor("layers.0.qkv.weight"), f1.get_tensor("layers.0.qkv.weight")
            assert w0.shape[0] == 4 * d // TP + 2 * d                      # 2 query heads + the k and v head
            assert torch.equal(w0[2 * d:].view(torch.uint8), w1[2 * d:].view(torch.uint8))   # the same head on both
            assert torch.equal(f0.get_tensor("layers.0.k_norm.weight"), f1.get_tensor("layers.0.k_norm.weight"))
    # the CPU KV plan of each rank counts its one head (not 1 // 2 = 0)
    spec = load_engine_spec(plain)
    _, storage = kv_cache_dtypes(spec, torch.float32, torch.device("cpu"), get_backend("torch", "cpu"))
    assert tp_plan(spec, TP, torch.float32) == plan_kv_blocks(spec, storage, 1, None, CPU_RAM_FRACTION / TP)

    prompts = _gemma_prompts()
    got = _tp2_greedy(plain, prompts, tmp_path / "plain")[0]["results"]
    hf = _hf_model(gemma_mqa["src"])
    for prompt, res in zip(prompts, got):
        assert res["tokens"] == hf_greedy(hf, prompt, GEMMA_TOKENS)
        with torch.no_grad():
            want = hf(torch.tensor([prompt + res["tokens"]])).logits[0, len(prompt) - 1:-1]
        torch.testing.assert_close(res["logits"], want, atol=1e-4, rtol=0)


def test_gemma3_one_kv_head_fp8_tp2_gives_the_tp1_fp8_tokens(gemma_mqa, tmp_path):
    """fp8 weights (per-row scales) and fp8 KV at tp_size=2 over the one KV head: the tp_size=1 fp8
    bundle's greedy tokens, so the k/v rows' scales went with them to both ranks."""
    from backend.runtime.native import ModelRunner
    from backend.runtime.spec import load_engine_spec
    from backend.runtime.tp_generate import greedy

    prompts = _gemma_prompts()
    got = _tp2_greedy(gemma_mqa["fp8_tp2"], prompts, tmp_path / "fp8")[0]["results"]
    one = ModelRunner(load_engine_spec(gemma_mqa["fp8_tp1"], {"max_kv_tokens": 1024}), dtype=torch.float32)
    ref = greedy(one.execute, one.block_size, prompts, GEMMA_TOKENS)
    assert [r["tokens"] for r in got] == [r.tokens for r in ref]
    for res, r in zip(got, ref):
        # only the sums' order differs: measured 3e-7 (fp8 activation codes did not move)
        torch.testing.assert_close(res["logits"], r.logits, atol=1e-4, rtol=0)
