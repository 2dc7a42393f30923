"""Batch invariance on CPU (docs/contracts.md): a request's greedy tokens AND their logprobs, bit for
bit, are the same whether it runs alone or with other requests in its steps, for every shipped weight
format and KV cache dtype.

What it covers, and why the test it replaced (test_executor.py's, token ids of a chunked-prefill batch)
did not catch the bug it guards against: that test compared token ids only, 12 tokens, of the bf16
bundle with an fp32 KV cache. The padded decode batch changed logits in the last bits (1e-7), which
almost never flips a greedy argmax over 12 tokens; with an fp8 KV cache the same 1e-7 moves a key or
value across an fp8 rounding boundary now and then, a change of one fp8 step (6 to 12%), which grows
from step to step (two prompts, 20 forced decode steps: a fifth of one sequence's KV entries and its
logits by up to 4.6 apart), and a soak of the default (fp8) bundle saw 30% of its outputs change. Here logprobs are compared exactly,
so any difference in the numbers fails, whether or not it flips a token; and the batches vary what
made the numbers differ: the number of sequences (decode rows above 32, where the CPU linear path used
to switch from oneDNN to MKL), their lengths (padding), the prefill chunking (a 48-token step budget
splits prompts at places that depend on the other prompts) and preemption under KV pressure (generated
tokens recomputed as prefill rows)."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from backend.engine.executor import Executor
from backend.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

# 8 tokens: every logprob is compared exactly, so a difference shows at the step it appears (it did
# at the first decode steps); 12 tokens cost the suite a minute more across the formats
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
# Light calibration: invariance does not depend on calibration quality. The overrides of
# tests/builder/test_quantized_bundles.py, so these builds are shared with it.
LIGHT = ["quantization.calibration.num_samples=4", "quantization.calibration.max_seq_len=64",
         "verify.enabled=false"]
# (config, build overrides, runtime engine overrides)
# One case per CPU linear path and KV dtype: fp16-packed weights with a bf16 KV cache (bf16), per-row
# fp8 codes with an fp8 cache (fp8), dequantized fp32 weights through oneDNN (nvfp4), bf16 compute.
# (fp8 weights with a bf16 cache and int4_awq ran here too and passed; their linears and caches are
# these cases' own, so they went to keep the suite inside its CI budget.)
FORMATS = {
    "bf16": ("smollm2-135m-bf16", ["verify.enabled=false"], {}),
    "fp8": ("smollm2-135m-fp8", LIGHT, {}),                                   # the default bundle
    "nvfp4": ("smollm2-135m-nvfp4", LIGHT, {}),   # dequantized weights: the column-major oneDNN path
    # bf16 compute (engine.cpu_dtype auto chooses it where measured faster): failed without cpu_matmul
    # running a lone bf16 row as two on the avx512_bf16 machine it was written on; on an AVX2-only CPU
    # (bf16 emulated, never chosen by auto) it passes without that too (checked 2026-11-28), and stays
    # for the rest of the bf16 path; the other formats passed in bf16 too (by hand)
    "fp8-bf16-compute": ("smollm2-135m-fp8", LIGHT, {"cpu_dtype": "bfloat16"}),
}


def _executor(bundle: Path, weights, **overrides) -> Executor:
    # cpu_dtype pinned: under auto each executor times its candidates at load, and the three of one
    # case could choose differently on a busy machine (a "batch" difference that is not one)
    return Executor(bundle, weights=weights, start=False, verify_hashes=False,
                    **{"max_kv_tokens": 16384, "max_batch_size": 64, "enable_prefix_caching": False,
                       "cpu_dtype": "float32", **overrides})


def _generate(ex: Executor, prompts) -> list[tuple[list[int], list[float]]]:
    return [(r.token_ids, [lp for lp, _ in r.logprobs]) for r in ex.generate(prompts, PARAMS)]


@pytest.fixture(scope="module", params=list(FORMATS))
def bundle_case(request, build_bundle):
    config, build, runtime = FORMATS[request.param]
    bundle = Path(build_bundle(config, build))
    from backend.runtime.native import load_weights
    return request.param, bundle, load_weights(bundle, torch.device("cpu")), runtime


def test_greedy_tokens_and_logprobs_do_not_depend_on_the_batch(bundle_case, varied_prompts):
    name, bundle, weights, runtime = bundle_case
    # 12 prompts of 1 to ~150 tokens (short, long, code, non-English; the four chat-templated ones of
    # the fixture differ from each other only in a few tokens, and each costs an "alone" run)
    prompts = varied_prompts[:12]
    assert max(map(len, prompts)) > 3 * 48 and min(map(len, prompts)) < 8
    ex = _executor(bundle, weights, **runtime)
    alone = [_generate(ex, [p])[0] for p in prompts]
    # Every prompt 3 or 4 times, shuffled: the chunked and KV-pressure runs below take their copies from it.
    order = [i for i in range(len(prompts)) for _ in range(3 + (i % 2))][:40]
    random.Random(0).shuffle(order)
    assert len(order) == 40
    # 38 sequences in one batch: that order with the long prompt once (no prefix caching: each copy
    # computes), so decode steps have 38 rows (above 32; and a count the fp16 kernel pads to 39) and each
    # prompt sits among others of other lengths. The long prompt's two other copies were 294 of the
    # step's 778 prefill rows (rows cost alike in every step: bf16 compute spent ~8 s on them) and
    # repeated what the first checks, a long context among short ones; the chunked run below keeps
    # two copies of it, where the second reuses the first's cached blocks.
    long = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    batch = [i for j, i in enumerate(order) if i != long or j == order.index(long)]
    assert len(batch) == 38 and long in batch
    together = _generate(ex, [prompts[i] for i in batch])
    ex.shutdown()
    for j, i in enumerate(batch):
        assert together[j] == alone[i], f"{name}: prompt {i} (copy at {j}) changed with its batch"
    # Prefill in 48-token steps: chunk boundaries depend on the other prompts; prefix caching on: the
    # copies reuse each other's blocks, computed in another batch and another chunking.
    ex = _executor(bundle, weights, max_num_tokens=48, enable_prefix_caching=True, **runtime)
    assert order[:24].count(long) == 2
    chunked = _generate(ex, [prompts[i] for i in order[:24]])
    ex.shutdown()
    for j, i in enumerate(order[:24]):
        assert chunked[j] == alone[i], f"{name}: prompt {i} (copy at {j}) changed with chunked prefill"
    # KV pressure: a 128-token pool holds one or two of these at a time; the others wait, or are
    # preempted and recomputed (their generated tokens prefilled again, where they were decoded).
    short = [i for i in order if len(prompts[i]) <= 40][:10]
    ex = _executor(bundle, weights, max_kv_tokens=128, **runtime)
    pressed = _generate(ex, [prompts[i] for i in short])
    preemptions = ex.stats()["preemptions"]
    ex.shutdown()
    assert preemptions > 0
    for j, i in enumerate(short):
        assert pressed[j] == alone[i], f"{name}: prompt {i} (copy at {j}) changed with preemption"
