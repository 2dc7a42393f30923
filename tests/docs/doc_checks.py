"""What the documentation checks read: the figures it quotes from result files, and its wording.

A figure quoted from a result file carries a marker right after the number, invisible once rendered:

    11,844<!-- fig gpu-bench-h100.json throughput.output_tok_s --> output tok/s
    78<!-- fig decode-attention-h100.json graphed.rows.4.fraction_of_copy_bw *100 -->%

naming the file (under docs/perf/), the key path in its JSON (list items by index) and, optionally, one
scale (``*100``, ``/1073741824``). The quoted number must be the file's value rounded to the digits
quoted, so editing either side alone fails the check.
"""
from __future__ import annotations

import dataclasses
import json
import re
from decimal import Decimal
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PERF = REPO / "docs" / "perf"

MARKER = re.compile(r"<!--\s*fig\s+(?P<body>.*?)-->", re.S)
NUMBER_BEFORE = re.compile(r"(?P<num>-?\d[\d,]*(?:\.\d+)?)\s*$")
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
    for part in fig.key.split("."):
        if isinstance(data, list):
            data = data[int(part)]
        elif isinstance(data, dict) and part in data:
            data = data[part]
        else:
            raise KeyError(f"{fig.file} has no key {fig.key!r} (stops at {part!r})")
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
    rounded = Decimal(repr(value)).quantize(Decimal(1).scaleb(exponent))
    if rounded != quoted:
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
