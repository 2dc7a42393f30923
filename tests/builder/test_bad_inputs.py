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


# ---- corrupt files: one line naming the file and the problem, never a traceback (hostile-input review) ----

def user_error_line(res) -> str:
    line = one_error_line(res)
    assert res.returncode == 2, (res.returncode, line)   # a handled user error, not EXIT_BUG's "TypeName: ..."
    return line


@pytest.mark.parametrize("name, text, kind", [
    ("config.json", "[1, 2]", "list"),                       # was AttributeError: 'list' object has no attribute 'get'
    ("config.json", '"LlamaForCausalLM"', "string"),
    ("generation_config.json", "[2]", "list"),
    ("tokenizer_config.json", '"oops"', "string"),
    ("tokenizer_config.json", "null", "null"),
    ("special_tokens_map.json", "[]", "list"),
    ("hf_quant_config.json", "[]", "list"),
])
def test_checkpoint_json_that_is_not_an_object(tmp_path, name, text, kind):
    d = hf_dir(tmp_path)
    (d / name).write_text(text)
    out = tmp_path / "out"
    line = user_error_line(cli_build(config(tmp_path), out, f"model.source={d}"))
    assert f"{d / name}: expected a JSON object, got a JSON {kind}" in line
    assert_nothing_finished(out)


def test_checkpoint_json_that_is_invalid(tmp_path):
    d = hf_dir(tmp_path)
    (d / "generation_config.json").write_bytes(b"{\xff")
    line = user_error_line(cli_build(config(tmp_path), tmp_path / "out", f"model.source={d}"))
    assert f"{d / 'generation_config.json'}: invalid JSON" in line


def test_model_spec_refuses_json_that_is_not_an_object(tmp_path):
    # the spec is also read from the quantize stage's output: same one-line error there
    from builder.model_spec import model_spec
    from builder.stages.base import StageError
    d = hf_dir(tmp_path)
    (d / "generation_config.json").write_text("[1]")
    with pytest.raises(StageError, match=r"generation_config.json: expected a JSON object, got a JSON list"):
        model_spec(d, "bfloat16")
    (d / "config.json").write_text("[1]")
    with pytest.raises(StageError, match=r"config.json: expected a JSON object, got a JSON list"):
        model_spec(d, "bfloat16")


@pytest.mark.parametrize("header, fragment", [
    (b"[1, 2, 3]", "the header is a JSON list"),
    (b'{"w": [1, 2]}', "header entry 'w' has no data_offsets list"),
    (b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": 5}}', "header entry 'w' has no data_offsets list"),
])
def test_safetensors_header_of_the_wrong_shape(tmp_path, header, fragment):
    d = hf_dir(tmp_path)
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    out = tmp_path / "out"
    line = user_error_line(cli_build(config(tmp_path), out, f"model.source={d}"))
    assert f"{d / 'model.safetensors'}: corrupted safetensors file ({fragment}" in line
    assert_nothing_finished(out)


def gguf_bytes(*kvs: bytes, n_tensors: int = 0) -> bytes:
    """A GGUF v3 header written by hand, so that lengths can lie."""
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, len(kvs)) + b"".join(kvs)


def gguf_str(s: str, length: int | None = None) -> bytes:
    raw = s.encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw


def gguf_kv(key: str, vtype: int, value: bytes, key_length: int | None = None) -> bytes:
    return gguf_str(key, key_length) + struct.pack("<I", vtype) + value


ARCH_KV = gguf_kv("general.architecture", 8, gguf_str("llama"))


@pytest.mark.parametrize("length", [2**40, 2**63])
@pytest.mark.parametrize("where", ["first key", "value after the architecture", "array length"])
def test_gguf_lengths_beyond_the_file(tmp_path, length, where):
    # 2^40 was a MemoryError and 2^63 an OverflowError: every length is bounded by the bytes left
    if where == "first key":          # read by sources.resolve while looking for general.architecture
        data = gguf_bytes(gguf_kv("general.architecture", 8, gguf_str("llama"), key_length=length))
    elif where == "value after the architecture":   # resolve stops early: read by gguf_import.read_header
        data = gguf_bytes(ARCH_KV, gguf_kv("general.name", 8, gguf_str("tiny", length)))
    else:
        data = gguf_bytes(gguf_kv("general.file_type", 9, struct.pack("<IQ", 4, length) + b"\0" * 64), ARCH_KV)
    path = tmp_path / "lies.gguf"
    path.write_bytes(data + b"\0" * 256)
    out = tmp_path / "out"
    line = user_error_line(cli_build(config(tmp_path), out, f"model.source={path}"))
    assert f"{path}: unreadable GGUF (" in line and f"{length} exceeds the" in line and "bytes left in the file" in line
    assert_nothing_finished(out)


def test_gguf_read_header_bounds_every_count(tmp_path):
    from builder.gguf_import import read_header
    cases = {
        "string array": gguf_bytes(gguf_kv("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 2**62))),
        "metadata count": b"GGUF" + struct.pack("<IQQ", 3, 0, 2**63),
        "tensor count": b"GGUF" + struct.pack("<IQQ", 3, 2**63, 0),
        "dimensions": gguf_bytes(n_tensors=1) + gguf_str("w") + struct.pack("<I", 2**31),
        "alignment": gguf_bytes(gguf_kv("general.alignment", 4, struct.pack("<I", 0))),
    }
    for what, data in cases.items():
        path = tmp_path / f"{what}.gguf"
        path.write_bytes(data + b"\0" * 64)
        with pytest.raises(ValueError) as info:
            read_header(path)
        assert "exceeds the" in str(info.value) or "at most 4" in str(info.value) or "alignment" in str(info.value), what
