"""The engine bundle format has one owner, backend/bundle.py: typed manifest, read/verify/write, one-line
refusals that name the file and the field and say what to rebuild; and no other module parses engine.json."""
from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest

from backend import bundle
from backend.bundle import BundleError, EngineSettings
from backend.bundle_schema import ModelConfig

REPO = Path(__file__).resolve().parents[2]
HINT = "rebuild with: make build CONFIG=configs/tiny.yaml BUILD_ARGS=--force"
DOC = {  # a small bundle's engine.json, every section present, in the builder's key order
    "format": "kiln-engine", "format_version": 1, "created": "2026-01-01T00:00:00+00:00", "kiln_version": "0.1.0",
    "config_file": "configs/tiny.yaml",
    "model": {"architecture": "llama", "hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4,
              "num_kv_heads": 2, "head_dim": 16, "vocab_size": 256, "rms_norm_eps": 9.999999747378752e-06,
              "rope_theta": 10000.0, "rope_scaling": None, "max_position_embeddings": 512,
              "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False, "sliding_window": None,
              "bos_token_id": 1, "eos_token_ids": [2], "pad_token_id": 2, "dtype": "bfloat16"},
    "quantization": {"format": "fp8", "kv_cache": "fp8", "group_size": None, "exclude": ["lm_head"],
                     "unquantized_modules": [], "source": "modelopt 0.47.0"},
    "engine": {"max_batch_size": 8, "max_num_tokens": 256, "max_seq_len": 128, "max_input_len": 96,
               "kv_block_size": 16, "kv_cache_dtype": "fp8_e4m3", "kv_cache_free_mem_fraction": 0.9,
               "max_kv_tokens": None, "enable_prefix_caching": True, "enable_chunked_prefill": True,
               "scheduler_policy": "max_utilization", "tp_size": 1, "attention_backend": "auto"},
    "targets": {"sms": [90, 100]},
    "kernels": [{"name": "k-1", "key": "k[A=1]w4s3", "sm": 90, "cubin": "kernels/sm90/k-1.cubin",
                 "ptx": "kernels/sm90/k-1.ptx", "meta": "kernels/sm90/k-1.json",
                 "sha256": {"cubin": "a" * 64, "ptx": "b" * 64, "meta": "c" * 64}}],
    "speculative": {"method": "eagle3", "draft_dir": "draft", "max_draft_len": 4, "tree": "chain",
                    "tree_choices": None, "top_k": 4, "depth": 4, "min_draft_prob": 0.0, "aux_layers": [0, 1],
                    "draft_vocab_size": 64, "draft_source": "train", "train": {"steps": 3, "final_loss": 1.5}},
    "tools": {"torch": "2.13.0", "gguf": None},
    "hashes": {"config": "d" * 64, "source": "e" * 64},
    "verify": {"top1_agreement": 0.9, "mean_kl": 0.05, "num_prompts": 8, "num_positions": 100, "format": "fp8",
               "kv_cache_dtype": "fp8_e4m3", "min_top1_agreement": 0.8, "max_mean_kl": 0.12, "passed": True},
    "files": {},
}


@pytest.fixture()
def tiny(tmp_path) -> Path:
    """A bundle folder: weights and a tokenizer file, listed with their sha256 in engine.json."""
    (tmp_path / "weights.safetensors").write_bytes(b"weights")
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer.json").write_text("{}")
    doc = dict(DOC, files=bundle.file_hashes(tmp_path))
    (tmp_path / "engine.json").write_text(json.dumps(doc, indent=2) + "\n")
    return tmp_path


def edited(path: Path, edit) -> Path:
    doc = json.loads((path / "engine.json").read_text())
    edit(doc)
    (path / "engine.json").write_text(json.dumps(doc, indent=2) + "\n")
    return path


def refusal(path: Path, verify_hashes: bool = True) -> str:
    with pytest.raises(BundleError) as info:
        bundle.load_bundle(path, verify_hashes=verify_hashes)
    msg = str(info.value)
    assert "\n" not in msg, msg   # one line
    return msg


