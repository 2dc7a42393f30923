"""The suite table (harness/perf/suites.py) is what runs: every make target and every GPU host step
names a row of it, and ``--dry-run`` of each row resolves its entry (module or script) and runs nothing."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from harness.perf.__main__ import main
from harness.perf.lib.results import REPO
from harness.perf.suites import BY_NAME, GPU_HOST, SUITES

# the make targets that ran a benchmark or a GPU check before the table existed, and the suite each runs
MAKE_TARGETS = {"bench": "serving", "bench-openai": "openai-aiperf", "bench-engine": "bench-engine",
                "bench-overhead": "host-overhead", "bench-kernels": "bench-kernels", "bench-eagle": "eagle",
                "bench-eagle-cost": "eagle-cost", "soak": "soak", "gpu-check-prepare": "gpu-check-prepare",
                "gpu-check": "gpu-check", "bench-gpu": "bench-gpu"}
# the GPU host script's parts before they became data
GPU_HOST_PARTS = ("check", "kernels", "dtests", "sweep", "ncu", "bench", "spec", "perf", "tp", "families")


def _recipe(target: str) -> str:
    text = (REPO / "Makefile").read_text()
    m = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", text, re.M)
    assert m, f"Makefile has no target {target}"
    return m.group(1)


@pytest.mark.parametrize("target", sorted(MAKE_TARGETS))
def test_every_former_make_target_runs_its_suite(target, capsys):
    recipe = _recipe(target)
    m = re.search(r"-m harness\.perf run ([\w-]+)", recipe)
    assert m and m.group(1) == MAKE_TARGETS[target], recipe
    assert BY_NAME[m.group(1)].make == target
    assert main(["run", m.group(1), "--dry-run", "--", "--some-arg", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{m.group(1)} (") and "--some-arg 1" in out


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_dry_run_of_every_suite_resolves_its_entry(name, capsys):
    assert main(["run", name, "--dry-run"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    suite = BY_NAME[name]
    assert f"budget {suite.budget_s} s" in out and suite.entry[-1] in out


def test_dry_run_fails_on_a_missing_module(monkeypatch, capsys):
    from harness.perf import runner, suites
    broken = suites.Suite("broken", "step", "cpu", 1, ("-m", "harness.perf.no_such_module"), "a typo")
    monkeypatch.setitem(runner.BY_NAME, "broken", broken)
    assert main(["run", "broken", "--dry-run"]) == 2
    assert "harness.perf.no_such_module: no such module" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="unknown suite 'nope'"):
        main(["run", "nope", "--dry-run"])


def test_gpu_host_runs_every_part_in_order_within_its_budget(tmp_path, monkeypatch, capsys):
    assert tuple(part for part, _ in GPU_HOST) == GPU_HOST_PARTS
    monkeypatch.setenv("PARTS", " ".join(GPU_HOST_PARTS))
    monkeypatch.setenv("T_TOTAL", "100000")
    assert main(["gpu-host", str(tmp_path), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    steps = [step for _, part in GPU_HOST for step in part]
    assert [ln.split(":")[0] for ln in lines[:-1]] == [s.log.rsplit(".", 1)[0] for s in steps]
    assert all(f"limit {s.limit_s}s" in ln for s, ln in zip(steps, lines))
    assert "--skip-tests" in next(ln for ln in lines if ln.startswith("decode-perf"))  # kernels ran them
    assert "--budget-s 110" in next(ln for ln in lines if ln.startswith("bench-gpu"))
    # the default budget: later steps are cut, then skipped, so the call ends within T_TOTAL
    monkeypatch.setenv("T_TOTAL", "530")
    assert main(["gpu-host", str(tmp_path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "tp skipped: " in out and "gpu-check: limit 100s" in out
    monkeypatch.setenv("PARTS", "check bogus")
    assert main(["gpu-host", str(tmp_path), "--dry-run"]) == 2
    assert "unknown parts ['bogus']" in capsys.readouterr().err


def test_list_shows_every_suite():
    out = subprocess.run([sys.executable, "-m", "harness.perf", "list"], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    assert all(re.search(rf"^  {re.escape(s.name)} ", out, re.M) for s in SUITES)


def test_run_records_the_command_the_user_typed(tmp_path, capsys):
    import json
    out = tmp_path / "host.json"
    args = ["--num-seqs", "4", "--steps", "3", "--max-num-tokens", "64", "--max-seq-len", "1024", "--runs", "1",
            "--scenarios", "decode"]
    assert main(["run", "host-overhead", "--output", str(out), "--", *args]) == 0
    doc = json.loads(out.read_text())
    assert doc["command"] == ("python -m harness.perf run host-overhead --output OUT/host.json -- " + " ".join(args))
    assert doc["benchmark"] == "host-overhead" and doc["results"]["decode"]["steps"] == 3
    capsys.readouterr()


def test_gpu_host_scripts_start_benchmarks_only_through_the_table():
    """device.sh and quant_gpu.sh hold no benchmark command of their own: a module started directly
    would bypass the table's budgets and result names."""
    for script in sorted((REPO / "harness" / "gpucheck").glob("*.sh")):
        code = [ln for ln in script.read_text().splitlines() if not ln.lstrip().startswith("#")]
        direct = [ln for ln in code if re.search(r"-m harness\.(perf\.\w|gpucheck\b|bench\b)", ln)]
        assert not direct, f"{script.name} starts a benchmark outside the suite table: {direct}"
        assert any(re.search(r"-m harness\.perf (run|gpu-host)\b", ln) for ln in code), script.name
