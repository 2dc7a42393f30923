"""The draft's training data: the ENGINE's greedy answers, and the hidden states recorded while it
wrote them (backend/speculative/record.py in the executor's speculator seam). They must be the
states a plain forward pass over the finished sequence gives, position for position (prompts of
different lengths, early EOS, prompts split into chunks), or the draft learns from misaligned states."""
import pytest
import torch

from backend.engine.executor import Executor
from backend.engine.sampling_params import SamplingParams
from backend.runtime.native import prefill_meta
from backend.speculative.record import HiddenRecorder
from builder.stages.draft_data import chat_ids, draft_logits, target_data

PROMPTS = ["Why is the sea salty?", "Answer with one word only: what colour is grass?",
           "List three animals that live in cold places and say how each one keeps warm in winter."]
AUX = (1, 14, 26)
SEQ_LEN = 72


@pytest.mark.slow
def test_recorded_states_match_a_forward_pass(eagle_bundle, smollm2_hf_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_hf_dir)
    calls = []
    samples = target_data(eagle_bundle, tok, PROMPTS, seq_len=SEQ_LEN, aux=AUX, advance=calls.append)
    assert sum(calls) == len(PROMPTS)

    # The reference: the same bundle in the engine, answering without any recorder attached...
    ex = Executor(eagle_bundle, start=False, speculative=False, verify_hashes=False, enable_prefix_caching=False)
    prompts = [chat_ids(tok, t)[-(SEQ_LEN // 2):] for t in PROMPTS]
    answers = ex.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=SEQ_LEN - len(p)) for p in prompts])
    runner, last = ex.runner, ex.spec.model.num_layers - 1
    lengths = set()
    for text, prompt, s, answer in zip(PROMPTS, prompts, samples, answers):
        # ...so the sequence is the engine's own greedy answer, the last token without states...
        assert s.ids[:len(prompt)] == prompt and s.prompt_len == len(prompt)
        assert s.ids[len(prompt):] + [s.last] == answer.token_ids
        assert s.aux.shape == (len(s.ids), len(AUX) * 576) and s.final.shape == (len(s.ids), 576)
        lengths.add(len(s.ids))
        # ...and the recorded states are a one-shot prefill's at every position (bf16 storage; the
        # decode steps computed them one row at a time).
        t = len(s.ids)
        hidden, captured = runner.model.forward(torch.tensor(s.ids), prefill_meta(t, runner.block_size, runner.device),
                                                runner.kv_caches, AUX + (last,))
        want_aux = torch.cat([captured[i] for i in AUX], -1).float()
        for got, want in ((s.aux.float(), want_aux), (s.final.float(), hidden.float())):
            cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
            assert cos.min() > 0.999, (text, cos.argmin().item(), cos.min().item())
    assert len(lengths) > 1          # the one-word answer stopped early: lengths differ
    assert samples[1].last in ex.spec.model.eos_token_ids

    head = runner.model.embed_tokens[:100]
    logits = draft_logits(samples[:1], head)[0]
    assert logits.shape == (len(samples[0].ids), 100) and logits.dtype == torch.bfloat16

    # Prompts split into 16-token chunks, and sequences preempted and recomputed (a pool of 7
    # blocks: two run, then one must give way), land at their positions: the same rows as before.
    rec = HiddenRecorder(AUX, 576)
    chunked = Executor(eagle_bundle, start=False, speculator=rec, verify_hashes=False, enable_prefix_caching=False,
                       max_num_tokens=16, max_kv_tokens=112)
    handles = []
    for j, p in enumerate(prompts):
        rec.expect(f"r{j}", SEQ_LEN)
        handles.append(chunked.submit(p, SamplingParams(temperature=0.0, max_tokens=16), request_id=f"r{j}"))
    while not all(h.finished for h in handles):
        chunked.step()
    got = [h.result() for h in handles]
    assert chunked.scheduler.stats()["preemptions"] > 0
    for j, (p, s) in enumerate(zip(prompts, samples)):
        rows = rec.take(f"r{j}")
        assert rows.shape[0] == len(p) + len(got[j].token_ids) - 1 and len(p) > 16
        cos = torch.nn.functional.cosine_similarity(rows.float(), s.aux[:rows.shape[0]].float(), dim=-1)
        assert cos.min() > 0.999, (j, cos.argmin().item(), cos.min().item())
