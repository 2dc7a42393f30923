"""What every CPU benchmark records about the machine (harness/bench/perfinfo.py)."""
from __future__ import annotations

from harness.bench import perfinfo


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

    from harness.bench.perfinfo import write_result

    out = tmp_path / "new" / "r.json"
    write_result({"a": 1, "b": [2.5]}, out)
    assert json.loads(out.read_text()) == {"a": 1, "b": [2.5]} and out.read_text().endswith("\n")
    assert f"wrote {out}" in capsys.readouterr().out
    write_result({"a": 2}, "-")
    assert list(tmp_path.iterdir()) == [tmp_path / "new"] and capsys.readouterr().out == ""
