"""Kiln's Gemma 3 tokenizer, rebuilt from the GGUF's SentencePiece pieces, scores and types.

The real file's tests check the ids the model was trained on, decode(encode(s)) == s, and agree with
a plain re-implementation of SentencePiece's BPE (below: merge the adjacent pair whose joined piece
scores best, leftmost on ties; user-defined pieces whole; unknown characters as UTF-8 bytes).
"""
from __future__ import annotations

import json

import pytest

from builder.gguf_tokenizer import (BYTE, CONTROL, NORMAL, USER_DEFINED, TokenizerMetadataError,
                                    build_tokenizer, save_tokenizer, sentencepiece_merges)

SP = "\u2581"


def _sp_reference(text: str, tokens: list[str], scores: list[float], types: list[int]) -> list[int]:
    vocab = {t: i for i, t in enumerate(tokens)}
    user = sorted((t for t, ty in zip(tokens, types) if ty == USER_DEFINED), key=len, reverse=True)
    symbols: list[tuple[str, bool]] = []   # (piece, frozen: a user-defined piece never merges)
    i = 0
    while i < len(text):
        match = next((u for u in user if text.startswith(u, i)), None)
        if match:
            symbols.append((match, True))
            i += len(match)
        else:
            symbols.append((text[i].replace(" ", SP), False))
            i += 1
    while True:
        best = None
        for k in range(len(symbols) - 1):
            (a, fa), (b, fb) = symbols[k], symbols[k + 1]
            j = vocab.get(a + b)
            if fa or fb or j is None or types[j] != NORMAL:
                continue
            if best is None or scores[j] > best[0]:
                best = (scores[j], k)
        if best is None:
            break
        k = best[1]
        symbols[k:k + 2] = [(symbols[k][0] + symbols[k + 1][0], False)]
    ids = []
    for s, _ in symbols:
        ids.extend([vocab[s]] if s in vocab else [vocab[f"<0x{b:02X}>"] for b in s.encode()])
    return ids


def _tiny_meta(**over):
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "\n", "  "]
    types = [CONTROL, CONTROL, CONTROL, CONTROL, CONTROL, USER_DEFINED, USER_DEFINED]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [BYTE] * 256
    # "ab" scores above "bc": "abc" must become ab + c, although the bc merge is listed first by id
    normal = [("b", -9.0), ("c", -8.0), ("a", -7.0), (SP, -6.0), ("bc", -1.0), ("ab", -0.5), (SP + "a", -2.0),
              ("abc", -3.0)]
    tokens += [t for t, _ in normal]
    types += [NORMAL] * len(normal)
    scores = [0.0] * (len(tokens) - len(normal)) + [s for _, s in normal]
    meta = {"general.architecture": "gemma3", "gemma3.context_length": 64, "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 2,
            "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.padding_token_id": 0,
            "tokenizer.ggml.unknown_token_id": 3, "tokenizer.ggml.add_bos_token": True,
            "tokenizer.ggml.add_space_prefix": False}
    meta.update(over)
    return meta


def test_merges_follow_scores_not_ids():
    meta = _tiny_meta()
    merges = sentencepiece_merges(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"],
                                  meta["tokenizer.ggml.token_type"])
    assert merges == [("a", "b"), ("b", "c"), (SP, "a"), ("a", "bc"), ("ab", "c")]
    tok, special = build_tokenizer(meta)
    assert special == {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}
    enc = tok.encode("abc bca")
    # ab first (best score), then bc in "bca" (it beats abc), then abc; there is no ▁b piece
    assert enc.tokens == ["<bos>", "abc", SP, "bc", "a"]
    assert enc.ids[1:] == _sp_reference("abc bca", meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"],
                                        meta["tokenizer.ggml.token_type"])


def test_user_defined_whole_bytes_fallback_and_specials():
    tok, _ = build_tokenizer(_tiny_meta())
    enc = tok.encode("a  a\nz<start_of_turn>")
    assert enc.tokens == ["<bos>", "a", "  ", "a", "\n", "<0x7A>", "<start_of_turn>"]
    assert tok.decode(enc.ids) == "a  a\nz"                       # specials dropped, bytes fused back
    assert tok.encode("é", add_special_tokens=False).tokens == ["<0xC3>", "<0xA9>"]
    assert tok.decode(tok.encode("é a").ids) == "é a"


