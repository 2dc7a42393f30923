"""The runtime reproduces Hugging Face transformers exactly on the real SmolLM2 (fp32 bundle)."""
from __future__ import annotations

import pytest
import torch

from backend.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

NEW_TOKENS = 64


def test_logits_match_hf_on_a_prefill(smollm2_bundle, weights_fp32, hf_model_fp32, smollm2_hf, varied_prompts):
    from backend.ops.attention import get_backend
    from backend.ops.attention.metadata import AttentionMetadata
    from backend.model.llama import LlamaModel
    from backend.runtime.spec import load_engine_spec

    spec = load_engine_spec(smollm2_bundle)
    model = LlamaModel(spec.model, weights_fp32, "none", get_backend("torch"), dtype=torch.float32)
    ids = torch.tensor(varied_prompts[10])  # the long one: several KV blocks
    t, bs = len(ids), 16
    nblk = -(-t // bs)
    kv = [(torch.zeros(nblk, bs, 3, 64), torch.zeros(nblk, bs, 3, 64)) for _ in range(30)]
    i32 = torch.int32
    meta = AttentionMetadata(positions=torch.arange(t), slot_mapping=torch.arange(t),
                             block_tables=torch.arange(nblk, dtype=i32).view(1, -1),
                             seq_lens=torch.tensor([t], dtype=i32), query_start_loc=torch.tensor([0, t], dtype=i32),
                             context_lens=torch.tensor([0], dtype=i32), num_prefills=1, num_prefill_tokens=t,
                             num_decode_tokens=0, max_query_len=t, max_seq_len=t)
    hidden, captured = model.forward(ids, meta, kv, capture_hidden_layers=(3,))
    ours = model.compute_logits(hidden)
    from transformers import LlamaForCausalLM
    with torch.no_grad():
        ref = hf_model_fp32(ids[None], output_hidden_states=True)
        exact = LlamaForCausalLM.from_pretrained(smollm2_hf, dtype=torch.float64).eval()(
            ids[None], output_hidden_states=True)
    # capture_hidden_layers=(i,) is HF's hidden_states[i + 1] (the output of layer i).
    for what, got, hf32, f64 in (("logits", ours, ref.logits[0], exact.logits[0]),
                                 ("layer 3", captured[3], ref.hidden_states[4][0], exact.hidden_states[4][0])):
        torch.testing.assert_close(got, hf32, atol=1e-3, rtol=1e-3, msg=what)
        # Both are fp32 sums in different orders (our CPU kernels, backend/ops/cpu_matmul.py, are not
        # MKL's): judged against float64, ours must be as accurate as an fp32 model is. Measured
        # 2.5x (logits) and 6x (layer 3, whose residual reaches 880) HF's error; an fp16 activation
        # or a wrong term would be orders of magnitude off.
        ours_err, hf_err = ((t.double() - f64).abs().max().item() for t in (got, hf32))
        assert ours_err <= 16 * hf_err + 1e-6, (what, ours_err, hf_err)
    # SmolLM2 (bf16) ties lm_head to the embedding: on CPU the head is an fp16-packed copy for the
    # logits kernel (backend/ops/cpu_matmul.py), exact, while the embedding keeps fp32 rows for the gather.
    from backend.ops import cpu_matmul
    assert model.embed_tokens.is_contiguous()
    if cpu_matmul.packs_fp16("cpu", torch.float32):
        assert isinstance(model.lm_head, cpu_matmul.packed_type())
        assert isinstance(model.layers[0].qkv.weight, cpu_matmul.packed_type())
        assert torch.equal(model.lm_head.unpack(), model.embed_tokens)


def test_greedy_generate_is_token_identical_to_hf(make_executor, hf_model_fp32, varied_prompts):
    """16 varied prompts x 64 greedy tokens, all batched in our executor.

    Reference, for every prompt: ONE Hugging Face forward over prompt + our 64 tokens; greedy output
    is identical iff HF's argmax after every prefix is our next token (by induction this is what
    HF ``generate`` would emit; it costs one forward instead of 64 on the 2-core CI machine).
    Two prompts also go through HF ``generate`` itself, so the equivalence is not just assumed."""
    assert len(varied_prompts) >= 16
    ex = make_executor()
    ours = ex.generate(varied_prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                      ignore_eos=True))
    mismatches = []
    for k, (prompt, res) in enumerate(zip(varied_prompts, ours)):
        assert len(res.token_ids) == NEW_TOKENS and res.finish_reason == "length"
        full = torch.tensor([prompt + res.token_ids])
        with torch.no_grad():
            logits = hf_model_fp32(full).logits[0]
        hf_next = logits[len(prompt) - 1:-1].argmax(-1).tolist()
        if hf_next != res.token_ids:
            first = next(i for i, (a, b) in enumerate(zip(hf_next, res.token_ids)) if a != b)
            mismatches.append(f"prompt {k}: first difference at token {first}")
    assert not mismatches, f"{len(mismatches)} of {len(varied_prompts)} prompts differ: {mismatches}"

    for k in (0, 12):  # a plain and a chat-templated prompt through HF generate itself
        prompt = varied_prompts[k]
        with torch.no_grad():
            ref = hf_model_fp32.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                         do_sample=False, pad_token_id=2)
        ref_ids = ref[0, len(prompt):].tolist()  # HF stops at EOS; we ignored it
        assert ours[k].token_ids[:len(ref_ids)] == ref_ids, f"prompt {k} differs from HF generate"
