"""How a bundle's ``tokenizer.json`` spells its tokens, for the grammar library and byte-level tools.

Two spellings occur in the families Kiln builds:

* byte-level BPE (SmolLM2, Llama 3, Qwen): every byte is one printable character (a space is ``Ġ``,
  a newline ``Ċ``); the tokenizer's decoder or pre-tokenizer is ``ByteLevel``;
* SentencePiece pieces (Gemma, Mistral, Llama 2): a space is ``▁`` and bytes that no piece covers
  are the byte-fallback tokens ``<0x0A>`` and the like; the decoder has ``ByteFallback``.

The grammar library must be told which, or it reads a piece literally: with Gemma's vocabulary
taken as byte-level, a piece spelled ``Ġ`` (a real piece of Gemma's, two bytes of text) passes for
the space a JSON document allows, and a forced tool call comes out as ``{"name":Ġ"get...``.
"""
from __future__ import annotations

from typing import Any

__all__ = ["BYTE_LEVEL", "BYTE_FALLBACK", "RAW", "vocab_kind", "vocab_strings", "adds_prefix_space",
           "token_bytes"]

BYTE_LEVEL, BYTE_FALLBACK, RAW = "byte_level", "byte_fallback", "raw"


def _parts(node: dict | None) -> list[dict]:
    """A normalizer, pre-tokenizer or decoder and the parts of a ``Sequence`` of them, flattened."""
    if not node:
        return []
    inner = node.get("decoders") or node.get("pretokenizers") or node.get("normalizers")
    if node.get("type") == "Sequence" and inner:
        return [p for n in inner for p in _parts(n)]
    return [node]


def _types(tok_json: dict, *keys: str) -> set[str]:
    return {p.get("type") for k in keys for p in _parts(tok_json.get(k))}


def vocab_kind(tok_json: dict) -> str:
    """``byte_level``, ``byte_fallback`` (SentencePiece with ``<0xXX>`` pieces) or ``raw``."""
    if "ByteLevel" in _types(tok_json, "decoder", "pre_tokenizer"):
        return BYTE_LEVEL
    if tok_json.get("model", {}).get("byte_fallback") or "ByteFallback" in _types(tok_json, "decoder"):
        return BYTE_FALLBACK
    return RAW


def adds_prefix_space(tok_json: dict) -> bool:
    """Whether encoding puts a ``▁`` before the text (SentencePiece's dummy prefix): a normalizer that
    prepends it, or a Metaspace pre-tokenizer that does. Gemma 3 does not; Llama 2 does."""
    for p in _parts(tok_json.get("normalizer")):
        if p.get("type") == "Prepend" and p.get("prepend") == "▁":
            return True
    for p in _parts(tok_json.get("pre_tokenizer")):
        if p.get("type") == "Metaspace":
            return p.get("prepend_scheme", "always" if p.get("add_prefix_space", True) else "never") != "never"
    return False


def vocab_strings(tok_json: dict) -> list[str]:
    """Token strings by id, as tokenizer.json stores them, added tokens included; ids with no token
    get an empty string (never allowed). A Unigram model's vocabulary is a list of [piece, score]."""
    model: dict[str, Any] = tok_json["model"]
    raw = model["vocab"]
    vocab = {s: i for i, (s, _score) in enumerate(raw)} if isinstance(raw, list) else dict(raw)
    for t in tok_json.get("added_tokens", []):
        vocab[t["content"]] = t["id"]
    out = [""] * (max(vocab.values()) + 1)
    for s, i in vocab.items():
        out[i] = s
    return out


def _byte_level_decoder() -> dict[str, int]:
    """Byte-level BPE spells every byte as one printable character: bytes that are printable
    (``!``..``~``, ``¡``..``¬``, ``®``..``ÿ``) as themselves, the others as U+0100 onwards in order.
    Returns character -> byte."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def _fallback_bytes(s: str) -> bytes:
    if len(s) == 6 and s.startswith("<0x") and s.endswith(">"):
        try:
            return bytes([int(s[3:5], 16)])
        except ValueError:
            pass
    return s.replace("▁", " ").encode()


def token_bytes(tok_json: dict) -> list[bytes]:
    """Each token's bytes in the tokenizer's own spelling; added tokens as their UTF-8 text."""
    kind = vocab_kind(tok_json)
    added = {t["id"] for t in tok_json.get("added_tokens", [])}
    dec = _byte_level_decoder()
    out = []
    for i, s in enumerate(vocab_strings(tok_json)):
        if i in added or kind == RAW:
            out.append(s.encode())
        elif kind == BYTE_FALLBACK:
            out.append(_fallback_bytes(s))
        else:
            out.append(s.encode() if any(c not in dec for c in s) else bytes(dec[c] for c in s))
    return out
