"""Sliding windows bound a sequence's KV memory: a conversation of ~4,000 tokens on a model whose every
layer attends over a 256-token window holds about window / block_size blocks however long it grows (counted
by the block manager after every step), and its greedy tokens are transformers' own (MistralForCausalLM,
which attends within the window), with prefix caching on and across a preemption.

Greedy tokens are held to transformers two ways: ``generate(do_sample=False)`` itself, and, since over 4,000
positions of a random model two logits can come within 1e-3 of each other (transformers' incremental
``generate`` and its own full forward then disagree at that step: seen at a margin of 4e-4), one
teacher-forced forward over prompt + Kiln's tokens whose argmax at every step must be Kiln's token (a
greedy sequence is exactly the one that agrees with the model's argmax at each of its steps).

The checkpoint is transformers' own class with random weights (fp32, 2 layers), saved and built with
``quantization.format=none``; the engine runs on the torch attention path, the one that takes windows.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from backend.engine.sampling_params import SamplingParams
from tests.runtime.hf_reference import assert_teacher_forced_greedy, hf_greedy

pytestmark = pytest.mark.slow

WINDOW = 256
BLOCK = 16
CHUNK = 128                 # engine.max_num_tokens: the prompt is prefilled in chunks of this many tokens
PROMPT_LEN = 3900
NEW_TOKENS = 100            # prompt + output: 4,000 tokens
VOCAB = 256
# what one sequence can hold at once: the window's blocks, the chunk being computed, one partial block
HELD_BOUND = (WINDOW + CHUNK) // BLOCK + 2


@pytest.fixture(scope="module")
def mistral(tmp_path_factory, smollm2_hf_dir):
    import transformers
    from builder.config import BuildConfig
    from builder.pipeline import run_pipeline

    root = tmp_path_factory.mktemp("window")
    config = transformers.MistralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=8192,
                                        sliding_window=WINDOW, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).float().eval()
    model.save_pretrained(root / "hf")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(Path(smollm2_hf_dir) / f, root / "hf" / f)
    cfg = BuildConfig.from_dict({}, "mistral-window.yaml", [
        f"model.source={root / 'hf'}", "model.dtype=float32", "quantization.format=none", "quantization.kv_cache=none",
        "verify.enabled=false", "engine.max_seq_len=4096", "engine.max_input_len=4000", "engine.max_kv_tokens=8192",
        f"engine.kv_block_size={BLOCK}", "engine.cpu_dtype=float32", "engine.attention_backend=torch"])
    bundle = run_pipeline(cfg, root / "out", until="compile", log=lambda m: None).bundle
    return model, bundle


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    return hf_greedy(model, prompt, NEW_TOKENS)


def _is_transformers_greedy(model, prompt: list[int], ours: list[int]) -> None:
    assert_teacher_forced_greedy(model, prompt, ours)


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (PROMPT_LEN,), generator=g).tolist() for _ in range(n)]


def _run(ex, prompts, before_step=None) -> tuple[list[list[int]], int]:
    """Greedy outputs of ``prompts`` stepped here, the block manager checked after every step; returns
    (outputs, the most blocks any one sequence held)."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    handles = [ex.submit(p, params) for p in prompts[:1]]
    bm, most, steps = ex.block_manager, 0, 0
    while not all(h.finished for h in handles) or len(handles) < len(prompts):
        if before_step is not None and len(handles) < len(prompts) and before_step(steps):
            handles.append(ex.submit(prompts[len(handles)], params))
        ex.step()
        steps += 1
        bm.check_invariants()
        for req in ex.scheduler.running:
            most = max(most, bm.held_blocks(req))
    return [h.result().token_ids for h in handles], most


def test_a_4000_token_sequence_holds_only_its_windows_blocks(mistral):
    from backend.engine.executor import Executor

    model, bundle = mistral
    prompt = _prompts(1)
    # no prefix cache and a pool barely above one window: a released block is handed out again at once
    # (the free list is last-in first-out), so a block released while its keys were still in the window
    # would be overwritten and change the tokens
    ex = Executor(bundle, dtype=torch.float32, verify_hashes=False, start=False, max_num_tokens=CHUNK,
                  enable_prefix_caching=False, max_kv_tokens=(HELD_BOUND + 1) * BLOCK)
    try:
        assert ex.block_manager.window == WINDOW
        (ours,), most = _run(ex, prompt)
        stats = ex.block_manager.stats()
        bound = ex.block_manager.most_blocks(PROMPT_LEN + NEW_TOKENS, CHUNK)
    finally:
        ex.shutdown()
    total = -(-(PROMPT_LEN + NEW_TOKENS) // BLOCK)
    assert most <= bound == 25 and HELD_BOUND < total // 5, (most, bound, total)
    assert stats["kv_window_released_blocks"] >= total - HELD_BOUND, stats
    assert ours == _hf_greedy(model, prompt[0])
    _is_transformers_greedy(model, prompt[0], ours)


def test_windows_with_prefix_caching_and_a_preemption(mistral):
    """A second long prompt sharing the first's first 3,000 tokens arrives mid-way into a pool too small for
    both windows: one is preempted and recomputed (its prefix from the cache); both equal transformers'."""
    from backend.engine.executor import Executor

    model, bundle = mistral
    a, b = _prompts(2)
    b = a[:3000] + b[3000:]
    # room for one sequence's window and chunk and a few blocks more: the second cannot grow beside it
    pool = (HELD_BOUND + 8) * BLOCK
    ex = Executor(bundle, dtype=torch.float32, verify_hashes=False, start=False, max_num_tokens=CHUNK,
                  max_kv_tokens=pool)
    try:
        assert ex.block_manager.num_blocks * BLOCK < PROMPT_LEN   # no whole sequence fits: only windows do
        outs, most = _run(ex, [a, b], before_step=lambda step: step >= 40)
        stats = ex.scheduler.stats()
    finally:
        ex.shutdown()
    assert stats["preemptions"] >= 1 and stats["prefix_cache_hits"] > 0, stats
    assert most <= HELD_BOUND
    assert outs[0] == _hf_greedy(model, a)
    for prompt, ours in zip((a, b), outs):
        _is_transformers_greedy(model, prompt, ours)
