"""ROUGE reproduces hand-computed scores; the sentence splitter used for ROUGE-Lsum."""
import pytest

from harness.mlperf.rouge import rouge_scores, split_sentences


def test_known_pair():
    # prediction "the cat sat on the mat" vs reference "the cat is on the mat" (6 tokens each):
    #   ROUGE-1: shared unigrams the x2, cat, on, mat = 5 -> P = R = 5/6 -> F = 83.3333
    #   ROUGE-2: bigrams pred {the cat, cat sat, sat on, on the, the mat},
    #            ref {the cat, cat is, is on, on the, the mat}: 3 shared of 5 -> F = 60.0
    #   ROUGE-L: LCS "the cat on the mat" = 5 -> F = 83.3333; one sentence, so Lsum = L
    assert rouge_scores(["the cat sat on the mat"], ["the cat is on the mat"]) == {
        "rouge1": 83.3333, "rouge2": 60.0, "rougeL": 83.3333, "rougeLsum": 83.3333}


def test_sentence_order_separates_rougeL_from_rougeLsum():
    # "The cat sat. The dog ran." vs "The dog ran. The cat sat.":
    #   ROUGE-1 = 100 (same words); ROUGE-2: 4 of 5 bigrams shared ("sat the" vs "ran the") -> 80
    #   ROUGE-L over the whole text: LCS 3 of 6 -> 50; ROUGE-Lsum per sentence: union LCS 6/6 -> 100
    s = rouge_scores(["The cat sat. The dog ran."], ["The dog ran. The cat sat."])
    assert s == {"rouge1": 100.0, "rouge2": 80.0, "rougeL": 50.0, "rougeLsum": 100.0}


def test_mean_over_samples_and_errors():
    s = rouge_scores(["a b", "x y"], ["a b", "p q"])  # 100 and 0 -> mean 50
    assert s["rouge1"] == 50.0
    with pytest.raises(ValueError, match="2 predictions but 1 references"):
        rouge_scores(["a", "b"], ["a"])
    with pytest.raises(ValueError, match="no predictions"):
        rouge_scores([], [])


@pytest.mark.parametrize("text,expected", [
    ("Hello there. General Kenobi!", ["Hello there.", "General Kenobi!"]),
    ("Dr. Smith met Mr. Jones in the U.S. yesterday. They ate.",
     ["Dr. Smith met Mr. Jones in the U.S. yesterday.", "They ate."]),
    ('He said "stop." Then 3 cars left.', ['He said "stop."', "Then 3 cars left."]),
    ("J. R. R. Tolkien wrote it. It sold.", ["J. R. R. Tolkien wrote it.", "It sold."]),
    ("version 2.5 is out. see notes", ["version 2.5 is out. see notes"]),
    ("", []),
])
def test_split_sentences(text, expected):
    assert split_sentences(text) == expected
