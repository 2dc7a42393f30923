"""Pipeline behaviour on the real SmolLM2 checkpoint (given as an HF folder, so import is quick):
stage skipping, --force, rebuilds of only what changed, crash safety under kill -9."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from builder.config import BuildConfig
from builder.pipeline import run_pipeline
from builder.stages.base import StageError

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
FAST = ["quantization.format=none", "quantization.kv_cache=none", "verify.enabled=false"]


def cfg(source: Path, *extra: str) -> BuildConfig:
    return BuildConfig.from_dict({}, "test.yaml", [f"model.source={source}", *FAST, *extra])


def statuses(result) -> dict[str, str]:
    return {name: r.status for name, r in result.results.items()}


def test_skip_rebuild_and_force(smollm2_hf_dir, tmp_path):
    out = tmp_path / "b"
    first = run_pipeline(cfg(smollm2_hf_dir), out, until="compile", log=lambda m: None)
    assert statuses(first) == {"import": "built", "quantize": "skipped", "draft": "skipped", "compile": "built"}
    engine_stat = (out / "engine" / "stage.json").stat().st_mtime_ns
    import_info = json.loads((out / "work" / "import" / "stage.json").read_text())["info"]
    assert import_info["kind"] == "hf" and len(import_info["source_sha256"]) == 64

    again = run_pipeline(cfg(smollm2_hf_dir), out, until="compile", log=lambda m: None)
    assert statuses(again)["import"] == "cached" and statuses(again)["compile"] == "cached"
    assert (out / "engine" / "stage.json").stat().st_mtime_ns == engine_stat

    # an engine-only change rebuilds compile, not import
    changed = run_pipeline(cfg(smollm2_hf_dir, "engine.max_batch_size=4"), out, until="compile", log=lambda m: None)
    assert statuses(changed)["import"] == "cached" and statuses(changed)["compile"] == "built"
    assert json.loads((out / "engine" / "engine.json").read_text())["engine"]["max_batch_size"] == 4

    forced = run_pipeline(cfg(smollm2_hf_dir, "engine.max_batch_size=4"), out, until="import", force=True,
                          log=lambda m: None)
    assert statuses(forced) == {"import": "built"}
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name or ".old-" in p.name]


def test_model_shape_is_checked_at_import(smollm2_hf_dir, tmp_path):
    from builder.config import ConfigError
    with pytest.raises(ConfigError, match=r"test.yaml: engine.tp_size: 2 does not divide the model's 9 attention heads; allowed: 1 \| 3$"):
        run_pipeline(cfg(smollm2_hf_dir, "engine.tp_size=2"), tmp_path / "b", until="import", log=lambda m: None)


def test_prequantized_source_must_match_format(tmp_path, smollm2_hf_dir):
    """A ModelOpt checkpoint (hf_quant_config.json) skips quantize and must agree with the config."""
    src = tmp_path / "mo"
    src.mkdir()
    for f in smollm2_hf_dir.iterdir():
        if f.is_file() and f.name != "stage.json":
            os.link(f, src / f.name)
    (src / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "NVFP4",
                                                                           "kv_cache_quant_algo": None}}))
    c = BuildConfig.from_dict({}, "test.yaml", [f"model.source={src}", "quantization.format=fp8"])
    with pytest.raises(Exception, match="quantization.format: 'fp8' but the source is already quantized by "
                                        "ModelOpt as 'nvfp4'"):
        run_pipeline(c, tmp_path / "b", until="quantize", log=lambda m: None)


def _wait_for(pattern_dir: Path, prefix: str, proc, timeout: float = 240) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pattern_dir.is_dir():
            hits = [p for p in pattern_dir.iterdir() if p.name.startswith(prefix)]
            if hits:
                return hits[0]
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    raise AssertionError(f"{prefix}* never appeared in {pattern_dir}")


def _start_build(cfg_file: Path, out: Path):
    return subprocess.Popen([sys.executable, "-m", "builder", "build", str(cfg_file), *FAST, "--output", str(out),
                             "--until", "compile"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, preexec_fn=_default_sigint)


def _default_sigint() -> None:
    # A shell starts background jobs with SIGINT ignored and children inherit that (CI run under
    # nohup/&: the build then ignored our Ctrl-C and finished). A user's terminal delivers it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_interrupted_builds_leave_nothing_finished(smollm2_hf_dir, tmp_path):
    out = tmp_path / "b"
    cfg_file = tmp_path / "k.yaml"
    cfg_file.write_text(f"model: {{source: {smollm2_hf_dir}}}\n")

    # Ctrl-C mid-compile: one line, exit 130, the partial bundle removed
    proc = _start_build(cfg_file, out)
    _wait_for(out, "engine.tmp-", proc)
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1].startswith("error: interrupted")
    assert not (out / "engine").exists() and not list(out.glob("engine.tmp-*"))
    assert (out / "work" / "import" / "stage.json").is_file()  # the finished stage is kept

    # kill -9 mid-compile: nothing can clean up, but nothing looks finished either
    proc = _start_build(cfg_file, out)
    try:
        tmp = _wait_for(out, "engine.tmp-", proc)
        time.sleep(0.3)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "engine").exists()
    assert tmp.exists()  # the partial bundle exists only under its temporary name
    # the next build removes the stale folder and finishes, reusing the finished import stage
    logs: list[str] = []
    result = run_pipeline(BuildConfig.from_yaml(cfg_file, FAST), out, until="compile", log=logs.append)
    assert statuses(result)["import"] == "cached" and statuses(result)["compile"] == "built"
    assert any("left by an interrupted build" in m for m in logs)
    assert not tmp.exists() and (out / "engine" / "engine.json").is_file()


# A build command whose Ctrl-C lands while torch.tensor() reads a Python sequence: torch turns the
# KeyboardInterrupt into a ValueError (it did, mid-compile, in test_interrupted_builds_leave_nothing_finished).
_CTRL_C_IN_TORCH = """
import os, signal, sys, torch
from builder import cli
class Pressed:
    def __len__(self): return 1
    def __getitem__(self, i):
        os.kill(os.getpid(), signal.SIGINT)   # the user's Ctrl-C, arriving right here
        return 0.0