def test_round_trip_write_read_is_equal_and_byte_identical(tiny):
    text = (tiny / "engine.json").read_text()
    m = bundle.read(tiny)
    assert isinstance(m.model.eos_token_ids, tuple) and m.kernels[0].sm == 90 and m.speculative.aux_layers == (0, 1)
    assert m.verify.passed is True and m.engine.max_batch_size == 8 and m.targets.sms == (90, 100)
    out = tiny.parent / "copy"
    out.mkdir()
    bundle.write(out, m)
    assert bundle.read(out) == m
    assert (out / "engine.json").read_text() == text   # key order, indent 2, trailing newline: as the builder wrote
    assert bundle.load_bundle(tiny).manifest == m
    assert sorted(bundle.MODEL_KEYS) == sorted(f.name for f in dataclasses.fields(ModelConfig))  # none dropped


@pytest.mark.slow
def test_the_default_build_reads_back_byte_identical(build_bundle):
    engine = build_bundle("smollm2-135m-fp8")   # the default config, built by the real pipeline
    assert json.dumps(bundle.as_dict(bundle.read(engine)), indent=2) + "\n" == (engine / "engine.json").read_text()


def test_a_tensor_parallel_bundle_lists_one_weights_file_per_rank(tiny):
    """Version 2: ``weights`` names rank<i>.safetensors per rank of engine.tp_size, each hashed in
    ``files`` like any file; a single-file bundle leaves ``weights`` out and is still version 1."""
    assert bundle.rank_weights(1) == ("weights.safetensors",) and bundle.version_for(bundle.rank_weights(1)) == 1
    assert "weights" not in json.loads((tiny / "engine.json").read_text())
    (tiny / "weights.safetensors").unlink()
    for r in range(2):
        (tiny / f"rank{r}.safetensors").write_bytes(b"rank %d" % r)

    def tp2(d):
        d.update(format_version=2, weights=["rank0.safetensors", "rank1.safetensors"],
                 files=bundle.file_hashes(tiny))
        d["engine"]["tp_size"] = 2
    b = bundle.load_bundle(edited(tiny, tp2))
    assert b.manifest.weights == bundle.rank_weights(2) and b.manifest.format_version == 2
    assert b.weight_paths == [tiny / "rank0.safetensors", tiny / "rank1.safetensors"]
    assert b.rank_weights_path(1) == tiny / "rank1.safetensors"
    with pytest.raises(BundleError, match=r"split into 2 rank files \(engine.tp_size=2\)"):
        b.weights_path
    out = tiny / "copy"
    out.mkdir()
    bundle.write(out, b.manifest)
    assert bundle.read(out) == b.manifest and list(json.loads((out / "engine.json").read_text()))[-2:] == ["weights", "files"]
    assert "weights: per-rank files need format_version 2, got 1" in refusal(edited(tiny, lambda d: d.update(format_version=1)))
    edited(tiny, lambda d: d.update(format_version=2))
    assert "weights: 2 rank files but engine.tp_size is 3" in refusal(edited(tiny, lambda d: d["engine"].update(tp_size=3)))
    edited(tiny, lambda d: d["engine"].update(tp_size=2))
    assert "weights: ['rank1.safetensors']; expected" in refusal(edited(tiny, lambda d: d.update(weights=["rank1.safetensors"])))
    edited(tiny, lambda d: d.update(weights=["rank0.safetensors", "rank1.safetensors"]))
    (tiny / "rank1.safetensors").unlink()
    assert "rank1.safetensors: missing from the bundle" in refusal(tiny)


