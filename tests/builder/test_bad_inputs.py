"""Every bad input of issue 2 through the real CLI: non-zero exit, ONE line on stderr, nothing that
looks finished on disk. Checkpoints here are small real files of each kind (a tiny GGUF written
with the gguf package's writer, safetensors headers cut short), never mocks."""
from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from builder.sources import smollm2_gguf

REPO = Path(__file__).resolve().parents[2]
LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
                "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 4096}


def cli_build(config: Path | str, out: Path, *overrides: str):
    return subprocess.run([sys.executable, "-m", "builder", "build", str(config), *overrides, "--output", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def one_error_line(res) -> str:
    assert res.returncode != 0, res.stdout
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: ") and "Traceback" not in res.stderr
    return lines[0]


def assert_nothing_finished(out: Path) -> None:
    assert not (out / "engine" / "engine.json").exists()
    assert not list(out.rglob("stage.json")), list(out.rglob("stage.json"))
    assert not list(out.rglob("*.tmp-*")), "temporary folders must be removed on a handled error"


def config(tmp_path: Path, text: str = "") -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(text)
    return p


def hf_dir(tmp_path: Path, cfg: dict | None = None) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg or LLAMA_CONFIG))
    save_file({"model.embed_tokens.weight": torch.zeros(128, 64, dtype=torch.bfloat16)}, str(d / "model.safetensors"))
    return d


@pytest.mark.parametrize("text, fragment", [
    (None, "config file not found"),
    ("engine: {max_batch_size: 8\n", "invalid YAML"),
    ("engine:\n  max_batch_sise: 8\n", "did you mean 'engine.max_batch_size'"),
    ("engine:\n  max_batch_size: eight\n", "expected an integer, got 'eight'"),
    ("quantization:\n  format: fp5\n", "quantization.format: invalid value 'fp5'; allowed: none | fp8"),
])
def test_config_mistakes(tmp_path, text, fragment):
    cfg = tmp_path / "missing.yaml" if text is None else config(tmp_path, text)
    out = tmp_path / "out"
    line = one_error_line(cli_build(cfg, out))
    assert fragment in line and str(cfg) in line
    assert not out.exists()  # config errors come before anything is written


def test_missing_checkpoint_path_of_a_shipped_config(tmp_path):
    out = tmp_path / "out"
    line = one_error_line(cli_build(REPO / "configs" / "llama3.1-8b-fp8.yaml", out,
                                    "model.source=checkpoints/definitely-not-here"))
    assert "model.source: checkpoint checkpoints/definitely-not-here does not exist" in line
    assert_nothing_finished(out)


def test_folder_that_is_not_a_checkpoint(tmp_path):
    d = tmp_path / "notes"
    d.mkdir()
    (d / "README.txt").write_text("hello")
    out = tmp_path / "out"
    line = one_error_line(cli_build(config(tmp_path), out, f"model.source={d}"))
    assert "is not a checkpoint folder (no config.json)" in line
    assert_nothing_finished(out)


def test_unsupported_hf_architecture(tmp_path):
    d = hf_dir(tmp_path, {**LLAMA_CONFIG, "architectures": ["GPT2LMHeadModel"]})
    line = one_error_line(cli_build(config(tmp_path), tmp_path / "out", f"model.source={d}"))
    assert "unsupported ['GPT2LMHeadModel']" in line and "allowed: LlamaForCausalLM" in line


def test_truncated_safetensors(tmp_path):
    d = hf_dir(tmp_path)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    out = tmp_path / "out"
    line = one_error_line(cli_build(config(tmp_path), out, f"model.source={d}"))
    assert "model.safetensors: truncated safetensors file" in line
    assert_nothing_finished(out)


def test_corrupted_safetensors_header(tmp_path):
    d = hf_dir(tmp_path)
    f = d / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[8:20] = b"#garbage####"
    f.write_bytes(bytes(raw))
    line = one_error_line(cli_build(config(tmp_path), tmp_path / "out", f"model.source={d}"))
    assert "corrupted safetensors file" in line
    f.write_bytes(struct.pack("<Q", 10**12) + b"{}")
    assert "corrupted safetensors file" in one_error_line(cli_build(config(tmp_path), tmp_path / "out",
                                                                    f"model.source={d}"))


def test_gguf_of_unsupported_architecture(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "tiny-gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = tmp_path / "out"
    line = one_error_line(cli_build(config(tmp_path), out, f"model.source={path}"))
    assert "GGUF architecture 'gpt2' is not supported; allowed: llama, mistral, qwen2" in line
    assert_nothing_finished(out)


def test_truncated_gguf(tmp_path):
    cut = tmp_path / "cut.gguf"
    with open(smollm2_gguf(), "rb") as src:
        cut.write_bytes(src.read(12 << 20))  # the whole header, a fraction of the tensor data
    out = tmp_path / "out"
    line = one_error_line(cli_build(config(tmp_path), out, f"model.source={cut}"))
    assert "cut.gguf" in line and "truncated" in line
    assert_nothing_finished(out)


def test_output_not_writable(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    line = one_error_line(cli_build(config(tmp_path), blocker / "out"))
    assert "output folder is not writable" in line and "--output DIR" in line


def test_debug_shows_the_traceback(tmp_path):
    res = subprocess.run([sys.executable, "-m", "builder", "build", str(tmp_path / "nope.yaml"), "--debug"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "Traceback" in res.stderr and "ConfigError" in res.stderr
