"""Expert models on the fused (Triton) decoder layer: engine.attention_backend triton runs each expert layer's
router and then the fused expert kernel (plugins/fused_moe.py) over the bundle's packed tensors, a dense layer
its fused gate/up, activation and down, run by the engine (kernels in Triton's interpreter on this CPU; the
same launches a GPU compiles). Tiny random fp32 checkpoints of transformers' own classes
(tests/runtime/test_family_parity.py): Mixtral (top-2 of 4, renormalised, every layer) and Qwen3-MoE (top-2
of 8, not renormalised, layer 0 dense). Greedy tokens are transformers' and every generated token's logits
are within 1e-4 of its; a kernel path that renormalises what Qwen3-MoE does not is caught.
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

NEW = 10
# 16-token steps: the 23-token prompt prefills in two, beside the other prompt's decode (a mixed batch)
ENGINE = dict(attention_backend="triton", cuda_graphs=False, max_kv_tokens=512, max_batch_size=2,
              max_num_tokens=16)


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe", "qwen2_moe"])   # qwen2_moe: a shared expert
def family(request, tmp_path_factory, smollm2_hf_dir):
    root = tmp_path_factory.mktemp(f"fused-{request.param}")
    src = _checkpoint(request.param, root / "src", Path(smollm2_hf_dir))
    return request.param, _hf_model(src), _build(src, root / "out")


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 23)]


def _runner(bundle):
    from backend.runtime.native import ModelRunner
    from backend.runtime.spec import load_engine_spec

    return ModelRunner(load_engine_spec(bundle, overrides=ENGINE), device="cpu", dtype=torch.float32)


def _expert_layers(runner) -> list:
    return [layer.moe for layer in runner.model.layers if layer.moe is not None]


def test_the_fused_layer_runs_experts_with_transformers_tokens_and_logits(family):
    from backend.engine.executor import Executor
    from backend.runtime.native import prefill_logits

    name, hf, bundle = family
    prompts = _prompts()
    ex = Executor(bundle, dtype=torch.float32, start=False, verify_hashes=False, **ENGINE)
    try:
        model = ex.runner.model
        assert model.fused, f"{name}: the triton backend ran the plain layer"
        moe = [layer.moe for layer in model.layers if layer.moe is not None]
        # the packed tensors are the kernel's operands, no per-expert copies beside them
        assert moe and all(m.kernel is not None and not m.gate_up and not m.down for m in moe), name
        if name == "qwen3_moe":
            assert model.layers[0].moe is None and model.layers[0].gate_up is not None   # mlp_only_layers [0]
        got = [r.token_ids for r in ex.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0.0,
                                                                        ignore_eos=True))]
    finally:
        ex.shutdown()
    runner = _runner(bundle)
    for prompt, toks in zip(prompts, got):
        assert len(toks) == NEW
        assert_teacher_forced_greedy(hf, prompt, toks)
        full = prompt + toks
        with torch.no_grad():
            want = hf(torch.tensor([full])).logits[0, len(prompt) - 1:-1]
        torch.testing.assert_close(prefill_logits(runner, full)[len(prompt) - 1:-1], want, atol=1e-4, rtol=0)


def test_a_kernel_path_that_renormalises_qwen3_moe_is_caught(tmp_path, smollm2_hf_dir, monkeypatch):
    """Qwen3-MoE (norm_topk_prob false) weights each expert by its softmax probability as it is: a fused
    expert kernel fed the renormalised weights gives other logits, beyond the tolerance above."""
    import plugins.fused_moe as fm
    from backend.runtime.native import prefill_logits

    src = _checkpoint("qwen3_moe", tmp_path / "src", Path(smollm2_hf_dir))
    hf, bundle = _hf_model(src), _build(src, tmp_path / "out")
    prompt = _prompts()[0]
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(prefill_logits(_runner(bundle), prompt), want, atol=1e-4, rtol=0)
    real, calls = fm.fused_moe, []

    def renormalising(x, ids, weights, *args, **kw):
        calls.append(x.shape[0])
        return real(x, ids, weights / weights.sum(-1, keepdim=True), *args, **kw)

    monkeypatch.setattr(fm, "fused_moe", renormalising)   # what the kernel table loads from now on
    got = prefill_logits(_runner(bundle), prompt)
    assert calls, "the fused expert kernel was not called"
    assert (got - want).abs().max() > 1e-3
