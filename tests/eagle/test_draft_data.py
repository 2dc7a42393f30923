"""The draft's training data: hidden states recorded DURING the target's generation must be the
ones a plain forward pass over the finished sequence gives, position for position (left padding,
prompts of different lengths and early EOS included), or the draft learns from misaligned states."""
import pytest
import torch

from builder.stages.draft_data import chat_ids, draft_logits, target_data

PROMPTS = ["Why is the sea salty?", "Answer with one word only: what colour is grass?",
           "List three animals that live in cold places and say how each one keeps warm in winter."]
AUX = (1, 14, 26)


@pytest.mark.slow
def test_recorded_states_match_a_forward_pass(smollm2_hf_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_hf_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32).eval()
    calls = []
    samples = target_data(model, tok, PROMPTS, seq_len=72, aux=AUX, advance=calls.append)
    assert sum(calls) == len(PROMPTS)
    lengths = set()
    for text, s in zip(PROMPTS, samples):
        prompt = chat_ids(tok, text)[-36:]
        assert s.ids[:len(prompt)] == prompt and s.prompt_len == len(prompt)
        assert s.aux.shape == (len(s.ids), len(AUX) * 576) and s.final.shape == (len(s.ids), 576)
        lengths.add(len(s.ids))
        with torch.inference_mode():
            ref = model(input_ids=torch.tensor([s.ids]), output_hidden_states=True)
        # The sequence is the target's own greedy answer...
        assert ref.logits[0, len(prompt) - 1:-1].argmax(-1).tolist() == s.ids[len(prompt):]
        # ...and the recorded states are the forward pass's at every position (bf16 storage).
        want_aux = torch.cat([ref.hidden_states[i + 1][0] for i in AUX], -1)
        for got, want in ((s.aux.float(), want_aux), (s.final.float(), ref.hidden_states[-1][0])):
            cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
            assert cos.min() > 0.999, (text, cos.argmin().item(), cos.min().item())
    assert len(lengths) > 1          # the one-word answer stopped early: lengths differ

    head = model.lm_head.weight[:100]
    logits = draft_logits(samples[:1], head)[0]
    assert logits.shape == (len(samples[0].ids), 100) and logits.dtype == torch.bfloat16
