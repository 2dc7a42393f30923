"""Shared pieces of the scheduler tests: a deterministic stand-in model and request builders."""
from backend.engine.request import Request
from backend.engine.sampling_params import SamplingParams

EOS = 2


def next_token(tokens):
    """A stand-in model: the next token depends only on the sequence (never EOS by default)."""
    return (tokens[-1] * 31 + len(tokens) * 7 + (tokens[-2] if len(tokens) > 1 else 0)) % 97 + 3


def make(rid, prompt, **params):
    params.setdefault("max_tokens", 8)
    return Request(rid, list(prompt), SamplingParams(**params))


def step(sched, model=next_token):
    out = sched.schedule()
    sampled = [model(s.request.all_token_ids) for s in out.scheduled if s.sample]
    finished = sched.update(out, sampled)
    return out, finished


def run(sched, max_steps=10_000, check=True, model=next_token):
    """Drive to completion, checking per-step limits and pool consistency."""
    outputs = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        out, _ = step(sched, model)
        outputs.append(out)
        if check:
            assert out.num_tokens == sum(s.num_new_tokens for s in out.scheduled)
            assert out.num_prefill_tokens == sum(s.num_new_tokens for s in out.scheduled
                                                 if s.is_prefill)
            assert out.num_tokens <= sched.max_num_tokens
            assert len(out.scheduled) <= sched.max_batch_size
            assert len(sched.running) <= sched.max_batch_size
            assert all(s.is_prefill for s in out.scheduled[:out.num_prefills])
            assert not any(s.is_prefill for s in out.scheduled[out.num_prefills:])
            sched.block_manager.check_invariants()
    assert not sched.has_unfinished(), "did not finish"
    return outputs


def reference_output(prompt, max_tokens):
    toks = list(prompt)
    for _ in range(max_tokens):
        toks.append(next_token(toks))
    return toks[len(prompt):]


def random_requests(rng, n, vocab=50, max_prompt=60, max_out=20, shared=None):
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, max_prompt))]
        if shared and rng.random() < 0.5:
            prompt = rng.choice(shared) + prompt
        reqs.append(make(f"r{i}", prompt, max_tokens=rng.randrange(1, max_out), ignore_eos=True,
                         priority=rng.choice([0, 0, 1])))
    return reqs
