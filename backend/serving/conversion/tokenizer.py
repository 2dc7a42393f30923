"""The bundle's tokenizer for serving: encode (optionally through the chat template), decode, words.

Uses the ``tokenizers`` library only (the runtime's allowed imports); the chat template is rendered
with jinja2, imported lazily because only requests with ``apply_chat_template`` need it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from tokenizers import Tokenizer

__all__ = ["KeepSpecial", "TextTokenizer", "load_tokenizer", "tokenizer_dir_of"]


def tokenizer_dir_of(engine_dir: str | Path) -> Path:
    """``<bundle>/tokenizer`` (contract section 3), or the folder itself when it holds tokenizer.json."""
    p = Path(engine_dir)
    for cand in (p / "tokenizer", p):
        if (cand / "tokenizer.json").is_file():
            return cand
    raise FileNotFoundError(f"{p}: no tokenizer/tokenizer.json in the engine bundle; rebuild with make build")


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer, chat_template: str | None = None,
                 special: dict[str, str] | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.special = special or {}
        self._template = None  # compiled lazily

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int:
        """The end token's id (tokenizer_config.json's eos_token), or -1 when none is known."""
        name = self.special.get("eos_token")
        tid = self.tokenizer.token_to_id(name) if name else None
        return -1 if tid is None else int(tid)

    def encode(self, text: str, chat: bool = False) -> list[int]:
        if chat:
            text = self.render_chat(text)
            # the template already spells out the special tokens; adding BOS again would double it
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        return self.tokenizer.encode(text).ids

    def render_chat(self, user_text: str) -> str:
        return self.render_messages([{"role": "user", "content": user_text}])

    def render_messages(self, messages: list[dict], tools: list[dict] | None = None,
                        extra: dict | None = None) -> str:
        """A whole conversation (``{"role", "content"}`` dicts, content as text) through the chat
        template, ending with the assistant's turn (the OpenAI front door's chat requests).
        ``tools``: OpenAI's tool objects, for a template that renders them (transformers' convention).
        ``extra``: more template variables (``chat_template_kwargs`` such as ``enable_thinking``); the
        caller keeps them off the names set here."""
        if not self.chat_template:
            raise ValueError("apply_chat_template: this engine's tokenizer has no chat_template")
        if self._template is None:
            import jinja2.sandbox  # only chat requests pay for it
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self._template = env.from_string(self.chat_template)
        return self._template.render(**(extra or {}), messages=messages, tools=tools, add_generation_prompt=True,
                                     **self.special)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def keeping_special(self, end_ids: Sequence[int]) -> "KeepSpecial":
        """A decoder for one request that asked for special tokens in its text."""
        return KeepSpecial(self.tokenizer, frozenset(end_ids))

    def words(self, words: tuple[str, ...] | list[str]) -> list[list[int]]:
        """Stop/bad words -> token sequences, tokenized as continuations (no special tokens)."""
        return [self.tokenizer.encode(w, add_special_tokens=False).ids for w in words if w]


class KeepSpecial:
    """Decodes with special tokens kept as their text (``[TOOL_CALLS]``, ``<|channel|>``), except the
    end tokens that stopped the request: they end an answer and are never part of its text."""

    def __init__(self, tokenizer: Tokenizer, end_ids: frozenset[int]):
        self.tokenizer, self.end_ids = tokenizer, end_ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i not in self.end_ids], skip_special_tokens=False)


def load_tokenizer(engine_or_tokenizer_dir: str | Path) -> TextTokenizer:
    d = tokenizer_dir_of(engine_or_tokenizer_dir)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    cfg: dict = {}
    if (d / "tokenizer_config.json").is_file():
        cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
    template = cfg.get("chat_template")
    if not template and (d / "chat_template.jinja").is_file():  # transformers >= 4.5x writes it apart
        template = (d / "chat_template.jinja").read_text(encoding="utf-8")
    special = {k: v for k in ("bos_token", "eos_token") if isinstance(v := cfg.get(k), str)}
    return TextTokenizer(tok, template if isinstance(template, str) else None, special)