def test_engine_defaults_are_stated_once_and_resolved_against_the_model(tiny):
    e = bundle.read(edited(tiny, lambda d: [d["engine"].pop(k) for k in
                                             ("max_seq_len", "max_input_len", "kv_cache_dtype", "max_batch_size")])).engine
    assert (e.max_seq_len, e.max_input_len) == (512, 511)            # model.max_position_embeddings
    assert e.kv_cache_dtype == "fp8_e4m3" and e.max_batch_size == EngineSettings().max_batch_size == 64
    assert e.override(max_kv_tokens=64).max_kv_tokens == 64
    with pytest.raises(BundleError, match="engine override 'max_batch_sise': unknown key"):
        e.override(max_batch_sise=4)
    with pytest.raises(BundleError, match="engine override 'max_kv_tokens': expected an integer or null"):
        e.override(max_kv_tokens="64")


def test_other_format_version_is_refused_with_the_rebuild_hint(tiny):
    msg = refusal(edited(tiny, lambda d: d.update(format_version=3)))
    assert msg == (f"{tiny / 'engine.json'}: format_version 3 is not supported by this runtime (supported: 1, 2); "
                   f"{HINT}")
    assert "format 'trt' is not 'kiln-engine'" in refusal(edited(tiny, lambda d: d.update(format="trt")))


@pytest.mark.parametrize("edit, field", [
    (lambda d: d["model"].pop("vocab_size"), "model.vocab_size"),
    (lambda d: d.pop("quantization"), "quantization"),
    (lambda d: d["quantization"].pop("format"), "quantization.format"),
    (lambda d: d.pop("files"), "files"),
    (lambda d: d["kernels"][0].pop("sha256"), "kernels[0].sha256"),
    (lambda d: d["verify"].pop("passed"), "verify.passed"),
])
def test_a_missing_field_is_refused_naming_it(tiny, edit, field):
    assert refusal(edited(tiny, edit)) == f"{tiny / 'engine.json'}: {field}: missing; {HINT}"


@pytest.mark.parametrize("edit, fragment", [
    (lambda d: d["engine"].update(max_batch_size="64"), 'engine.max_batch_size: expected an integer, got "64"'),
    (lambda d: d["engine"].update(max_seq_len=True), "engine.max_seq_len: expected an integer or null, got true"),
    (lambda d: d["model"].update(eos_token_ids=[2, "3"]), 'model.eos_token_ids[1]: expected an integer, got "3"'),
    (lambda d: d.update(model=None), "model: expected an object, got null"),
    (lambda d: d["files"].update({"x": 1}), "files.x: expected a string, got 1"),
    (lambda d: d["model"].update(dtype="int8"), "model.dtype: 'int8'; allowed: bfloat16, float16, float32"),
    (lambda d: d["engine"].update(max_batch_sise=4), "engine.max_batch_sise: unknown field"),
])
def test_a_wrong_type_or_value_is_refused_naming_the_field(tiny, edit, fragment):
    msg = refusal(edited(tiny, edit))
    assert msg.startswith(f"{tiny / 'engine.json'}: {fragment}") and msg.endswith(HINT), msg


def test_a_hash_mismatch_is_refused(tiny):
    (tiny / "weights.safetensors").write_bytes(b"other weights")
    msg = refusal(tiny)
    assert msg.startswith(f"{tiny / 'weights.safetensors'}: changed since the build") and msg.endswith(HINT)
    bundle.load_bundle(tiny, verify_hashes=False)     # an explicit opt-out still loads
    (tiny / "tokenizer" / "tokenizer.json").unlink()
    assert "tokenizer.json: missing from the bundle" in refusal(tiny, verify_hashes=False)


def test_engine_json_that_is_not_json_is_refused_naming_the_file(tiny):
    (tiny / "engine.json").write_text("{not json")
    assert refusal(tiny).startswith(f"{tiny / 'engine.json'}: unreadable, not valid JSON")
    (tiny / "engine.json").write_text(json.dumps(dict(DOC, verify=dict(DOC["verify"], mean_kl=float("nan")))))
    assert "NaN is not JSON" in refusal(tiny)
    assert "is not an engine bundle" in refusal(tiny / "tokenizer")


