"""The serve-time GPU check of `make serve` and `make run`: refused before tritonserver starts.

No GPU exists here: every visible-GPU count below is INJECTED, standing in for a GPU host's
torch.cuda.device_count(); nothing starts a server (a started one fails the test).
"""
from __future__ import annotations

import pytest

from harness import serve, serve_gpus
from harness.serve_gpus import PlacementError, check_repository_gpus, engine_parameters
from tests.serving.fake_build import fake_build as _built


def test_reads_the_engine_parameters(tmp_path):
    repo = _built(tmp_path, 2, device="cuda", engine_instances=4)
    p = engine_parameters(repo)
    assert p["instance_gpus"] == "0,1;2,3;4,5;6,7" and p["device"] == "cuda" and p["engine_dir"] == "../engine"


def test_gpu_layout_needs_tp_times_instances_visible(tmp_path):
    repo = _built(tmp_path, 2, device="cuda", engine_instances=4)
    check_repository_gpus(repo, visible=lambda: 8)        # stands in for an 8-GPU host
    with pytest.raises(PlacementError, match=r"engine.tp_size 2 x serving.engine_instances 4 needs 8 GPUs, "
                                             r"but 2 are visible"):
        check_repository_gpus(repo, visible=lambda: 2)    # stands in for a 2-GPU host


def test_cpu_layout_is_never_checked(tmp_path):
    repo = _built(tmp_path, 2, device="cpu", engine_instances=3)

    def no_call():
        raise AssertionError("a CPU repository must not look for GPUs")
    check_repository_gpus(repo, visible=no_call)


def test_make_serve_refuses_before_the_server_starts(tmp_path, monkeypatch, capsys):
    repo = _built(tmp_path, 2, device="cuda", engine_instances=2)
    # stands in for a 1-GPU host
    monkeypatch.setattr(serve, "check_repository_gpus", lambda r: check_repository_gpus(r, visible=lambda: 1))

    def no_server(*a, **k):
        raise AssertionError("tritonserver must not start")
    monkeypatch.setattr(serve, "TritonServer", no_server)
    assert serve.main(["--model-repository", str(repo)]) == 1
    err = capsys.readouterr().err
    assert "needs 4 GPUs, but 1 are visible" in err and "rebuild with fewer" in err


def test_make_run_refuses_before_the_server_starts(tmp_path, monkeypatch):
    from harness.mlperf import run
    from harness.serving_server import free_port
    repo = _built(tmp_path, 2, device="cuda", engine_instances=2)
    real = serve_gpus.check_repository_gpus
    # stands in for a 3-GPU host
    monkeypatch.setattr(serve_gpus, "check_repository_gpus", lambda r: real(r, visible=lambda: 3))
    monkeypatch.setattr(run, "server_reachable", lambda url: False)
    with pytest.raises(RuntimeError, match="needs 4 GPUs, but 3 are visible"):
        with run.ensure_server(None, repo, free_port()):
            pass
