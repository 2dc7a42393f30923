"""The runtime reproduces Hugging Face transformers exactly on the real SmolLM2 (fp32 bundle)."""
from __future__ import annotations

import pytest
import torch

from backend.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

NEW_TOKENS = 64


def test_logits_match_hf_on_a_prefill(smollm2_bundle, weights_fp32, hf_model_fp32, varied_prompts):
    from backend.attention import get_backend
    from backend.attention.metadata import AttentionMetadata
    from backend.model.llama import LlamaModel
    from backend.runner import load_engine_spec

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
    with torch.no_grad():
        ref = hf_model_fp32(ids[None], output_hidden_states=True)
    torch.testing.assert_close(ours, ref.logits[0], atol=1e-4, rtol=1e-4)
    # capture_hidden_layers=(i,) is HF's hidden_states[i + 1] (the output of layer i).
    torch.testing.assert_close(captured[3], ref.hidden_states[4][0], atol=1e-4, rtol=1e-4)
    # SmolLM2 ties lm_head to the embedding: on CPU the head is a column-major copy for the logits
    # kernel (backend/cpu_matmul.py) while the embedding keeps rows for the gather.
    from backend import cpu_matmul
    assert torch.equal(model.lm_head, model.embed_tokens)
    assert model.embed_tokens.is_contiguous()
    assert cpu_matmul.is_column_major(model.lm_head) == (cpu_matmul._DNN is not None)


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
