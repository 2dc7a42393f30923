"""`make run RUN_ARGS="--benchmarks=llama2-70b ..."` runs configs/llama70b-fp8.yaml with the settings
it was built with: TP and data-parallel instances come from the config plus OVERRIDES, and a build
made with others is refused before anything is served. No model, no server: the builds are
fake_build's (engine.json + the rendered repository)."""
from __future__ import annotations

import subprocess

import pytest

from builder.config import BuildConfig
from harness.mlperf import __main__ as cli
from harness.mlperf import run, settings
from harness.mlperf.build_check import check_build_matches
from harness.mlperf.datasets import REPO_ROOT
from tests.serving.fake_build import fake_build

CONFIG = REPO_ROOT / "configs" / "llama70b-fp8.yaml"
EIGHT_GPUS = ("engine.tp_size=2", "serving.engine_instances=4")


def test_llama2_70b_runs_the_70b_config_at_tp1_on_one_gpu():
    assert REPO_ROOT / settings.load_benchmarks().get("llama2-70b").engine_config == CONFIG
    s = BuildConfig.from_yaml(CONFIG)
    assert (s.engine.tp_size, s.serving.engine_instances, s.serving.device) == (1, 1, "cuda")
    s8 = BuildConfig.from_yaml(CONFIG, list(EIGHT_GPUS))   # the documented 8-GPU layout is a valid config
    assert (s8.engine.tp_size, s8.serving.engine_instances) == (2, 4)


def test_a_build_with_other_tp_and_instances_is_refused_naming_the_overrides(tmp_path):
    fake_build(tmp_path, 2, device="cuda", engine_instances=4)
    with pytest.raises(RuntimeError) as e:
        check_build_matches(BuildConfig.from_yaml(CONFIG), tmp_path, CONFIG)
    msg = str(e.value)
    assert "built with engine.tp_size=2, serving.engine_instances=4" in msg
    assert "asks for engine.tp_size=1, serving.engine_instances=1" in msg
    assert 'OVERRIDES="engine.tp_size=2 serving.engine_instances=4"' in msg and "make build CONFIG=" in msg
    layout = check_build_matches(BuildConfig.from_yaml(CONFIG, list(EIGHT_GPUS)), tmp_path, CONFIG, EIGHT_GPUS)
    assert layout == {"engine.tp_size": 2, "serving.engine_instances": 4, "serving.device": "cuda"}


def test_run_refuses_before_reading_data_or_serving(tmp_path, monkeypatch):
    fake_build(tmp_path, 2, device="cuda", engine_instances=4)

    def never(*a, **k):
        raise AssertionError("nothing may be served or read before the layout check")
    monkeypatch.setattr(run, "ensure_server", never)
    monkeypatch.setattr(run, "load_samples", never)
    req = run.RunRequest(config=None, benchmark="llama2-70b", scenario="Offline", mode="PerformanceOnly",
                         output=tmp_path)
    with pytest.raises(RuntimeError, match="was built with engine.tp_size=2"):
        run.run(req)


def test_overrides_reach_the_run_from_the_cli_and_make():
    a = cli.parse_args(["--benchmarks=llama2-70b", "--override", EIGHT_GPUS[0], "--override", EIGHT_GPUS[1]])
    assert a.override == list(EIGHT_GPUS)
    # make is the project's entry point (the README's two commands, .ci/run): always present where tests run
    out = subprocess.run(["make", "-n", "run", f"OVERRIDES={' '.join(EIGHT_GPUS)}",
                          "RUN_ARGS=--benchmarks=llama2-70b"], cwd=REPO_ROOT, capture_output=True, text=True,
                         check=True).stdout
    assert "-m harness.mlperf --override engine.tp_size=2 --override serving.engine_instances=4 " \
           "--benchmarks=llama2-70b" in out
