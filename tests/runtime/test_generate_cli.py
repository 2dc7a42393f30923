"""``python -m backend.generate`` on a real bundle: JSON output, chat template, clear errors."""
from __future__ import annotations

import json

import pytest

from backend.generate import main

pytestmark = pytest.mark.slow


def test_json_output_one_object_per_prompt(smollm2_bundle, capsys):
    rc = main(["--engine", str(smollm2_bundle), "--prompt", "What is the capital of France?",
               "--prompt", "Bonjour", "--chat", "--json", "--max-tokens", "12"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert rc == 0 and len(lines) == 2
    first = json.loads(lines[0])
    assert first["prompt"] == "What is the capital of France?"
    assert "Paris" in first["text"] and 1 <= len(first["token_ids"]) <= 12
    assert json.loads(lines[1])["prompt"] == "Bonjour"
    # what the engine computed in and why: the bundle's engine.cpu_dtype (auto) decided at load
    dtype = first["compute_dtype"]
    assert dtype["asked"] == "auto" and dtype["dtype"] in ("float32", "bfloat16") and dtype["reason"]


def test_bad_input_exits_2_with_one_line(smollm2_bundle, tmp_path, capsys):
    assert main(["--engine", str(tmp_path), "--prompt", "x"]) == 2
    assert main(["--engine", str(smollm2_bundle), "--prompt", "x", "--temperature", "-1"]) == 2
    assert main(["--engine", str(smollm2_bundle), "--prompt", "x", "--cpu-dtype", "fp16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and "sampling.temperature" in err[1]
    assert err[2] == "error: engine.cpu_dtype: 'fp16'; allowed: auto, float32, bfloat16"
