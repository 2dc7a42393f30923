"""Every figure the README and docs/ quote from a result file (marked ``<!-- fig FILE KEY -->``, see
tests/docs/doc_checks.py) is that file's number."""
from __future__ import annotations

import shutil

from tests.docs.doc_checks import PERF, REPO, check_figures, doc_files, figures


def test_every_marked_figure_agrees_with_its_result_file():
    count, problems = check_figures(doc_files())
    assert not problems, "figures that disagree with their result files:\n" + "\n".join(problems)
    # the headline table alone marks more than this: a check that finds no markers proves nothing
    assert count >= 15, count


def test_the_readme_headline_figures_are_marked():
    found, _ = figures(REPO / "README.md")
    assert {f.file for f in found} >= {"gpu-bench-h100.json", "decode-attention-h100.json", "openai-aiperf.json"}


def test_an_edited_figure_fails_the_check(tmp_path):
    """On a copy: change one quoted number, then the file it quotes, each alone fails."""
    readme = tmp_path / "README.md"
    shutil.copy(REPO / "README.md", readme)
    shutil.copytree(PERF, tmp_path / "perf", ignore=shutil.ignore_patterns("*.png", "*.csv"))
    assert check_figures([readme], tmp_path / "perf")[1] == []
    marked = "11,844<!-- fig gpu-bench-h100.json throughput.output_tok_s -->"
    text = readme.read_text()
    assert marked in text
    readme.write_text(text.replace(marked, marked.replace("11,844", "11,845")))
    _, problems = check_figures([readme], tmp_path / "perf")
    assert len(problems) == 1 and "quotes 11,845" in problems[0] and "11843.6" in problems[0], problems
    readme.write_text(text)
    result = tmp_path / "perf" / "gpu-bench-h100.json"
    result.write_text(result.read_text().replace('"output_tok_s": 11843.619416822221', '"output_tok_s": 12000.0'))
    assert any("12000" in p for p in check_figures([readme], tmp_path / "perf")[1])


def test_a_marker_without_a_number_or_key_is_a_problem(tmp_path):
    doc = tmp_path / "page.md"
    doc.write_text("fast <!-- fig gpu-bench-h100.json throughput.output_tok_s -->\n"
                   "12<!-- fig gpu-bench-h100.json no.such.key -->\n"
                   "12<!-- fig missing.json a -->\n")
    _, problems = check_figures([doc])
    assert len(problems) == 3, problems
    assert "unreadable" in problems[0] and "no key 'no.such.key'" in problems[1] and "missing.json" in problems[2]
