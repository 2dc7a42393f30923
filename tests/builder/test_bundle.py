"""The engine bundle built from the real SmolLM2: layout, manifest, weights, loader refusals."""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from backend.bundle import BundleError, load_bundle

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bf16_bundle(build_bundle) -> Path:
    # verify (the accuracy gate) has its own tests (tests/runtime/test_verify_stage.py); skipping it
    # saves ~2 min of CI
    return Path(build_bundle("smollm2-135m-bf16", ["verify.enabled=false"]))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_manifest_lists_and_hashes_every_file(bf16_bundle):
    engine = json.loads((bf16_bundle / "engine.json").read_text())
    on_disk = {str(p.relative_to(bf16_bundle)) for p in bf16_bundle.rglob("*") if p.is_file()}
    assert set(engine["files"]) == on_disk - {"engine.json", "stage.json"}
    for rel, digest in engine["files"].items():
        assert sha256(bf16_bundle / rel) == digest, rel
    for rel in ("weights.safetensors", "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json",
                "tokenizer/special_tokens_map.json"):
        assert rel in engine["files"]


def test_engine_json_describes_the_model(bf16_bundle, smollm2_hf_dir):
    engine = json.loads((bf16_bundle / "engine.json").read_text())
    hf = json.loads((smollm2_hf_dir / "config.json").read_text())
    m = engine["model"]
    assert (engine["format"], engine["format_version"]) == ("kiln-engine", 1)
    assert (m["architecture"], m["num_layers"], m["hidden_size"], m["num_heads"], m["num_kv_heads"], m["head_dim"]) \
        == ("llama", hf["num_hidden_layers"], hf["hidden_size"], 9, 3, 64)
    assert m["vocab_size"] == 49152 and m["tie_word_embeddings"] is True and m["rope_theta"] == 100000.0
    assert m["eos_token_ids"] == [2] and m["max_position_embeddings"] == 8192
    assert engine["quantization"]["format"] == "none" and engine["engine"]["kv_cache_dtype"] == "bfloat16"
    assert engine["engine"]["max_batch_size"] == 32 and engine["targets"]["sms"] == [90, 100]
    assert len(engine["hashes"]["source"]) == 64 and len(engine["hashes"]["config"]) == 64
    assert engine["tools"]["torch"] and engine["config_file"].endswith("smollm2-135m-bf16.yaml")
    tok_cfg = json.loads((bf16_bundle / "tokenizer" / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_cfg["chat_template"]
    # The tokenizer's special tokens are the ones the GGUF names by id (eos 2 = <|im_end|>), the
    # same end the engine stops on.
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"]) == ("<|im_start|>", "<|im_end|>")


def test_bf16_weights_equal_the_source_after_unfusing(bf16_bundle, smollm2_hf_dir):
    src = safe_open(str(smollm2_hf_dir / "model.safetensors"), "pt")
    dst = safe_open(str(bf16_bundle / "weights.safetensors"), "pt")
    names = set(dst.keys())
    assert "lm_head.weight" not in names  # tied to the embedding
    assert torch.equal(dst.get_tensor("embed_tokens.weight"), src.get_tensor("model.embed_tokens.weight"))
    assert torch.equal(dst.get_tensor("norm.weight"), src.get_tensor("model.norm.weight"))
    q, kv, inter = 9 * 64, 3 * 64, 1536
    for i in range(30):
        hf = f"model.layers.{i}"
        qkv = dst.get_tensor(f"layers.{i}.qkv.weight")
        assert qkv.dtype == torch.bfloat16 and qkv.shape == (q + 2 * kv, 576)
        for part, name in zip(qkv.split([q, kv, kv]), ("q_proj", "k_proj", "v_proj")):
            assert torch.equal(part, src.get_tensor(f"{hf}.self_attn.{name}.weight")), (i, name)
        gate, up = dst.get_tensor(f"layers.{i}.gate_up.weight").split([inter, inter])
        assert torch.equal(gate, src.get_tensor(f"{hf}.mlp.gate_proj.weight"))
        assert torch.equal(up, src.get_tensor(f"{hf}.mlp.up_proj.weight"))
        assert torch.equal(dst.get_tensor(f"layers.{i}.o.weight"), src.get_tensor(f"{hf}.self_attn.o_proj.weight"))
        assert torch.equal(dst.get_tensor(f"layers.{i}.down.weight"), src.get_tensor(f"{hf}.mlp.down_proj.weight"))
        assert torch.equal(dst.get_tensor(f"layers.{i}.input_norm.weight"), src.get_tensor(f"{hf}.input_layernorm.weight"))
        assert torch.equal(dst.get_tensor(f"layers.{i}.post_attn_norm.weight"),
                           src.get_tensor(f"{hf}.post_attention_layernorm.weight"))
    assert len(names) == 2 + 30 * 6


def test_load_bundle(bf16_bundle):
    b = load_bundle(bf16_bundle)
    assert b.model.num_layers == 30 and b.quantization.format == "none" and b.engine.max_batch_size == 32
    assert b.tensor("layers.0.qkv.weight").shape == (960, 576)
    assert (b.tokenizer_dir / "tokenizer.json").is_file() and b.draft_dir is None
    with pytest.raises(BundleError, match="no tensor 'nope'"):
        b.tensor("nope")


def _copy(bundle: Path, dst: Path) -> Path:
    """A copy whose big weights file is a symlink (tests below never modify it)."""
    shutil.copytree(bundle, dst, ignore=shutil.ignore_patterns("weights.safetensors"))
    (dst / "weights.safetensors").symlink_to(bundle / "weights.safetensors")
    return dst


def test_changed_file_is_refused_with_rebuild_hint(bf16_bundle, tmp_path):
    b = _copy(bf16_bundle, tmp_path / "engine")
    cfg = b / "tokenizer" / "tokenizer_config.json"
    cfg.write_text(cfg.read_text().replace("<|im_start|>", "<|im_begin|>"))
    with pytest.raises(BundleError) as info:
        load_bundle(b)
    msg = str(info.value)
    assert "tokenizer_config.json: changed since the build" in msg
    assert "rebuild with: make build CONFIG=configs/smollm2-135m-bf16.yaml" in msg
    load_bundle(b, verify_hashes=False)  # an explicit opt-out still loads
    (b / "tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(BundleError, match="tokenizer.json: missing from the bundle"):
        load_bundle(b, verify_hashes=False)


@pytest.mark.parametrize("edit, fragment", [
    ({"format_version": 3}, "format_version 3 is not supported"),
    ({"format": "trt-engine"}, "format 'trt-engine' is not 'kiln-engine'"),
    ({"model": None}, "model: expected an object, got null"),
])
def test_other_format_or_version_is_refused(bf16_bundle, tmp_path, edit, fragment):
    b = _copy(bf16_bundle, tmp_path / "engine")
    engine = json.loads((b / "engine.json").read_text())
    engine.update(edit)
    (b / "engine.json").write_text(json.dumps(engine))
    with pytest.raises(BundleError, match=fragment):
        load_bundle(b)


def test_not_a_bundle(tmp_path):
    with pytest.raises(BundleError, match="not an engine bundle"):
        load_bundle(tmp_path)
    (tmp_path / "engine.json").write_text("{not json")
    with pytest.raises(BundleError, match="unreadable"):
        load_bundle(tmp_path)


def test_cli_inspect(bf16_bundle, tmp_path):
    run = lambda *a: subprocess.run([sys.executable, "-m", "builder", "inspect", *a], cwd=REPO,  # noqa: E731
                                    capture_output=True, text=True, timeout=120)
    ok = run(str(bf16_bundle))
    assert ok.returncode == 0, ok.stderr
    assert "llama: 30 layers, hidden 576" in ok.stdout and "weights none" in ok.stdout
    b = _copy(bf16_bundle, tmp_path / "engine")
    engine = json.loads((b / "engine.json").read_text())
    (b / "engine.json").write_text(json.dumps({**engine, "format_version": 99}))
    bad = run(str(b))
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "format_version 99" in lines[0]
