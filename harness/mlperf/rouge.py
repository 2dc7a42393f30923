"""ROUGE as the MLPerf LLM accuracy scripts compute it, without nltk.

The reference scripts score with Google's `rouge_score` (use_stemmer=True), average the per-sample
F-measures and scale by 100. For ROUGE-Lsum they first put each sentence on its own line with
nltk's punkt tokenizer; punkt's model data is not installable here, so `split_sentences` is a
small rule-based splitter instead (end punctuation followed by whitespace and an upper-case
letter, digit or quote, skipping common abbreviations). It agrees with punkt on ordinary prose;
on unusual text ROUGE-Lsum can differ slightly from the official number — ROUGE-1/2/L do not
depend on it.
"""
from __future__ import annotations

import re

_ABBREV = {"mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "vs", "etc", "inc", "ltd", "co",
           "corp", "no", "fig", "e.g", "i.e", "u.s", "u.k", "jan", "feb", "mar", "apr", "jun",
           "jul", "aug", "sep", "sept", "oct", "nov", "dec", "gen", "gov", "sen", "rep", "lt", "col"}
_BOUNDARY = re.compile(r"([.!?][\"')\]]*)\s+(?=[\"'(\[]?[A-Z0-9])")


def split_sentences(text: str) -> list[str]:
    """Split prose into sentences (see module docstring for the rules)."""
    text = text.strip()
    if not text:
        return []
    out, start = [], 0
    for m in _BOUNDARY.finditer(text):
        end = m.end(1)
        last_word = re.split(r"\s", text[start:end].rstrip(".!?\"')]"))[-1].lower()
        # "U.S." / "e.g." / "Dr." / single initials ("J.") do not end a sentence
        if last_word.rstrip(".") in _ABBREV or re.fullmatch(r"[a-z]", last_word.rstrip(".")):
            continue
        out.append(text[start:end].strip())
        start = m.end()
    tail = text[start:].strip()
    if tail:
        out.append(tail)
    return out


ROUGE_KEYS = ("rouge1", "rouge2", "rougeL", "rougeLsum")


def rouge_scores(predictions: list[str], references: list[str]) -> dict[str, float]:
    """Mean F-measure x 100 of ROUGE-1/2/L/Lsum over aligned prediction/reference pairs,
    rounded to 4 decimals like the reference evaluation scripts."""
    from rouge_score import rouge_scorer

    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions but {len(references)} references")
    if not predictions:
        raise ValueError("no predictions to score")
    scorer = rouge_scorer.RougeScorer(list(ROUGE_KEYS), use_stemmer=True)
    totals = dict.fromkeys(ROUGE_KEYS, 0.0)
    for pred, ref in zip(predictions, references):
        # newline-separated sentences are what rougeLsum splits on
        pred_l, ref_l = "\n".join(split_sentences(pred)), "\n".join(split_sentences(ref))
        s = scorer.score(ref_l, pred_l)
        for k in ROUGE_KEYS:
            totals[k] += s[k].fmeasure
    return {k: round(100.0 * v / len(predictions), 4) for k, v in totals.items()}
