"""Gemma 3's sliding layers in a KV pool of their own: transformers' Gemma3ForCausalLM (random tiny
weights, 3 sliding layers with a window of 16 and one full layer) built by Kiln, served with a pool for
the sliding layers far smaller than the sequences, and greedy tokens that are transformers' own (its
full forward's argmax at every step: tests/runtime/hf_reference.py says why not its ``generate``).

The sliding pool's blocks are handed out again as soon as the window leaves them, so a layer that read
a block outside its window through its table, or a slot written into the other group's table, would
read another sequence's keys and change the tokens. Prefix reuse and preemption run through both
pools the same way.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")   # the triton case: its kernels in the interpreter on CPU

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from backend.engine.sampling_params import SamplingParams  # noqa: E402
from tests.runtime.hf_reference import assert_teacher_forced_greedy  # noqa: E402
from tests.runtime.test_family_parity import VOCAB, WINDOW, _build, _checkpoint, _hf_model  # noqa: E402

pytestmark = pytest.mark.slow

NEW = 100


@pytest.fixture(scope="module")
def gemma(tmp_path_factory, smollm2_hf_dir):
    root = tmp_path_factory.mktemp("gemma3-window-pool")
    src = _checkpoint("gemma3", root / "src", Path(smollm2_hf_dir))
    return src, _build(src, root / "out"), _hf_model(src)


def _executor(bundle, **engine):
    from backend.engine.executor import Executor
    return Executor(bundle, dtype="float32", start=False, verify_hashes=False, **engine)


def _prompts(*lens: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lens]


# torch; and the fused Triton layer with its decode steps through the CUDA-graph path's static buffers
# (run eagerly on a CPU: cuda_graphs true), which carry the sliding layers' tables too
# (the interpreter is slow: the triton case generates 30 tokens a sequence, 309 in all, past the pool's 288)
BACKENDS = {"torch": {}, "triton": {"attention_backend": "triton", "cuda_graphs": True}}
NEW_TOKENS = {"torch": NEW, "triton": 30}


NO_TRITON = os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available()


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    NO_TRITON, reason="the Triton kernels need the interpreter (TRITON_INTERPRET=1) or a GPU"))])
def test_the_sliding_layers_pool_is_small_and_the_tokens_are_transformers(gemma, backend):
    src, bundle, model = gemma
    ex = _executor(bundle, max_kv_tokens=2048, max_batch_size=4, max_num_tokens=32, **BACKENDS[backend])
    one_pool = _executor(bundle, max_kv_tokens=2048, max_batch_size=4, max_num_tokens=32 * 64)
    try:
        # window 16, block 16: ceil((32 + 4 * 15) / 16) + 3 * 4 = 18 blocks for the 3 sliding layers
        assert ex.runner.window_kv == (WINDOW, 18) and ex.runner.num_blocks == 128
        assert [k.shape[0] for k, _ in ex.runner.kv_caches] == [18, 18, 128, 18]
        # where one step may compute 2048 tokens the sliding pool would not be smaller: one pool
        assert one_pool.runner.window_kv is None
        assert one_pool.runner.kv_cache_bytes * (128 + 3 * 18) == ex.runner.kv_cache_bytes * 4 * 128
        prompts = _prompts(5, 23, 41, 120)
        params = SamplingParams(max_tokens=NEW_TOKENS[backend], temperature=0.0, ignore_eos=True)
        handles = [ex.submit(p, params) for p in prompts]
        most = 0
        while not all(h.finished for h in handles):
            ex.step()
            most = max(most, ex.block_manager.window_pool.num_used_blocks)
            ex.block_manager.check_invariants()
        got = [h.result().token_ids for h in handles]
        stats = ex.stats()
        graph_steps = ex.runner.graphs.steps if ex.runner.graphs is not None else None
    finally:
        ex.shutdown()
        one_pool.shutdown()
    assert (graph_steps or 0) > 0 if backend == "triton" else graph_steps is None
    for p, toks in zip(prompts, got):
        assert len(toks) == NEW_TOKENS[backend]
        assert_teacher_forced_greedy(model, p, toks)
    # torch: 589 tokens went through the sliding layers in a pool of 288, every block of it reused
    assert most <= 18 and stats["kv_window_released_blocks"] > (18 if backend == "torch" else 0)
    assert stats["kv_window_blocks_used"] == 0 and stats["kv_blocks_used"] == 0


def test_prefix_reuse_and_preemption_through_both_pools(gemma):
    src, bundle, model = gemma
    # full pool 14 blocks: two 180-token sequences (12 blocks each) cannot both stay; sliding pool 9
    ex = _executor(bundle, max_kv_tokens=224, max_batch_size=2, max_num_tokens=16)
    try:
        assert ex.runner.window_kv == (WINDOW, 9) and ex.runner.num_blocks == 14
        shared = _prompts(100, seed=2)[0]
        prompts = [shared + tail for tail in _prompts(20, 20, seed=3)]
        params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
        first = ex.generate([prompts[0]], params)[0]
        handles = [ex.submit(p, params) for p in prompts]
        while not all(h.finished for h in handles):
            ex.step()
            ex.block_manager.check_invariants()
        results = [h.result() for h in handles]
        stats = ex.stats()
    finally:
        ex.shutdown()
    assert first.token_ids == results[0].token_ids
    for p, r in zip(prompts, results):
        assert len(r.token_ids) == 60
        assert_teacher_forced_greedy(model, p, r.token_ids)
    assert stats["prefix_cache_hits"] > 0 and stats["preemptions"] > 0
    assert stats["kv_window_blocks_used"] == 0
