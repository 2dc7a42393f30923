"""The two spellings of a vocabulary (byte-level BPE, SentencePiece with byte fallback) as the
grammar library and byte-level tools read them, on the real SmolLM2 and Gemma 3 270M tokenizers.

The grammar check is the one a forced tool call on Gemma 3 failed before the spelling was told to
xgrammar: Gemma's vocabulary has a piece spelled ``Ġ`` (two bytes of text); read as byte-level BPE
it passed for the space after a JSON colon."""
from __future__ import annotations

import json

import pytest

from backend.engine.guided import tokenizer_info
from backend.engine.vocab import BYTE_FALLBACK, BYTE_LEVEL, adds_prefix_space, token_bytes, vocab_kind

pytestmark = pytest.mark.slow   # the real Gemma 3 vocabulary (262k pieces)

TEXTS = ["Hello world", '{"city": "Paris", "days": 3}', "line one\nline two\n\n\ttab",
         "naïve café, Straße, 日本語, 😀🎉", "\x00\x01 control bytes \x7f"]


@pytest.fixture(scope="module")
def gemma():
    from builder.gguf_import import read_header
    from builder.gguf_models import gemma3_270m_gguf
    from builder.gguf_tokenizer import build_tokenizer
    tok = build_tokenizer(read_header(gemma3_270m_gguf())[0])[0]
    return tok, json.loads(tok.to_str())


@pytest.fixture(scope="module")
def smollm2(smollm2_hf_dir):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(smollm2_hf_dir / "tokenizer.json"))
    return tok, json.loads(tok.to_str())


def test_each_tokenizer_is_read_in_its_own_spelling(gemma, smollm2):
    assert vocab_kind(gemma[1]) == BYTE_FALLBACK and not adds_prefix_space(gemma[1])
    assert vocab_kind(smollm2[1]) == BYTE_LEVEL


@pytest.mark.parametrize("which", ["gemma", "smollm2"])
def test_token_bytes_join_to_the_text(which, request):
    tok, tok_json = request.getfixturevalue(which)
    spelled = token_bytes(tok_json)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert b"".join(spelled[i] for i in ids) == text.encode(), (text, ids)


def test_a_gemma_piece_spelled_like_a_byte_level_space_is_not_a_space(gemma):
    import xgrammar as xgr
    tok, tok_json = gemma
    ids = {s: i for s, i in tok.get_vocab().items()}
    assert "Ġ" in ids and "▁" in ids   # the piece that fooled the grammar, and Gemma's real space
    info = tokenizer_info(tok_json, tok.get_vocab_size(), [1, 106])
    schema = {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}}
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info, max_threads=1)
                                 .compile_json_schema(json.dumps(schema), any_whitespace=False))
    for t in tok.encode('{"a":', add_special_tokens=False).ids:
        assert matcher.accept_token(t)
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    matcher.fill_next_token_bitmask(mask, 0)
    allowed = lambda i: bool((int(mask[0, i // 32]) >> (i % 32)) & 1)   # noqa: E731
    assert allowed(ids["▁"]) and not allowed(ids["Ġ"])
    # and as byte-level BPE (what the guide compiler assumed for every tokenizer) it would pass
    wrong = xgr.TokenizerInfo([s for s, _ in sorted(ids.items(), key=lambda kv: kv[1])], xgr.VocabType.BYTE_LEVEL,
                              vocab_size=info.vocab_size, stop_token_ids=[1])
    m2 = xgr.GrammarMatcher(xgr.GrammarCompiler(wrong, max_threads=1)
                            .compile_json_schema(json.dumps(schema), any_whitespace=False))
    for t in tok.encode('{"a":', add_special_tokens=False).ids:
        m2.accept_token(t)
    assert m2.accept_token(ids["Ġ"])
