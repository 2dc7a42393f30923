"""Structured output: token masks from a grammar (JSON schema, any JSON, regex, EBNF), per sequence.

The grammar library is xgrammar, chosen by measurement against llguidance on this project's
tokenizer (``docs/perf/grammar-mask.json``, ``harness/perf/grammar.py``). It is imported lazily:
an engine whose requests never ask for a guide never loads it.

* ``GuideCompiler``: one per executor; builds the library's tokenizer info once from the bundle's
  ``tokenizer.json`` and compiles each (kind, guide) once (an LRU of compiled grammars), on the
  submitting thread, so that a slow compile never stalls the engine loop and a bad schema is a
  ValueError before anything is queued.
* ``Guide``: one request's matcher. The sampler asks it for the next-token mask (``fill``) and the
  executor tells it each token the request generated (``accept``). Once the grammar is complete the
  mask allows only the model's end tokens, so generation stops the ordinary way.
* ``apply_bitmask``: the packed mask (32 tokens per int32 word, bit i of word w = token 32w+i) applied
  to a logits block with torch: disallowed tokens get -inf.
"""
from __future__ import annotations

import collections
import json
import threading
from pathlib import Path
from typing import Sequence

import torch

from backend.engine.sampling_params import GUIDE_KINDS
from backend.engine.vocab import BYTE_LEVEL, BYTE_FALLBACK, adds_prefix_space, vocab_kind, vocab_strings

__all__ = ["GUIDE_KINDS", "Guide", "GuideCompiler", "apply_bitmask", "tokenizer_info"]

_CACHE = 64   # compiled grammars kept per executor


def apply_bitmask(logits: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """``logits [B, V]`` with the tokens not allowed by ``words [B, ceil(V/32)]`` int32 set to -inf
    (in place; returned)."""
    shifts = torch.arange(32, device=words.device, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :logits.shape[1]]
    return logits.masked_fill_(~allowed.to(logits.device), float("-inf"))


class Guide:
    """One request's grammar state."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self._m = matcher
        self.vocab_size = vocab_size

    def new_bitmask(self, rows: int) -> torch.Tensor:
        """A packed mask block for ``rows`` sequences (all allowed until filled)."""
        return torch.full((rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)

    def fill(self, words: torch.Tensor, row: int) -> None:
        """Write the next-token mask into ``words[row]`` (int32, CPU)."""
        self._m.fill_next_token_bitmask(words, row)

    def tree_masks(self, tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """Speculative decoding: the mask of every node of a draft tree (node 0 = the last token the
        request emitted, already accepted here; ``parents`` topologically ordered), each for the
        grammar's state after the node's path. A node the grammar forbids at its parent can never be
        accepted (its parent's row masks it), so its subtree's rows stay all-allowed. The matcher
        ends where it started (every token taken along a path is rolled back)."""
        words = self.new_bitmask(len(tokens))
        children: list[list[int]] = [[] for _ in tokens]
        for i in range(1, len(tokens)):
            children[parents[i]].append(i)
        m = self._m

        def visit(i: int) -> None:
            if m.is_terminated():
                return               # after an end token nothing follows: the row is never used
            m.fill_next_token_bitmask(words, i)
            for c in children[i]:
                if m.accept_token(int(tokens[c])):
                    visit(c)
                    m.rollback(1)

        visit(0)
        return words

    def accept(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            if self._m.is_terminated():
                return           # the end token that closed the grammar, or tokens after it
            if not self._m.accept_token(int(t)):
                raise RuntimeError(f"guided decoding: token {t} does not follow the grammar")


def tokenizer_info(tok_json: dict, vocab_size: int, eos_token_ids: Sequence[int]):
    """xgrammar's view of the vocabulary, in the tokenizer's own spelling (``backend.engine.vocab``):
    byte-level BPE, SentencePiece with byte fallback, or raw strings."""
    import xgrammar as xgr
    vocab = vocab_strings(tok_json)
    vocab += [""] * max(0, vocab_size - len(vocab))   # the model's padded vocabulary
    kind = vocab_kind(tok_json)
    vtype = {BYTE_LEVEL: xgr.VocabType.BYTE_LEVEL, BYTE_FALLBACK: xgr.VocabType.BYTE_FALLBACK}.get(kind, xgr.VocabType.RAW)
    return xgr.TokenizerInfo(vocab, vtype, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids),
                             add_prefix_space=adds_prefix_space(tok_json))


class GuideCompiler:
    def __init__(self, tokenizer_json: str | Path, eos_token_ids: Sequence[int], vocab_size: int) -> None:
        self._path = Path(tokenizer_json)
        self._eos = list(eos_token_ids)
        self.vocab_size = vocab_size
        self._compiler = None
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()   # submit() runs on many threads

    def _get_compiler(self):
        if self._compiler is None:
            import xgrammar as xgr
            info = tokenizer_info(json.loads(self._path.read_text(encoding="utf-8")), self.vocab_size, self._eos)
            self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        return self._compiler

    def compile(self, kind: str, guide: str):
        key = (kind, guide)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            c = self._get_compiler()
            try:
                # one-line JSON (", " and ": ", no free whitespace): with free whitespace a
                # sampled model can pad with newlines until max_tokens and never close the document
                if kind == "json":
                    compiled = c.compile_json_schema("{}", any_whitespace=False)
                elif kind == "json_schema":
                    json.loads(guide)    # a clear error for text that is not JSON at all
                    compiled = c.compile_json_schema(guide, any_whitespace=False)
                elif kind == "regex":
                    compiled = c.compile_regex(guide)
                elif kind == "ebnf_grammar":
                    compiled = c.compile_grammar(guide)
                elif kind == "lark":
                    compiled = c.compile_lark(guide)
                else:
                    raise ValueError(f"allowed: {', '.join(GUIDE_KINDS)}")
            except Exception as e:  # noqa: BLE001 - the library's own message says what is wrong
                raise ValueError(f"sampling.guide: {kind} guide does not compile: {str(e).splitlines()[0][:300]}") from None
            self._cache[key] = compiled
            if len(self._cache) > _CACHE:
                self._cache.popitem(last=False)
            return compiled

    def guide(self, kind: str, guide: str) -> Guide:
        import xgrammar as xgr
        return Guide(xgr.GrammarMatcher(self.compile(kind, guide)), self.vocab_size)
