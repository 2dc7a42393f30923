"""Acceptance rules: greedy is exact match; rejection sampling preserves the target distribution."""
import pytest
import torch

from backend.engine.sampling_params import SamplingParams
from backend.speculative.accept import (accept_tree, emitted_tokens, rejection_accept, speculation_allowed,
                                 target_probs)
from backend.speculative.tree import TokenTree

# Upper 0.1% points of the chi-square distribution (a correct sampler fails 1 run in 1000).
CHI2_999 = {7: 24.32, 15: 37.70, 63: 103.4}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    n = counts.sum()
    expected = probs * n
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with zero target probability was emitted"
    stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return stat, int(keep.sum()) - 1


def synthetic_pair(vocab=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    p_logits = torch.randn(vocab, generator=g) * 1.5
    return p_logits, g


@pytest.mark.parametrize("candidates", [[3], [3, 5], [0, 1, 2, 3], [7]])
def test_rejection_sampling_first_token_matches_target(candidates):
    vocab, n = 8, 3000
    p_logits, _ = synthetic_pair(vocab)
    p = p_logits.softmax(-1)
    # A tree whose root has the given candidate children (what a draft's top-k proposes).
    tree = TokenTree(tuple([0] + candidates), tuple([-1] + [0] * len(candidates)))
    probs = torch.stack([p] + [torch.full((vocab,), 1.0 / vocab)] * len(candidates))
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros(vocab)
    for _ in range(n):
        path, bonus = rejection_accept(tree, probs, g)
        counts[emitted_tokens(tree, path, bonus)[0]] += 1
    stat, dof = chi_square(counts, p)
    assert stat < CHI2_999[dof], (stat, counts / n, p)


def test_rejection_sampling_two_token_joint_distribution_on_a_chain():
    # Chain root -> 2 -> 6: the first two emitted tokens must follow p1(x) * p2(y | x).
    vocab, n = 8, 6000
    g0 = torch.Generator().manual_seed(3)
    p1 = (torch.randn(vocab, generator=g0) * 1.2).softmax(-1)
    p_after_2 = (torch.randn(vocab, generator=g0) * 1.2).softmax(-1)
    tree = TokenTree((0, 2, 6), (-1, 0, 1))
    probs = torch.stack([p1, p_after_2, torch.full((vocab,), 1.0 / vocab)])
    g = torch.Generator().manual_seed(4)
    counts = torch.zeros(vocab)  # second token, given the first was 2
    firsts = 0
    for _ in range(n):
        path, bonus = rejection_accept(tree, probs, g)
        toks = emitted_tokens(tree, path, bonus)
        if toks[0] == 2:
            firsts += 1
            if len(toks) > 1:
                counts[toks[1]] += 1
    # P(first = 2) = p1[2]; given that, the next token follows p_after_2.
    assert abs(firsts / n - float(p1[2])) < 4 * (float(p1[2]) * (1 - float(p1[2])) / n) ** 0.5
    stat, dof = chi_square(counts, p_after_2)
    assert stat < CHI2_999[dof], stat


def test_a_deliberately_biased_acceptance_is_detected():
    # The test must be able to fail: always accepting the draft's token is not the target distribution.
    vocab, n = 8, 5000
    p = synthetic_pair(vocab)[0].softmax(-1)
    counts = torch.zeros(vocab)
    counts[3] = n  # what "accept whatever the draft says" would emit
    stat, dof = chi_square(counts, p)
    assert stat > CHI2_999[dof]


def test_greedy_accept_tree_is_exact_match():
    tree = TokenTree((0, 4, 5, 6), (-1, 0, 0, 2))
    logits = torch.full((4, 10), -5.0)
    logits[0, 5] = 3.0   # after root the target wants 5 -> second child
    logits[2, 6] = 3.0   # after node 2 it wants 6 -> accepted
    logits[3, 9] = 3.0   # after node 3 it wants 9 -> bonus
    path, bonus = accept_tree(tree, logits, SamplingParams(temperature=0.0))
    assert path == [0, 2, 3] and bonus == 9
    assert emitted_tokens(tree, path, bonus) == [5, 6, 9]


def test_target_probs_follow_sampler_filters():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.count_nonzero(p) == 2 and abs(float(p.sum()) - 1) < 1e-6
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert torch.count_nonzero(p) == 1
    p = target_probs(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(p, (logits / 0.5).softmax(-1))


def test_speculation_only_for_context_free_sampling():
    assert speculation_allowed(SamplingParams(), 0)
    assert not speculation_allowed(SamplingParams(speculative=False), 0)
    assert not speculation_allowed(SamplingParams(repetition_penalty=1.2), 0)
    assert not speculation_allowed(SamplingParams(logprobs=2), 0)
    assert not speculation_allowed(SamplingParams(min_tokens=4), 3)
    assert speculation_allowed(SamplingParams(min_tokens=4), 4)
