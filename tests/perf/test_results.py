"""The one result writer (harness/perf/lib/results.py): what every benchmark records about the machine, and
where its file goes (build/perf/ unless a path is named; a committed docs/perf/ file only when named)."""
from __future__ import annotations

from harness.perf.lib import results as perfinfo


def test_cpu_flags_reports_each_simd_flag_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16x\n")
    flags = perfinfo.cpu_flags(info)
    assert list(flags) == list(perfinfo.SIMD_FLAGS)
    assert [f for f, on in flags.items() if on] == ["avx2", "fma", "avx512f"]   # whole words only
    assert not any(perfinfo.cpu_flags(tmp_path / "missing").values())
    assert perfinfo.cpu_machine()["cpu_flags"].keys() == flags.keys()


def test_write_result_makes_the_folder_and_writes_json_or_nothing_for_dash(tmp_path, capsys):
    import json

    from harness.perf.lib.results import write_result

    out = tmp_path / "new" / "r.json"
    write_result({"a": 1, "b": [2.5]}, out)
    assert json.loads(out.read_text()) == {"a": 1, "b": [2.5]} and out.read_text().endswith("\n")
    assert f"wrote {out}" in capsys.readouterr().out
    write_result({"a": 2}, "-")
    assert list(tmp_path.iterdir()) == [tmp_path / "new"] and capsys.readouterr().out == ""


def test_header_records_the_command_as_typed_without_machine_paths(monkeypatch):
    from harness.perf.lib import results

    monkeypatch.delenv(results.COMMAND_ENV, raising=False)
    head = results.header("x", "harness.perf.step.host_overhead",
                          ["--steps", "5", "--output", "/tmp/somewhere/r.json", f"--engine={results.REPO}/build/e"])
    assert head["command"] == ("python -m harness.perf.step.host_overhead --steps 5 --output OUT/r.json "
                               "--engine=build/e")
    assert {"benchmark", "date", "command", "commit", "machine", "load"} <= set(head)
    assert head["machine"]["cpu"] and head["machine"]["cores"] >= 1
    # started by the suite runner: the runner's command is what the user typed
    monkeypatch.setenv(results.COMMAND_ENV, "python -m harness.perf run host-overhead -- --steps 5")
    assert results.header("x", "m", [])["command"] == "python -m harness.perf run host-overhead -- --steps 5"


def test_results_go_under_build_perf_unless_a_path_is_named(tmp_path, monkeypatch, capsys):
    """A benchmark run without --out writes build/perf/<name> and leaves a committed docs/perf/ file
    alone; naming the docs/perf/ file replaces it."""
    import json

    from harness.perf.step import host_overhead

    docs = tmp_path / "docs" / "perf"
    docs.mkdir(parents=True)
    committed = docs / "host-overhead.json"
    committed.write_text('{"committed": true}\n')
    monkeypatch.setenv("KILN_PERF_OUT", str(tmp_path / "build" / "perf"))
    small = ["--num-seqs", "4", "--steps", "3", "--max-num-tokens", "64", "--max-seq-len", "1024", "--runs", "1",
             "--scenarios", "decode"]
    assert host_overhead.main(small) == 0
    default = tmp_path / "build" / "perf" / "host-overhead.json"
    assert json.loads(default.read_text())["results"]["decode"]["steps"] == 3
    assert json.loads(committed.read_text()) == {"committed": True}
    assert host_overhead.main([*small, "--output", str(committed)]) == 0
    assert json.loads(committed.read_text())["results"]["decode"]["steps"] == 3
    capsys.readouterr()
