"""A Qwen3 bundle built with engine.tp_size=2 (its per-head q/k norms copied to both ranks, its heads
split) decodes transformers' greedy tokens across two ranks joined over gloo, as the tp_size=1 bundle
does in test_family_parity.py: the q/k norms act on whichever heads a rank holds."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.runtime.test_family_parity import NEW_TOKENS, _checkpoint, _hf_greedy, _hf_model

pytestmark = pytest.mark.slow
TP = 2


def _build_tp(src: Path, out: Path) -> Path:
    from builder.config import BuildConfig
    from builder.pipeline import run_pipeline

    cfg = BuildConfig.from_dict({}, f"{src.name}.yaml", [
        f"model.source={src}", "model.dtype=float32", "quantization.format=none", "quantization.kv_cache=none",
        "verify.enabled=false", "engine.max_seq_len=256", "engine.max_input_len=128", "engine.max_kv_tokens=2048",
        "engine.cpu_dtype=float32", f"engine.tp_size={TP}"])
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
