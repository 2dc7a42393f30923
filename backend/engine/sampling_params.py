"""Per-request sampling parameters (pure Python, no torch).

``SamplingParams`` is immutable and hashable: sequences given as lists are stored as tuples, so a
caller cannot change a request's parameters after it was queued. ``validate`` is called by the
executor BEFORE a request is queued; every error is one line naming the field, the value and what is
allowed, so a bad Triton request becomes a clear error response.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

# Top-n log-probabilities are computed on the full vocabulary row; more than this is a misuse
# (OpenAI's API caps at 20 too) and would make every step pay for a large top-k.
MAX_LOGPROBS = 20
# Triton's `seed` input is UINT64.
MAX_SEED = 2**64 - 1
# Presence/frequency penalties: OpenAI's documented range.
PENALTY_RANGE = (-2.0, 2.0)
# Structured output (backend/engine/guided.py): NVIDIA's guided_decoding_guide_type values, and lark
GUIDE_KINDS = ("json", "json_schema", "regex", "ebnf_grammar", "lark")

_INT_FIELDS = ("max_tokens", "min_tokens", "top_k", "logprobs", "priority")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty")
_BOOL_FIELDS = ("ignore_eos", "speculative", "return_context_logits", "return_generation_logits")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0     # 0 = greedy
    top_k: int = 0               # 0 = off
    top_p: float = 1.0           # 1 = off
    min_p: float = 0.0           # 0 = off
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    bad_token_ids: tuple[tuple[int, ...], ...] = ()   # token sequences that must not be generated
    # (token id, value) pairs added to the logits before sampling (OpenAI's logit_bias, NVIDIA's
    # embedding_bias); masks (bad words, min_tokens) still win over a bias
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int = 0            # top-n log-probabilities per generated token (0 = none)
    priority: int = 0            # higher first (FCFS among equals)
    speculative: bool = True     # per-request opt-out of speculative decoding
    # The raw model logits, as TensorRT-LLM returns them: at every prompt position ([prompt, vocab];
    # the prompt is then computed in full, without the prefix cache) and for every generated token
    # ([tokens, vocab]; no speculative drafts for the request). fp32, copied to the host.
    return_context_logits: bool = False
    return_generation_logits: bool = False
    # Structured output: (kind, guide), kind in GUIDE_KINDS ("json": any JSON, guide ignored); every
    # token is drawn under the grammar's mask, and the grammar's end allows only the end tokens
    guide: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        # Accept lists (what JSON and Triton give) but store tuples: frozen means frozen.
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
        if not isinstance(self.logit_bias, tuple) and _is_seq(self.logit_bias):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias))
        if isinstance(self.logit_bias, tuple) and any(not isinstance(b, tuple) and _is_seq(b) for b in self.logit_bias):
            object.__setattr__(self, "logit_bias", tuple(tuple(b) if _is_seq(b) else b for b in self.logit_bias))
        if not isinstance(self.stop_token_ids, tuple) and _is_seq(self.stop_token_ids):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.guide, list):
            object.__setattr__(self, "guide", tuple(self.guide))
        if not isinstance(self.bad_token_ids, tuple) and _is_seq(self.bad_token_ids):
            object.__setattr__(self, "bad_token_ids", tuple(self.bad_token_ids))
        if isinstance(self.bad_token_ids, tuple) and any(
                not isinstance(b, tuple) and _is_seq(b) for b in self.bad_token_ids):
            object.__setattr__(self, "bad_token_ids", tuple(
                tuple(b) if _is_seq(b) else b for b in self.bad_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, room: int, vocab_size: int | None = None) -> None:
        """Raise ``ValueError("sampling.<field>: <value>: <problem>; allowed: <...>")``.

        ``room`` is the most tokens this request may generate (the engine's ``max_seq_len`` minus
        the prompt length, ``room_problem``); ``vocab_size`` bounds token ids when given.
        """
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if not _is_int(value):
                _fail(name, value, "must be an integer")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value):
                _fail(name, value, "must be a finite number")
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                _fail(name, value, "must be true or false")

        if self.max_tokens < 1 and room >= 1:
            _fail("max_tokens", self.max_tokens, f"allowed: 1..{room}")
        problem = room_problem(self.max_tokens, room)
        if problem is not None:
            _fail("max_tokens", self.max_tokens, problem)
        if not 0 <= self.min_tokens <= self.max_tokens:
            _fail("min_tokens", self.min_tokens, f"allowed: 0..max_tokens ({self.max_tokens})")
        if self.temperature < 0:
            _fail("temperature", self.temperature, "allowed: >= 0 (0 = greedy)")
        if self.top_k < 0:
            _fail("top_k", self.top_k, "allowed: >= 0 (0 = off)")
        if vocab_size is not None and self.top_k > vocab_size:
            _fail("top_k", self.top_k, f"allowed: 0..{vocab_size} (vocab size)")
        if not 0.0 < self.top_p <= 1.0:
            _fail("top_p", self.top_p, "allowed: (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            _fail("min_p", self.min_p, "allowed: [0, 1]")
        if self.repetition_penalty <= 0:
            _fail("repetition_penalty", self.repetition_penalty, "allowed: > 0 (1 = off)")
        lo, hi = PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not lo <= value <= hi:
                _fail(name, value, f"allowed: [{lo}, {hi}]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            _fail("seed", self.seed, "allowed: null or an integer in 0..2**64-1")
        logprobs_limit = MAX_LOGPROBS if vocab_size is None else min(MAX_LOGPROBS, vocab_size)
        if not 0 <= self.logprobs <= logprobs_limit:
            _fail("logprobs", self.logprobs, f"allowed: 0..{logprobs_limit}")

        if self.guide is not None:
            if (not isinstance(self.guide, tuple) or len(self.guide) != 2
                    or not all(isinstance(x, str) for x in self.guide)):
                _fail("guide", self.guide, "must be a (kind, guide text) pair")
            if self.guide[0] not in GUIDE_KINDS:
                _fail("guide", self.guide[0], f"unknown kind; allowed: {', '.join(GUIDE_KINDS)}")
            if self.guide[0] != "json" and not self.guide[1]:
                _fail("guide", self.guide[0], "needs a guide (a schema, regex or grammar)")
            if self.ignore_eos or self.min_tokens:
                # both forbid the end token the grammar's end requires: every token would be masked
                _fail("guide", self.guide[0], "cannot be combined with ignore_eos or min_tokens")
        if not isinstance(self.stop_token_ids, tuple):
            _fail("stop_token_ids", self.stop_token_ids, "must be a list of token ids")
        for tok in self.stop_token_ids:
            _check_token("stop_token_ids", tok, vocab_size)
        if not isinstance(self.bad_token_ids, tuple):
            _fail("bad_token_ids", self.bad_token_ids, "must be a list of token id lists")
        for seq in self.bad_token_ids:
            if not isinstance(seq, tuple) or not seq:
                _fail("bad_token_ids", seq, "each entry must be a non-empty list of token ids")
            for tok in seq:
                _check_token("bad_token_ids", tok, vocab_size)
        if not isinstance(self.logit_bias, tuple):
            _fail("logit_bias", self.logit_bias, "must be a list of (token id, value) pairs")
        for pair in self.logit_bias:
            if not isinstance(pair, tuple) or len(pair) != 2:
                _fail("logit_bias", pair, "each entry must be a (token id, value) pair")
            _check_token("logit_bias", pair[0], vocab_size)
            if isinstance(pair[1], bool) or not isinstance(pair[1], (int, float)) or not math.isfinite(pair[1]):
                _fail("logit_bias", pair, "the value must be a finite number")

    def replace(self, **changes) -> "SamplingParams":
        """A copy with some fields changed (unknown names raise, like the constructor)."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"sampling: unknown field(s) {', '.join(unknown)}; "
                             f"allowed: {', '.join(sorted(known))}")
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return SamplingParams(**values)


