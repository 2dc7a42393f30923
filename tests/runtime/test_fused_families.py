"""The fused (Triton) decoder layer on the newer families: Qwen3's per-head q/k RMS norms inside the rope +
KV-write kernel, Mistral's sliding window in the paged decode and prefill kernels, and Gemma 3's layer
(four (1 + w) norms, two of them on the blocks' outputs, GELU-tanh, a scaled embedding, a query scalar,
sliding and full layers with their own ropes), run by the engine
(kernels in Triton's interpreter on this CPU; the same launches a GPU compiles). Tiny random checkpoints
of transformers' own classes (tests/runtime/test_family_parity.py): greedy tokens are transformers'
(its full forward's argmax at every step) and every generated token's logits are within 1e-4 of it.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported (tests/kernels/conftest.py does too)

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from backend.engine.sampling_params import SamplingParams  # noqa: E402
from tests.runtime.hf_reference import assert_teacher_forced_greedy  # noqa: E402
from tests.runtime.test_family_parity import VOCAB, _build, _checkpoint, _hf_model  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                 reason="the Triton kernels need the interpreter (TRITON_INTERPRET=1) or a GPU")]

NEW = 12
ENGINE = dict(attention_backend="triton", cuda_graphs=False, max_kv_tokens=1024, max_batch_size=4,
              max_num_tokens=64)   # 64: the 41-token prompt and its neighbours prefill in more than one step


@pytest.fixture(scope="module", params=["qwen3", "mistral_window", "gemma3"])
def family(request, tmp_path_factory, smollm2_hf_dir):
    root = tmp_path_factory.mktemp(f"fused-{request.param}")
    src = _checkpoint(request.param, root / "src", Path(smollm2_hf_dir))
    return request.param, _hf_model(src), _build(src, root / "out")


def test_the_fused_layer_gives_transformers_tokens_and_logits(family):
    from backend.engine.executor import Executor
    from backend.runtime.native import ModelRunner, prefill_logits
    from backend.runtime.spec import load_engine_spec

    name, hf, bundle = family
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 23, 41)]
    ex = Executor(bundle, dtype=torch.float32, start=False, verify_hashes=False, **ENGINE)
    try:
        assert ex.runner.model.fused, f"{name}: the triton backend ran the plain layer"
        got = [r.token_ids for r in ex.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0.0,
                                                                        ignore_eos=True))]
    finally:
        ex.shutdown()
    spec = load_engine_spec(bundle, overrides=ENGINE)
    runner = ModelRunner(spec, device="cpu", dtype=torch.float32)
    for prompt, toks in zip(prompts, got):
        assert len(toks) == NEW
        assert_teacher_forced_greedy(hf, prompt, toks)
        full = prompt + toks
        with torch.no_grad():
            want = hf(torch.tensor([full])).logits[0, len(prompt) - 1:-1]
        torch.testing.assert_close(prefill_logits(runner, full)[len(prompt) - 1:-1], want, atol=1e-4, rtol=0)