try:
    torch.tensor(Pressed())
except ValueError:
    print("torch turned it into a ValueError")
def crash(args): raise ValueError("a plain bug")
def interrupted(args): return torch.tensor(Pressed())
cli.COMMANDS["build"] = crash
print("bug", cli.main(["build", "x.yaml"]))
cli.COMMANDS["build"] = interrupted
print("ctrl-c", cli.main(["build", "x.yaml"]))
"""


def test_ctrl_c_that_a_library_turns_into_another_error_still_ends_as_interrupted():
    proc = subprocess.run([sys.executable, "-c", _CTRL_C_IN_TORCH], cwd=REPO, capture_output=True, text=True,
                          timeout=120, preexec_fn=_default_sigint)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["torch turned it into a ValueError", "bug 1", "ctrl-c 130"], proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert lines[-2].startswith("error: ValueError: a plain bug") and lines[-1].startswith("error: interrupted")


def test_unwritable_output_is_a_stage_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(StageError, match="output folder is not writable"):
        run_pipeline(BuildConfig.from_dict({}), blocker / "x", log=lambda m: None)


def test_a_missing_stage_module_is_an_import_error(tmp_path, monkeypatch):
    """Every stage is required: a stage whose module is missing fails the build, never is skipped."""
    import builder.pipeline
    from builder.stages import StageSpec
    missing = StageSpec("missing", "builder.stages.no_such_stage", "work/missing", (), ())
    monkeypatch.setattr(builder.pipeline, "STAGES", (missing,))
    with pytest.raises(ModuleNotFoundError, match="builder.stages.no_such_stage"):
        run_pipeline(BuildConfig.from_dict({}), tmp_path, log=lambda m: None)


def test_modelopt_checkpoint_source_skips_quantize(build_bundle, tmp_path):
    """A ModelOpt unified checkpoint as model.source: quantize is skipped, compile packs it exactly
    as a bundle built from the original model (the checkpoint is the fp8 build's own export)."""
    light = ["quantization.calibration.num_samples=4", "quantization.calibration.max_seq_len=64",
             "verify.enabled=false"]
    bundle = Path(build_bundle("smollm2-135m-fp8", light))
    export = bundle.parent / "work" / "quantize"
    assert (export / "hf_quant_config.json").is_file()
    c = BuildConfig.from_dict({}, "test.yaml", [f"model.source={export}", "verify.enabled=false"])
    result = run_pipeline(c, tmp_path / "b", until="compile", log=lambda m: None)
    assert statuses(result)["quantize"] == "skipped"
    assert "already quantized by ModelOpt (FP8)" in result.results["quantize"].reason
    assert result.results["import"].info["prequantized"]["format"] == "fp8"
    from safetensors import safe_open
    import torch
    a = safe_open(str(bundle / "weights.safetensors"), "pt")
    b = safe_open(str(result.bundle / "weights.safetensors"), "pt")
    assert set(a.keys()) == set(b.keys())
    for name in a.keys():
        x, y = a.get_tensor(name), b.get_tensor(name)
        assert x.dtype == y.dtype and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), name