def test_nan_is_refused_at_write_and_nothing_is_written(tiny):
    before = (tiny / "engine.json").read_text()
    m = bundle.read(tiny).replace(verify=dict(DOC["verify"], mean_kl=float("nan")))
    with pytest.raises(BundleError, match=r"engine.json: verify.mean_kl: not a finite number"):
        bundle.write(tiny, m)
    with pytest.raises(BundleError, match=r"verify.top1_agreement: not a finite number"):
        bundle.rewrite(tiny, "verify", dict(DOC["verify"], top1_agreement=float("inf")))
    assert (tiny / "engine.json").read_text() == before and not list(tiny.glob("*.tmp-*"))


def test_rewrite_replaces_one_section_and_keeps_the_rest(tiny):
    before = (tiny / "engine.json").read_text()
    assert bundle.rewrite(tiny, "verify", DOC["verify"]) is False          # unchanged: not rewritten
    assert bundle.rewrite(tiny, "verify", dict(DOC["verify"], passed=False)) is True
    after = (tiny / "engine.json").read_text()
    assert after.replace('"passed": false', '"passed": true') == before
    with pytest.raises(BundleError, match="verify.passed: expected true or false"):
        bundle.rewrite(tiny, "verify", dict(DOC["verify"], passed="yes"))


# ---- nothing else parses engine.json ------------------------------------------------------------

SOURCE_DIRS = ("builder", "backend", "harness", "plugins", "quant", "model_repository")
OWNER = REPO / "backend" / "bundle.py"


def engine_json_parses(source: str) -> list[int]:
    """Lines of ``json.load``/``json.loads`` calls whose argument reaches engine.json: it names the file (or
    bundle.MANIFEST), a variable bound to an expression that does, or a name like ``engine_json``."""
    tree = ast.parse(source)
    # the node's source text, as ast.get_source_segment gives it; that re-splits the whole source
    # on every call, which made this scan of ~300 files take 17 s
    starts = [0]   # byte offset of each line ("\n" only: str.splitlines also splits inside strings)
    for line in source.split("\n"):
        starts.append(starts[-1] + len(line.encode("utf-8")) + 1)
    raw = source.encode("utf-8")

    def mentions(node: ast.AST) -> bool:
        if getattr(node, "end_lineno", None) is None:
            return False
        a = starts[node.lineno - 1] + node.col_offset        # col offsets count utf-8 bytes
        b = starts[node.end_lineno - 1] + node.end_col_offset
        segment = raw[a:b].decode("utf-8", "replace")
        return "engine.json" in segment or "MANIFEST" in segment
    tainted = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) and node.value is not None \
                and mentions(node.value):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                tainted |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("load", "loads") and getattr(node.func.value, "id", None) == "json":
            names = {getattr(n, "id", None) or getattr(n, "attr", "") for arg in node.args for n in ast.walk(arg)}
            if any(mentions(arg) for arg in node.args) or names & tainted or any("engine_json" in n for n in names):
                hits.append(node.lineno)
    return hits


def test_the_check_catches_each_way_of_parsing_engine_json():
    assert engine_json_parses('import json\njson.loads((d / "engine.json").read_text())\n') == [2]
    assert engine_json_parses('p = d / "engine.json"\nx = 1\nd = json.loads(p.read_text())\n') == [3]
    assert engine_json_parses("def f(engine_json):\n    return json.load(open(engine_json))\n") == [2]
    assert engine_json_parses("json.loads(Path(args.engine_json).read_text())\n") == [1]
    assert engine_json_parses('json.loads((d / "config.json").read_text())\n'
                              'ok = (d / "engine.json").is_file()\n') == []


def test_no_module_but_backend_bundle_parses_engine_json():
    offenders = []
    for folder in SOURCE_DIRS:
        for f in sorted((REPO / folder).rglob("*.py")):
            if f == OWNER:
                continue
            text = f.read_text(encoding="utf-8")
            offenders += [f"{f.relative_to(REPO)}:{line}" for line in engine_json_parses(text)]
    assert not offenders, f"parse engine.json through backend.bundle (read/load_bundle) instead: {offenders}"
    assert engine_json_parses(OWNER.read_text()), "the owner itself must be seen by the check"
