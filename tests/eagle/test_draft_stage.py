"""The draft build stage imports public EAGLE-3 checkpoints against the real SmolLM2 target and
refuses ones that do not fit, with a one-line message naming the file and field."""
import json

import pytest
import torch
from safetensors.torch import save_file

from builder.config import BuildConfig
from builder.stages import draft as draft_stage
from builder.stages.base import StageContext, StageError, StageResult
from tests.conftest import REPO

CONFIG = REPO / "configs" / "smollm2-135m-bf16-eagle3.yaml"


def write_public_draft(path, hidden=576, vocab=49152, heads=9, kv_heads=3, head_dim=64, inter=1536,
                       aux=(1, 14, 26), prefix="midlayer."):
    """An EAGLE-3 checkpoint as the EAGLE reference trainer lays it out (random weights)."""
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32).to(torch.bfloat16) * 0.02

    t = {"fc.weight": r(hidden, len(aux) * hidden), "norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
         prefix + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
         prefix + "hidden_norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
         prefix + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
         prefix + "self_attn.q_proj.weight": r(heads * head_dim, 2 * hidden),
         prefix + "self_attn.k_proj.weight": r(kv_heads * head_dim, 2 * hidden),
         prefix + "self_attn.v_proj.weight": r(kv_heads * head_dim, 2 * hidden),
         prefix + "self_attn.o_proj.weight": r(hidden, heads * head_dim),
         prefix + "mlp.gate_proj.weight": r(inter, hidden), prefix + "mlp.up_proj.weight": r(inter, hidden),
         prefix + "mlp.down_proj.weight": r(hidden, inter)}
    save_file(t, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": hidden, "vocab_size": vocab,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "intermediate_size": inter, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
        "eagle_aux_hidden_state_layer_ids": list(aux), "torch_dtype": "bfloat16"}))
    return path


def run_stage(tmp_path, hf_dir, draft_path, *overrides):
    cfg = BuildConfig.from_yaml(CONFIG, [f"speculative.draft={draft_path}", *overrides])
    out = tmp_path / "out"
    out.mkdir()
    ctx = StageContext(config=cfg, name="draft", root=tmp_path, out_dir=out,
                       results={"import": StageResult("import", "cached", hf_dir, "k", {})}, log=lambda m: None)
    return draft_stage.run(ctx), out


@pytest.mark.slow
def test_public_checkpoint_is_imported_into_the_bundle_layout(tmp_path, smollm2_hf_dir):
    src = write_public_draft(tmp_path / "eagle")
    info, out = run_stage(tmp_path, smollm2_hf_dir, src)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "weights.safetensors"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["aux_layers"] == [1, 14, 26] and cfg["has_lm_head"] is False
    assert cfg["double_hidden_norm"] is False          # reference layout: feature normalised once
    spec = info["speculative"]
    assert spec["method"] == "eagle3" and spec["draft_dir"] == "draft" and spec["tree"] == "chain"


@pytest.mark.slow
@pytest.mark.parametrize("kwargs, msg", [
    ({"hidden": 512, "heads": 8}, "hidden_size 512 does not match the target's hidden_size 576"),
    ({"vocab": 32000}, "vocab_size 32000 does not match the target's vocab_size 49152"),
    ({"aux": (1, 14, 40)}, "aux layer ids"),
])
def test_mismatched_checkpoint_is_refused_at_build_time(tmp_path, smollm2_hf_dir, kwargs, msg):
    src = write_public_draft(tmp_path / "eagle", **kwargs)
    with pytest.raises(StageError, match=msg) as exc:
        run_stage(tmp_path, smollm2_hf_dir, src)
    assert "\n" not in str(exc.value)
    assert not any((tmp_path / "out").iterdir())       # nothing half-written


@pytest.mark.slow
def test_missing_folder_and_aux_layer_disagreement(tmp_path, smollm2_hf_dir):
    (tmp_path / "a").mkdir()
    with pytest.raises(StageError, match="is not a folder"):
        run_stage(tmp_path / "a", smollm2_hf_dir, tmp_path / "nope")
    src = write_public_draft(tmp_path / "eagle")
    (tmp_path / "b").mkdir()
    with pytest.raises(StageError, match="speculative.aux_layers: \\[2, 14, 26\\] but the draft"):
        run_stage(tmp_path / "b", smollm2_hf_dir, src, "speculative.aux_layers=[2,14,26]")


def test_skip_reason_and_prompts(tmp_path):
    cfg = BuildConfig.from_yaml(CONFIG, ["speculative.method=none"])
    ctx = StageContext(config=cfg, name="draft", root=tmp_path, out_dir=tmp_path, results={})
    assert draft_stage.skip_reason(ctx) == "speculative.method is none"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"prompt": "no text field"}\n')
    cfg = BuildConfig.from_yaml(CONFIG, [f"speculative.train.dataset={bad}"])
    ctx = StageContext(config=cfg, name="draft", root=tmp_path, out_dir=tmp_path, results={})
    with pytest.raises(StageError, match="bad.jsonl:2: each line needs a non-empty string field 'text'"):
        draft_stage.load_prompts(ctx, 10)
    cfg = BuildConfig.from_yaml(CONFIG)
    ctx = StageContext(config=cfg, name="draft", root=tmp_path, out_dir=tmp_path, results={})
    builtin = draft_stage.load_prompts(ctx, 10_000)
    assert len(builtin) == 1024 and len(set(builtin)) == 1024    # the built-in prompt set, no repeats
    assert len(draft_stage.load_prompts(ctx, 100)) == 100
    # Never trained on what the draft is measured on: the verify stage's held-out prompts.
    from builder.stages.verify import load_prompts as heldout_prompts
    assert not set(builtin) & set(heldout_prompts(10_000))


def test_draft_vocab_prefers_frequent_tokens():
    ids = draft_stage.draft_vocab([[5, 5, 5, 9, 9, 2]], vocab_size=20, size=6)
    assert ids == sorted(ids) and {5, 9, 2} <= set(ids) and len(ids) == 6
    assert ids == [0, 1, 2, 3, 5, 9]
