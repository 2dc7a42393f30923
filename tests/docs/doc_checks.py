"""What the documentation checks read: the figures it quotes from result files, and its wording.

A figure quoted from a result file carries a marker right after the number, invisible once rendered:

    11,844<!-- fig gpu-bench-h100.json throughput.output_tok_s --> output tok/s
    78<!-- fig decode-attention-h100.json graphed.rows.4.fraction_of_copy_bw *100 -->%

naming the file (under docs/perf/), the key path in its JSON (list items by index; a key may hold
dots) and, optionally, one scale (``*100``, ``/1073741824``). The quoted number must be the file's
value rounded to the digits quoted, so editing either side alone fails the check.
"""
from __future__ import annotations

import dataclasses
import json
import re
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PERF = REPO / "docs" / "perf"

MARKER = re.compile(r"<!--\s*fig\s+(?P<body>.*?)-->", re.S)
# no sign: "193.8-298.4" is a range, and no quoted figure is negative
NUMBER_BEFORE = re.compile(r"(?P<num>\d[\d,]*(?:\.\d+)?)\s*$")
SCALE = re.compile(r"^(?P<op>[*/])(?P<factor>\d+(?:\.\d+)?)$")


@dataclasses.dataclass(frozen=True)
class Figure:
    doc: Path
    line: int
    quoted: str        # as written, e.g. "11,844"
    file: str          # relative to docs/perf/
    key: str
    scale: str | None

    def where(self) -> str:
        return f"{self.doc.relative_to(REPO) if self.doc.is_relative_to(REPO) else self.doc}:{self.line}"


def doc_files(root: Path = REPO) -> list[Path]:
    """README.md and every Markdown page under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def figures(doc: Path) -> tuple[list[Figure], list[str]]:
    """The marked figures of one page, and the markers that could not be read (as problems)."""
    text = doc.read_text(encoding="utf-8")
    found, problems = [], []
    for m in MARKER.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        parts = m.group("body").split()
        num = NUMBER_BEFORE.search(text[max(0, m.start() - 40):m.start()])
        if num is None or len(parts) not in (2, 3) or (len(parts) == 3 and not SCALE.match(parts[2])):
            problems.append(f"{doc}:{line}: unreadable figure marker {m.group(0)!r}: expected a number right "
                            "before <!-- fig FILE KEY [*N|/N] -->")
            continue
        found.append(Figure(doc, line, num.group("num"), parts[0], parts[1], parts[2] if len(parts) == 3 else None))
    return found, problems


def file_value(fig: Figure, perf: Path = PERF) -> float:
    """The figure's value in its result file (scaled); KeyError/FileNotFoundError say what is missing."""
    path = perf / fig.file
    data = json.loads(path.read_text(encoding="utf-8"))
    parts = fig.key.split(".")
    while parts:
        if isinstance(data, list):
            data = data[int(parts.pop(0))]
            continue
        # a key may hold dots itself ("tokens_per_pass_for_2.5x"): the longest run of parts that is one
        n = next((n for n in range(len(parts), 0, -1)
                  if isinstance(data, dict) and ".".join(parts[:n]) in data), 0)
        if n == 0:
            raise KeyError(f"{fig.file} has no key {fig.key!r} (stops at {parts[0]!r})")
        data, parts = data[".".join(parts[:n])], parts[n:]
    if isinstance(data, bool) or not isinstance(data, (int, float)):
        raise KeyError(f"{fig.file} {fig.key} is {data!r}, not a number")
    value = float(data)
    if fig.scale:
        m = SCALE.match(fig.scale)
        factor = float(m.group("factor"))
        value = value * factor if m.group("op") == "*" else value / factor
    return value


def disagreement(fig: Figure, perf: Path = PERF) -> str | None:
    """None when the quoted number is the file's value rounded to the quoted digits, else why not."""
    try:
        value = file_value(fig, perf)
    except (OSError, KeyError, ValueError, IndexError) as e:
        return f"{fig.where()}: {fig.quoted} quotes {fig.file} {fig.key}: {e}"
    quoted = Decimal(fig.quoted.replace(",", ""))
    exponent = quoted.as_tuple().exponent
    # a tie (3710.5 quoted as 3,710 or 3,711) may go either way
    step = Decimal(1).scaleb(exponent)
    rounded = Decimal(repr(value)).quantize(step, rounding=ROUND_HALF_UP)
    if quoted not in (rounded, Decimal(repr(value)).quantize(step, rounding=ROUND_HALF_EVEN)):
        return (f"{fig.where()}: quotes {fig.quoted} but {fig.file} {fig.key}"
                f"{' ' + fig.scale if fig.scale else ''} is {value:g} (rounded: {rounded})")
    return None


def check_figures(docs: list[Path], perf: Path = PERF) -> tuple[int, list[str]]:
    """(figures checked, problems) over ``docs``."""
    count, problems = 0, []
    for doc in docs:
        found, bad = figures(doc)
        problems += bad
        for fig in found:
            count += 1
            if (why := disagreement(fig, perf)) is not None:
                problems.append(why)
    return count, problems


# ---- product language --------------------------------------------------------------------------

# What the documentation must not say: it speaks of the product (what runs on which hardware, how to
# reproduce it), never of how it was written, who measured, or one machine's folders.
LANGUAGE_RULES = (
    ("an issue number", re.compile(r"(?<![\w&/])#\d+\b")),
    ("an issue reference", re.compile(r"\bissues?\b", re.I)),
    ("who lent a machine", re.compile(r"\blent\b", re.I)),
    ("a particular VM", re.compile(r"\bVMs?\b")),
    ("the people who wrote it", re.compile(r"\bengineers?\b", re.I)),
    ("a path of one machine", re.compile(r"(?<![\w.~-])/(?:tmp|root|work|home)/")),
    ("a notes file outside the repository", re.compile(r"\bshared/notes\b")),
)
TEXT_SUFFIXES = (".md", ".yaml", ".yml", ".pbtxt", ".tmpl", ".conf", ".py")   # .py: the model_repository models
# Written by `python -m harness.perf report` from the result files, not by hand: its wording is theirs,
# and it joins the check (drop it from here) once it is generated from files that pass it.
GENERATED: tuple[str, ...] = ()   # rendered pages that are left to their generator's own check
# Result files join the check from this date on (their top-level "date"): the ones written before it
# record the machine they ran on as it was then; a newer run replaces them.
RESULTS_CHECKED_FROM = "2026-12-02"


def language_files(root: Path = REPO) -> list[Path]:
    """README.md, docs/, configs/ and model_repository/ text, plus the result files written since
    RESULTS_CHECKED_FROM."""
    files = [root / "README.md"]
    for folder in ("docs", "configs", "model_repository"):
        files += sorted(p for p in (root / folder).rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES
                        and p.relative_to(root).as_posix() not in GENERATED)
    return files + recent_results(root / "docs" / "perf")


def recent_results(perf: Path) -> list[Path]:
    out = []
    for p in sorted(perf.rglob("*.json")):
        try:
            date = json.loads(p.read_text(encoding="utf-8")).get("date")
        except (ValueError, AttributeError):
            continue
        if isinstance(date, str) and date[:10] >= RESULTS_CHECKED_FROM:
            out.append(p)
    return out


def language_problems(files: list[Path]) -> list[str]:
    problems = []
    for path in files:
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for what, rule in LANGUAGE_RULES:
                if (m := rule.search(line)) is not None:
                    problems.append(f"{path}:{n}: {what} ({m.group(0)!r}): {line.strip()[:120]}")
    return problems
