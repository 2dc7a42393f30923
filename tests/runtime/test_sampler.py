"""Sampler unit tests on synthetic logits (no model): masks, penalties, seeds, logprobs."""
from __future__ import annotations

import torch

from backend.engine.sampler import Sampler, SampleRow, make_generator
from backend.engine.sampling_params import SamplingParams

V = 50
EOS = 7


def _row(params, prompt=(1, 2), output=(), seed=None):
    gen = make_generator(params.seed) if params.seed is not None else None
    return SampleRow(params, list(prompt), list(output), gen)


def _logits(b=1, seed=0):
    return torch.randn(b, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_per_row():
    logits = _logits(4)
    out = Sampler([EOS])(logits, [_row(SamplingParams(temperature=0.0)) for _ in range(4)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_the_plain_greedy_path_is_taken_only_when_every_row_is_plain_and_agrees_with_the_general_one():
    # bf16 logits with ties: the plain path's argmax runs on the bf16 row itself, the general path's
    # on its fp32 copy; both must give the first index of the row's maximum
    logits = (_logits(6) * 4).round().to(torch.bfloat16)
    assert any(int((row == row.max()).sum()) > 1 for row in logits), "the case needs a tie"
    plain = [_row(SamplingParams(temperature=0.0)) for _ in range(6)]
    assert all(r.plain for r in plain)
    fast = Sampler([EOS])(logits, plain)
    expect = [int((row == row.max()).nonzero()[0]) for row in logits.float()]
    assert fast.token_ids == expect and fast.logprobs == [None] * 6
    # one row asking for anything more sends the whole step through the general path: same tokens
    for extra in (dict(logprobs=1), dict(min_tokens=1), dict(repetition_penalty=1.2), dict(logit_bias={3: 0.5}),
                  dict(bad_token_ids=[[9]]), dict(temperature=0.5, top_k=1)):
        row = _row(SamplingParams(**{"temperature": 0.0, **extra}), output=[5])
        assert not row.plain, extra
        general = Sampler([EOS])(logits, plain[:5] + [row])
        assert general.token_ids[:5] == expect[:5], extra


def test_seeded_rows_reproduce_alone_and_batched():
    p = SamplingParams(temperature=1.0, seed=42)
    logits = _logits(3, seed=1)
    alone = [Sampler()(logits[1:2], [_row(p)]).token_ids[0] for _ in range(1)]
    # Same seed, fresh generator, different neighbours (unseeded and another seed).
    batched = Sampler()(logits, [_row(SamplingParams(temperature=1.0)), _row(p),
                                 _row(SamplingParams(temperature=0.7, seed=7))]).token_ids
    assert batched[1] == alone[0]
    # Over several steps the stream is the same too.
    g1, g2 = make_generator(42), make_generator(42)
    s = Sampler()
    seq1 = [s(logits[1:2], [SampleRow(p, [1], [], g1)]).token_ids[0] for _ in range(20)]
    seq2 = [s(logits, [_row(SamplingParams(temperature=1.0)), SampleRow(p, [1], [], g2),
                       _row(SamplingParams(temperature=1.0))]).token_ids[1] for _ in range(20)]
    assert seq1 == seq2 and len(set(seq1)) > 1  # really random, really reproducible


def test_top_k_only_samples_from_the_k_best():
    logits = _logits(1, seed=3)
    best = set(logits[0].topk(3).indices.tolist())
    p = SamplingParams(temperature=5.0, top_k=3, seed=0)
    g = make_generator(0)
    drawn = {Sampler()(logits, [SampleRow(p, [1], [], g)]).token_ids[0] for _ in range(200)}
    assert drawn <= best and len(drawn) > 1


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = torch.full((1, V), -30.0)
    logits[0, :4] = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    g = make_generator(1)
    p = SamplingParams(temperature=1.0, top_p=0.7, seed=1)
    drawn = {Sampler()(logits, [SampleRow(p, [1], [], g)]).token_ids[0] for _ in range(300)}
    assert drawn == {0, 1}  # 0.5 < 0.7 <= 0.8: token 2 and beyond are cut


def test_min_p_drops_tokens_below_fraction_of_the_best():
    logits = torch.full((1, V), -30.0)
    logits[0, :3] = torch.log(torch.tensor([0.6, 0.35, 0.05]))
    g = make_generator(2)
    p = SamplingParams(temperature=1.0, min_p=0.2, seed=2)
    drawn = {Sampler()(logits, [SampleRow(p, [1], [], g)]).token_ids[0] for _ in range(300)}
    assert drawn == {0, 1}  # 0.05 < 0.2 * 0.6


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(1, V)
    logits[0, EOS] = 10.0
    logits[0, 9] = 9.0
    logits[0, 3] = 8.0
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[9])
    s = Sampler([EOS])
    assert s(logits, [_row(p, output=[])]).token_ids == [3]
    assert s(logits, [_row(p, output=[5, 5])]).token_ids == [EOS]  # min reached: EOS allowed


def test_bad_token_sequences_block_the_completing_token():
    logits = torch.zeros(1, V)
    logits[0, 11] = 5.0
    logits[0, 12] = 4.0
    p = SamplingParams(temperature=0.0, bad_token_ids=[[11], [20, 12]])
    s = Sampler()
    assert s(logits, [_row(p, output=[1])]).token_ids == [12]       # [11] is always banned
    assert s(logits, [_row(p, output=[20])]).token_ids not in ([11], [12])  # 20 -> 12 banned too


def test_penalties_follow_their_definitions():
    logits = torch.zeros(1, V)
    logits[0, 4], logits[0, 5], logits[0, 6] = 2.0, -2.0, 1.0
    rep = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    s = Sampler()
    edited = logits.clone()
    s._apply_penalties(edited, [_row(rep, prompt=[4], output=[5])])
    assert edited[0, 4] == 1.0 and edited[0, 5] == -4.0 and edited[0, 6] == 1.0
    freq = SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25)
    edited = logits.clone()
    s._apply_penalties(edited, [_row(freq, prompt=[6], output=[4, 4, 5])])
    assert edited[0, 4] == 2.0 - 1.0 - 0.25 and edited[0, 5] == -2.0 - 0.5 - 0.25
    assert edited[0, 6] == 1.0  # presence/frequency count output tokens only
    # Greedy with a strong repetition penalty moves off the repeated token.
    assert s(logits, [_row(SamplingParams(temperature=0.0, repetition_penalty=3.0), output=[4])]).token_ids == [6]


def test_logprobs_are_model_log_softmax_with_top_n():
    logits = _logits(2, seed=5)
    out = Sampler()(logits, [_row(SamplingParams(temperature=0.0, logprobs=4)),
                             _row(SamplingParams(temperature=0.0))])
    lp = logits.log_softmax(-1)
    chosen, top = out.logprobs[0]
    assert abs(chosen - lp[0, out.token_ids[0]].item()) < 1e-5
    assert [t for t, _ in top] == lp[0].topk(4).indices.tolist()
    assert out.logprobs[1] is None


def test_logit_bias_moves_only_its_row_and_masks_still_win():
    logits = _logits(2, seed=3)
    low = int(logits[0].argmin())
    biased = SamplingParams(temperature=0.0, logit_bias=((low, 1000.0),))
    out = Sampler([EOS])(logits.clone(), [_row(biased), _row(SamplingParams(temperature=0.0))])
    assert out.token_ids == [low, int(logits[1].argmax())]  # the other row is untouched
    best = int(logits[0].argmax())
    down = Sampler([EOS])(logits[:1].clone(), [_row(SamplingParams(temperature=0.0, logit_bias={best: -1000.0}))])
    assert down.token_ids[0] != best
    # a bias cannot bring back a forbidden token: bad words and min_tokens masks are applied after it
    forced = SamplingParams(temperature=0.0, logit_bias=((EOS, 1000.0),), min_tokens=2)
    assert Sampler([EOS])(logits[:1].clone(), [_row(forced)]).token_ids[0] != EOS
    # and the caller's logits are not edited in place
    raw = logits.clone()
    Sampler([EOS])(raw, [_row(biased), _row(biased)])
    assert torch.equal(raw, logits)
