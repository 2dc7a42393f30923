"""Incremental detokenization with the real SmolLM2 tokenizer (byte-level BPE)."""
from __future__ import annotations

import pytest

from backend.serving.conversion.detok import REPLACEMENT, StreamDetokenizer, decode_piece

MULTIBYTE = "Tokyo 東京タワー and a cat 🐱🐈‍⬛ café — naïve 日本語テキスト."


def _stream(tok, prompt, out_ids, stops=(), interval=1):
    det = StreamDetokenizer(tok, prompt, stops, interval=interval)
    chunks = []
    for i, t in enumerate(out_ids):
        c = det.push([t], finished=i == len(out_ids) - 1)
        if c is not None:
            chunks.append(c)
        if det.finished:
            break
    return chunks


def test_multibyte_tokens_really_split_characters(text_tokenizer):
    # guards the tests below: some single tokens of this text decode to a broken character
    ids = text_tokenizer.encode(MULTIBYTE)
    assert any(REPLACEMENT in text_tokenizer.decode([t]) for t in ids)


@pytest.mark.parametrize("interval", [1, 3])
def test_stream_never_emits_broken_characters(text_tokenizer, interval):
    prompt = text_tokenizer.encode("Say something:")
    ids = text_tokenizer.encode(MULTIBYTE)
    chunks = _stream(text_tokenizer, prompt, ids, interval=interval)
    assert all(REPLACEMENT not in c.text for c in chunks)
    assert "".join(c.text for c in chunks) == text_tokenizer.decode(ids)
    assert chunks[-1].finished and sum(len(c.ids) for c in chunks) == len(ids)
    # what postprocessing computes from (context, ids) alone matches what the host decided
    for c in chunks:
        assert decode_piece(text_tokenizer, c.context, c.ids) == c.text


def test_stop_string_cuts_text_and_finishes(text_tokenizer):
    ids = text_tokenizer.encode(" The answer is 42. END of story, more text follows")
    chunks = _stream(text_tokenizer, [], ids, stops=("END",))
    text = "".join(c.text for c in chunks)
    assert text == " The answer is 42. "
    last = chunks[-1]
    assert last.finished and last.stop == "END" and last.trim > 0
    piece = decode_piece(text_tokenizer, last.context, last.ids)
    assert piece[: len(piece) - last.trim] == last.text
    # tokens after the stop are not consumed
    assert sum(len(c.ids) for c in chunks) < len(ids)


def test_stop_string_prefix_is_held_back(text_tokenizer):
    # "EN" may become "END": it must not be sent before the next token decides
    ids = text_tokenizer.encode(" go ENOUGH said")
    det = StreamDetokenizer(text_tokenizer, [], ("END",))
    sent = ""
    for t in ids[:-1]:
        c = det.push([t])
        sent += c.text if c else ""
    assert "END" not in sent
    c = det.push([ids[-1]], finished=True)
    assert sent + c.text == text_tokenizer.decode(ids) and c.stop is None


def test_finished_with_nothing_pending_still_gives_a_final_chunk(text_tokenizer):
    det = StreamDetokenizer(text_tokenizer, [1, 2], ())
    c = det.push([], finished=True)
    assert c is not None and c.finished and c.ids == [] and c.text == ""
    assert det.push([5], finished=True) is None


def test_generation_ending_inside_a_character_drops_the_broken_tail(text_tokenizer):
    ids = text_tokenizer.encode("ok 🐱")
    cut = next(i for i in range(1, len(ids)) if text_tokenizer.decode(ids[:i]).endswith(REPLACEMENT))
    chunks = _stream(text_tokenizer, [], ids[:cut])
    assert "".join(c.text for c in chunks) == text_tokenizer.decode(ids[:cut]).rstrip(REPLACEMENT)
    assert chunks[-1].trim > 0


def test_stop_word_ids_end_the_stream_and_stay_in_the_text(text_tokenizer):
    # NVIDIA's stop words: matched on token ids, the stop word kept, nothing after it
    ids = text_tokenizer.encode(" The answer is 42. END of story, more text follows")
    word = text_tokenizer.encode(" END")
    k = next(i for i in range(len(ids)) if ids[i:i + len(word)] == word)
    for step in (1, 3, len(ids)):
        det = StreamDetokenizer(text_tokenizer, [], stop_ids=[word])
        chunks = [c for i in range(0, len(ids), step) if (c := det.push(ids[i:i + step]))]
        assert "".join(c.text for c in chunks) == text_tokenizer.decode(ids[:k + len(word)])
        assert chunks[-1].finished and chunks[-1].stop == " END" and chunks[-1].trim == 0
        assert sum(len(c.ids) for c in chunks) == k + len(word)


def test_stop_word_ids_do_not_match_inside_other_tokens(text_tokenizer):
    # "cat" inside "concatenate" is another tokenization: no token-sequence match, the text runs on
    ids = text_tokenizer.encode(" We concatenate the strings")
    word = text_tokenizer.encode("cat")
    assert all(ids[i:i + len(word)] != word for i in range(len(ids)))
    det = StreamDetokenizer(text_tokenizer, [], stop_ids=[word])
    c = det.push(ids, finished=True)
    assert c.text == text_tokenizer.decode(ids) and c.stop is None
