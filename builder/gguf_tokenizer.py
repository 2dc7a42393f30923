"""A SentencePiece-BPE tokenizer (Gemma 3) rebuilt from a GGUF's tokenizer metadata.

transformers' GGUF tokenizer conversion gets Gemma 3 wrong (no ``<bos>``, and "The capital of France
is" splits into 10 ids where the model was trained on 5), and the model then generates garbage. The
GGUF carries everything SentencePiece used: pieces, scores and types. SentencePiece's BPE merges the
adjacent pair whose joined piece has the highest score; a ``tokenizers`` BPE merges the pair with the
lowest rank, so listing every (left, right) split of every normal piece, best score first, gives the
same segmentation. Other SentencePiece rules, as they map onto ``tokenizers``:
- spaces become U+2581 and no prefix space is added (``add_space_prefix`` false for Gemma 3);
- a character outside the vocabulary falls back to its UTF-8 bytes (``<0xNN>`` pieces);
- user-defined pieces (newline and space runs, HTML tags) are matched whole before BPE and never
  merged: added tokens. llama.cpp's converter already wrote their U+2581 as plain spaces, so they
  are matched in the raw text;
- control pieces (``<bos>``, ``<start_of_turn>``, ...) are special added tokens.
"""
from __future__ import annotations

from typing import Any

# SentencePiece piece types, as GGUF's tokenizer.ggml.token_type stores them
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"


class TokenizerMetadataError(ValueError):
    """The GGUF's tokenizer fields are missing or inconsistent (the message names the field)."""


def _fields(meta: dict[str, Any]) -> tuple[list[str], list[float], list[int]]:
    model = meta.get("tokenizer.ggml.model")
    if model != "llama":
        raise TokenizerMetadataError(f"tokenizer.ggml.model is {model!r}; this builder reads SentencePiece "
                                     f"('llama') vocabularies only")
    tokens, scores, types = (meta.get(f"tokenizer.ggml.{k}") for k in ("tokens", "scores", "token_type"))
    for key, value in (("tokens", tokens), ("scores", scores), ("token_type", types)):
        if not isinstance(value, list) or not value:
            raise TokenizerMetadataError(f"tokenizer.ggml.{key} is missing or empty")
    if not len(tokens) == len(scores) == len(types):
        raise TokenizerMetadataError(f"tokenizer.ggml.tokens/scores/token_type have different lengths "
                                     f"({len(tokens)}/{len(scores)}/{len(types)})")
    seen: set[str] = set()
    for t in tokens:
        if t in seen:
            raise TokenizerMetadataError(f"tokenizer.ggml.tokens lists {t!r} twice")
        seen.add(t)
    if meta.get("tokenizer.ggml.add_space_prefix", False):
        # the Gemma 3 path below never adds one; a vocabulary trained with it needs a Prepend normalizer
        raise TokenizerMetadataError("tokenizer.ggml.add_space_prefix is true; only vocabularies without "
                                     "a prefix space (Gemma 3) are built here")
    return tokens, scores, types


def sentencepiece_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every split of every normal piece into two normal pieces, ordered as SentencePiece's BPE would
    apply them: by the joined piece's score, best first (then by id: SentencePiece breaks score ties
    by position, which a rank table cannot express; Gemma 3's normal scores are all distinct)."""
    normal = {t for t, ty in zip(tokens, types) if ty == NORMAL}
    merges = []
    for tid in sorted((i for i, ty in enumerate(types) if ty == NORMAL), key=lambda i: (-scores[i], i)):
        piece = tokens[tid]
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                merges.append((left, right))
    return merges


def build_tokenizer(meta: dict[str, Any]):
    """(tokenizers.Tokenizer, special token names {"bos_token": "<bos>", ...}) from GGUF metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE

    tokens, scores, types = _fields(meta)
    vocab = {t: i for i, t in enumerate(tokens)}
    special = {}
    for name, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "padding_token_id"),
                      ("unk", "unknown_token_id")):
        tid = meta.get(f"tokenizer.ggml.{key}")
        if tid is None:
            continue
        if not isinstance(tid, int) or not 0 <= tid < len(tokens):
            raise TokenizerMetadataError(f"tokenizer.ggml.{key} is {tid!r}, outside the {len(tokens)}-token "
                                         f"vocabulary")
        special[f"{name}_token"] = tokens[tid]
    bytes_ok = all(f"<0x{b:02X}>" in vocab for b in range(256))
    tok = Tokenizer(BPE(vocab=vocab, merges=sentencepiece_merges(tokens, scores, types),
                        unk_token=special.get("unk_token"), fuse_unk=True, byte_fallback=bytes_ok,
                        dropout=None))
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    added = [AddedToken(t, special=ty in (CONTROL, UNKNOWN), normalized=False)
             for t, ty in zip(tokens, types) if ty in (CONTROL, UNKNOWN, USER_DEFINED)]
    tok.add_tokens(added)   # ids already in the vocabulary: add_tokens only marks them whole-match
    tok.add_special_tokens([a for a in added if a.special])
    bos = special.get("bos_token")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        bid = vocab[bos]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bid)])
    return tok, special


def save_tokenizer(meta: dict[str, Any], out) -> dict[str, str]:
    """Write tokenizer.json and tokenizer_config.json into the folder out; returns the special tokens.

    tokenizer_config.json names PreTrainedTokenizerFast, which loads tokenizer.json as written: a
    Gemma tokenizer class would rebuild its own pipeline around the vocabulary instead.
    """
    import json
    from pathlib import Path

    tok, special = build_tokenizer(meta)
    out = Path(out)
    tok.save(str(out / "tokenizer.json"))
    cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", **special,
                           "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                           "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
                           "clean_up_tokenization_spaces": False}
    arch = meta.get("general.architecture")
    if isinstance(meta.get(f"{arch}.context_length"), int):
        cfg["model_max_length"] = meta[f"{arch}.context_length"]
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        cfg["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    return special