def room_problem(max_tokens: int, room: int) -> str | None:
    """The one check of the room a prompt leaves for its output (``room`` = ``max_seq_len`` minus
    the prompt's tokens): what is wrong with ``max_tokens`` (>= 1), or None when it fits. Every door
    words its refusal with it after naming its own input: ``SamplingParams.validate`` (the
    executor's ``submit``), the Triton models' request conversion and the OpenAI server."""
    if room < 1:
        return "no room to generate: the prompt fills max_seq_len; allowed: a shorter prompt"
    if max_tokens > room:
        return f"more than the {room} tokens the prompt leaves in max_seq_len; allowed: 1..{room}"
    return None


def _is_seq(value) -> bool:
    return isinstance(value, (list, tuple, range))


def _is_int(value) -> bool:
    # bool is an int subclass; `max_tokens=True` is a caller bug, not 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_token(name: str, tok, vocab_size: int | None) -> None:
    if not _is_int(tok) or tok < 0 or (vocab_size is not None and tok >= vocab_size):
        bound = "a non-negative integer" if vocab_size is None else f"0..{vocab_size - 1}"
        _fail(name, tok, f"token ids allowed: {bound}")


def _fail(name: str, value, problem: str) -> None:
    raise ValueError(f"sampling.{name}: {value!r}: {problem}")


__all__ = ["GUIDE_KINDS", "MAX_LOGPROBS", "SamplingParams", "room_problem"]
