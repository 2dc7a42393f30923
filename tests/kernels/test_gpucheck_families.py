"""The GPU check's family bundles work before they reach a GPU: ``harness.gpucheck`` prepares the Qwen3,
Mistral and Gemma 3 bundles with the real builder and this CPU's references, and its run (``--device cpu``:
the triton backend in Triton's interpreter) passes every comparison on them, and fails one whose logits
are not transformers'. Small: two prompts, 8 tokens (the GPU host runs the prepared 8 x 32)."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from harness.gpucheck import families, prepare

    out = tmp_path_factory.mktemp("gpu-check")
    mp = pytest.MonkeyPatch()
    mp.setattr(prepare, "OUT", out)
    mp.setattr(prepare, "MAX_TOKENS", 8)
    try:
        hf = out / "hf"
        prepare.make_tokenizer(hf)
        ids = [p[:n] for p, n in zip(prepare.prompts(hf), (8, 20))]
        entries = families.prepare(out, hf, prepare.TINY, prepare.build_config("bf16", hf), ids,
                                   prepare.cpu_reference, out, log=lambda m: None)
    finally:
        mp.undo()
    return out, {"prompts": ids, "max_tokens": 8, "bundles": entries}


def test_every_family_passes_the_run_on_this_cpu(prepared, monkeypatch):
    from harness.gpucheck import run

    out, ref = prepared
    assert set(ref["bundles"]) == {"qwen3", "mistral", "gemma3"}
    assert all(e["backends"] == ["triton", "torch"] for e in ref["bundles"].values())
    monkeypatch.setattr(run, "DIR", out)
    monkeypatch.setattr(run, "REPO", out)
    monkeypatch.setattr(run, "DEVICE", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for name, entry in ref["bundles"].items():
        res = run.check_bundle(name, entry, ref)
        assert res["ok"], json.dumps(res)[:2000]
        assert res[f"fp32_teacher_forced_vs_hf_{entry['backends'][0]}"]["top1_agreement"] == 1.0
        if "triton" in entry["backends"]:
            assert res["fp32_triton_vs_torch"]["all_equal"]


def test_a_family_whose_logits_are_not_transformers_fails(prepared, monkeypatch):
    import torch
    from safetensors.torch import load_file, save_file

    from harness.gpucheck import run

    out, ref = prepared
    f = out / "ref" / "gemma3-hf-logits.safetensors"
    good = load_file(str(f))["logits"]
    save_file({"logits": good.roll(1, dims=-1).contiguous()}, str(f))   # another model's distributions
    try:
        monkeypatch.setattr(run, "DIR", out)
        monkeypatch.setattr(run, "REPO", out)
        monkeypatch.setattr(run, "DEVICE", "cpu")
        res = run.check_bundle("gemma3", ref["bundles"]["gemma3"], ref)
    finally:
        save_file({"logits": good}, str(f))
    assert not res["ok"] and res["fp32_teacher_forced_vs_hf_torch"]["mean_kl"] > run.MAX_KL
    assert torch.equal(load_file(str(f))["logits"], good)