def test_no_bos_when_the_file_says_so():
    tok, _ = build_tokenizer(_tiny_meta(**{"tokenizer.ggml.add_bos_token": False}))
    assert tok.encode("ab").tokens == ["ab"]


@pytest.mark.parametrize("key, value, message", [
    ("tokenizer.ggml.model", "gpt2", "tokenizer.ggml.model is 'gpt2'"),
    ("tokenizer.ggml.scores", [], "tokenizer.ggml.scores is missing or empty"),
    ("tokenizer.ggml.token_type", [1, 1], "different lengths"),
    ("tokenizer.ggml.bos_token_id", 10**6, "tokenizer.ggml.bos_token_id is 1000000, outside"),
    ("tokenizer.ggml.add_space_prefix", True, "add_space_prefix is true"),
])
def test_bad_metadata_is_named(key, value, message):
    with pytest.raises(TokenizerMetadataError, match=message):
        build_tokenizer(_tiny_meta(**{key: value}))


def test_duplicate_piece_is_named():
    meta = _tiny_meta()
    meta["tokenizer.ggml.tokens"] = list(meta["tokenizer.ggml.tokens"])
    meta["tokenizer.ggml.tokens"][-1] = "ab"
    with pytest.raises(TokenizerMetadataError, match="lists 'ab' twice"):
        build_tokenizer(meta)


def test_saved_files(tmp_path):
    meta = _tiny_meta(**{"tokenizer.chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"})
    save_tokenizer(meta, tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["bos_token"] == "<bos>" and cfg["eos_token"] == "<eos>" and cfg["add_bos_token"] is True
    assert cfg["chat_template"].startswith("{{ bos_token }}") and cfg["model_max_length"] == 64
    from tokenizers import Tokenizer
    assert Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode("abc").tokens == ["<bos>", "abc"]
    (tmp_path / "plain").mkdir()
    save_tokenizer(_tiny_meta(), tmp_path / "plain")   # no template in the file: none written
    assert "chat_template" not in json.loads((tmp_path / "plain" / "tokenizer_config.json").read_text())


# ---- the real Gemma 3 270M vocabulary ------------------------------------------------------------

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  two  spaces,   three, and a trailing space ",
    "line one\nline two\n\n\nafter three newlines\r\nwindows\ttab\t\tx",
    "Digits 0123456789, 3.14159, -42 and 1e10",
    "naïve café, Ünïcödé, Straße, Ελληνικά, русский, 日本語のテキスト, 한국어, العربية",
    "emoji 😀🎉 and a family 👩‍👩‍👧 and flags 🇫🇷🇯🇵",
    "def f(x):\n    return x ** 2  # square\n",
    "<table><tr><td>cell</td></tr></table> and <b>bold</b>",
    "\x00\x01 control bytes \x7f and a rare 𓀀 glyph",
    "x" * 40 + " " + "ab" * 25,
]


@pytest.fixture(scope="module")
def gemma_meta():
    from builder.gguf_import import read_header
    from builder.gguf_models import gemma3_270m_gguf

    return read_header(gemma3_270m_gguf())[0]


@pytest.fixture(scope="module")
def gemma_tok(gemma_meta):
    return build_tokenizer(gemma_meta)[0]


@pytest.mark.slow
def test_trained_ids(gemma_tok):
    assert gemma_tok.encode("The capital of France is").ids == [2, 818, 5279, 529, 7001, 563]
    assert gemma_tok.decode([818, 5279, 529, 7001, 563]) == "The capital of France is"
    chat = gemma_tok.encode("<start_of_turn>user\nHi<end_of_turn>\n", add_special_tokens=False).ids
    assert chat[0] == 105 and chat[-2:] == [106, 107]   # turn markers whole, not spelled out


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_and_sentencepiece_agreement(gemma_tok, gemma_meta, text):
    ids = gemma_tok.encode(text).ids
    assert ids[0] == 2 and gemma_tok.decode(ids) == text
    ref = _sp_reference(text, gemma_meta["tokenizer.ggml.tokens"], gemma_meta["tokenizer.ggml.scores"],
                        gemma_meta["tokenizer.ggml.token_type"])
    assert ids[1:] == ref
