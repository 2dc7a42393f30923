"""harness.perf.step.tp_overhead (part tp of harness/gpucheck/device.sh) works before it reaches a GPU.

No GPU here: without one the script refuses (exit 2); the distributed GPU path (TPDriver on NCCL) has
not run on a GPU, so its refusal (exit 3, one line, the JSON says so) is checked with the interface
raising, and the timing path of both pairs (eager; fast = fused layer + CUDA graphs) runs with
stand-in runners on the CPU (--dry-run) - nothing is timed that means anything. device.sh itself is run with PARTS=tp to show that the part ends in its one
line and the script goes on.
"""
from __future__ import annotations

import json
import os
import subprocess
import types
from pathlib import Path

import pytest
import torch

from harness.perf.step import tp_overhead

REPO = Path(__file__).resolve().parents[2]
SPEC = types.SimpleNamespace(model=types.SimpleNamespace(vocab_size=64))


class _StandIn:
    """What the script asks of a runner: device, block_size, num_blocks, execute, (shutdown)."""
    device, block_size, num_blocks = torch.device("cpu"), 16, 64

    def __init__(self):
        self.w = torch.randn(8, 8)
        self.stopped = False

    def execute(self, ids, meta, rows):
        return (self.w @ self.w)[: len(rows)]

    def shutdown(self):
        self.stopped = True


@pytest.fixture
def stand_ins(monkeypatch):
    made = {}
    monkeypatch.setattr(tp_overhead, "load_spec", lambda bundle, overrides=None: SPEC)
    monkeypatch.setattr(tp_overhead, "plain_runner", lambda spec, device: made.setdefault("plain", _StandIn()))
    return made


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_refuses_without_gpu(capsys):
    assert tp_overhead.main([]) == tp_overhead.EXIT_NO_GPU
    assert "no NVIDIA GPU visible" in capsys.readouterr().err


def test_refuses_in_one_line_while_the_distributed_path_is_missing(stand_ins, monkeypatch, tmp_path, capsys):
    def missing(spec, device):   # what TPDriver(spec, tp_size=1, device=...) raises before it exists
        raise TypeError("TPDriver.__init__() got an unexpected keyword argument 'device'\nmore")
    monkeypatch.setattr(tp_overhead, "distributed_runner", missing)
    out = tmp_path / "tp.json"
    assert tp_overhead.main(["--dry-run", "--out", str(out)]) == tp_overhead.EXIT_NO_TP_PATH
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "the distributed GPU path is not available" in err
    assert "TypeError" in err and "'cpu'" in err
    assert "not available" in json.loads(out.read_text())["refused"]
    assert "plain" not in stand_ins, "refusing must cost nothing: no runner loaded first"


def test_dry_run_times_both_paths_and_writes_the_json(stand_ins, monkeypatch, tmp_path):
    driver = _StandIn()
    driver.runner = _StandIn()   # rank 0's forward, timed alone when the driver exposes it
    monkeypatch.setattr(tp_overhead, "distributed_runner", lambda spec, device: driver)
    out = tmp_path / "tp.json"
    assert tp_overhead.main(["--dry-run", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    for pre in ("", "fast_"):     # the eager pair, then the fused layer + graphs pair
        for b in (1, 2):
            ms = res[f"{pre}b{b}_ms"]
            assert {"plain", "distributed", "distributed_forward", "overhead", "ratio"} <= set(ms)
            assert ms["overhead"] == pytest.approx(ms["distributed"] - ms["plain"])
        assert f"{pre}collectives_b1" in res
    assert res["pairs"]["fast"] == {"cuda_graphs": True, "attention_backend": "triton"}
    assert res["gpu"] == "cpu (dry run)" and "fast_graphs" in res
    assert driver.stopped, "the driver's process group must be shut down"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU stand-in for the GPU call")
def test_device_sh_part_tp_ends_in_one_line_and_the_script_goes_on(tmp_path):
    env = dict(os.environ, PARTS="tp", PYTHON=str(REPO / ".venv" / "bin" / "python"), T_TOTAL="120")
    proc = subprocess.run(["bash", "harness/gpucheck/device.sh", str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any(line.startswith(f"tp rc={tp_overhead.EXIT_NO_GPU} ") for line in lines), proc.stdout
    assert "no NVIDIA GPU visible" in proc.stdout and lines[-1].startswith("device.sh: "), proc.stdout
