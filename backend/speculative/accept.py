"""Accepting draft tokens: exact match for greedy requests, rejection sampling for sampled ones.

Sampled requests use sequential rejection over a node's candidate children, which is exact for
*deterministic* candidates (the draft's top-k, as in EAGLE trees and chains): at a node whose target
distribution is ``p``, candidate ``x`` is accepted with probability ``p(x)``; if rejected, ``x`` is
removed from ``p`` (renormalised) and the next sibling is tried; when every sibling is rejected the
bonus token is drawn from what is left. Each emitted token is therefore distributed exactly as ``p``
(a categorical draw split into "is it x1? else is it x2? ... else the rest"), whatever the draft
proposed: speculation changes the speed, never the distribution. ``tests/eagle`` checks this with a
chi-square test.

``target_probs`` reproduces the sampler's distribution (temperature, top-k, top-p, min-p); requests
whose distribution depends on the tokens being decided (penalties, bad words, min_tokens) or that
carry a logit bias (which ``target_probs`` does not add) are not given drafts
(``speculation_allowed``), so their probabilities never need the path's tokens. Guided requests
(structured output) do speculate: the verifier masks each tree node's logits row with the grammar's
state after that node's path (``backend/engine/guided.py`` ``Guide.tree_masks``) before acceptance,
so a draft the grammar forbids is never accepted and the bonus token follows the grammar too.
"""
from __future__ import annotations

from typing import Sequence

import torch

from backend.engine.sampling_params import SamplingParams
from backend.speculative.tree import TokenTree, greedy_accept


def speculation_allowed(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a request may get draft tokens this step (see the module doc for why not)."""
    return (params.speculative and params.repetition_penalty == 1.0 and params.presence_penalty == 0.0
            and params.frequency_penalty == 0.0 and not params.bad_token_ids and not params.logit_bias
            and params.logprobs == 0 and not params.return_generation_logits
            and num_output_tokens >= params.min_tokens)


def is_greedy(params: SamplingParams) -> bool:
    # The sampler's rule: temperature 0 means argmax.
    return params.temperature == 0.0


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``logits [N, V]`` (one request's rows) -> the sampler's probabilities ``[N, V]`` fp32."""
    scaled = logits.float() / params.temperature
    v = scaled.shape[-1]
    if 0 < params.top_k < v:
        kth = scaled.topk(params.top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        vals, idx = scaled.sort(dim=-1, descending=True)
        ps = vals.softmax(dim=-1)
        drop_sorted = (ps.cumsum(dim=-1) - ps) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter_(1, idx, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    probs = scaled.softmax(dim=-1)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _draw(p: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(p, 1, generator=generator))


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator))


def rejection_accept(tree: TokenTree, probs: torch.Tensor,
                     generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Sampled verification. ``probs[i]`` is the target's distribution after node i (``[N, V]``).
    Returns (accepted node indices starting with the root, bonus token)."""
    assert probs.shape[0] == tree.num_nodes
    path = [0]
    node = 0
    while True:
        p = probs[node].clone()
        nxt = None
        for c in tree.children(node):
            x = tree.tokens[c]
            px = float(p[x])
            if px <= 0.0:
                continue
            if _uniform(generator) < px:
                nxt = c
                break
            p[x] = 0.0
            total = float(p.sum())
            if total <= 0.0:  # only reachable by rounding: every remaining token had mass ~0
                p = probs[node].clone()
                break
            p /= total
        if nxt is None:
            return path, _draw(p, generator)
        path.append(nxt)
        node = nxt


def accept_tree(tree: TokenTree, logits: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Verify one sequence's tree from the target's logits ``[num_nodes, V]`` (node order)."""
    if is_greedy(params):
        return greedy_accept(tree, logits.argmax(dim=-1).tolist())
    return rejection_accept(tree, target_probs(logits, params), generator)


def emitted_tokens(tree: TokenTree, path: Sequence[int], bonus: int) -> list[int]:
    """Tokens the request gains: the accepted draft tokens, then the bonus token."""
    return [tree.tokens[i] for i in path[1:]] + [bonus]


__all__ = ["accept_tree", "emitted_tokens", "is_greedy", "rejection_accept", "speculation_allowed",
           "target_probs"]
