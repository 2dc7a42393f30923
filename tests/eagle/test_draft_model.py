"""The runtime draft head computes what ModelOpt's EAGLE-3 module computes (real ModelOpt, a tiny
random Llama so it runs in seconds), and bad draft checkpoints are refused with clear messages."""
import copy

import pytest
import torch

from backend.speculative.checkpoint import DraftCheckpointError, read_hf_draft, write_bundle_draft, read_bundle_draft
from backend.speculative.draft_model import Eagle3Draft


@pytest.fixture(scope="module")
def tiny_eagle(tmp_path_factory):
    """A ModelOpt EAGLE-3 model on a tiny random Llama, exported in the public HF layout."""
    from transformers import LlamaConfig, LlamaForCausalLM
    import modelopt.torch.speculative as mtsp
    from modelopt.torch.export import export_speculative_decoding

    torch.manual_seed(0)
    tc = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
                     rope_theta=10000.0, tie_word_embeddings=True)
    tc.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(tc).float().eval()
    cfg = copy.deepcopy(mtsp.EAGLE3_DEFAULT_CFG["config"])
    cfg["eagle_architecture_config"].update(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
        rope_theta=10000.0, rope_scaling={"rope_type": "default", "rope_theta": 10000.0},
        draft_vocab_size=96)
    cfg.update(eagle_use_torch_compile=False, eagle_export_rope_scaling={})
    mtsp.convert(model, [("eagle", cfg)])
    em = model.eagle_module
    with torch.no_grad():  # random, non-trivial norms and vocabulary map
        for n, p in em.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.3)
        em.d2t.copy_(torch.arange(96) * 2 - torch.arange(96))   # draft id i -> target id 2i
    model.eval()
    out = tmp_path_factory.mktemp("eagle_export")
    export_speculative_decoding(model, export_dir=out)
    return model, tc, out


def test_exported_draft_matches_modelopt_forward(tiny_eagle):
    model, tc, out = tiny_eagle
    cfg, tensors = read_hf_draft(out, tc.to_dict())
    assert cfg.double_hidden_norm and cfg.draft_vocab_size == 96 and "d2t" in tensors
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = model.model(input_ids=ids, output_hidden_states=True)
        model.pop_and_gather_aux_hiddens()   # the hooks collected these too; keep ModelOpt's state clean
        aux = torch.cat([base.hidden_states[a + 1] for a in cfg.aux_layers], -1)
        # ModelOpt's own first EAGLE step: inputs shifted left by one (entry p gets token p+1).
        eagle_ids = torch.cat([ids[:, 1:], ids[:, :1]], 1)
        feats = model.eagle_module.fc(aux)
        model.eagle_module._maybe_init_rope()
        mask = model._prepare_decoder_attention_mask(None, (1, 12), 0, feats.device, feats.dtype)
        _, ref_pre, ref_logits, _ = model._eagle_forward(feats, model.model.embed_tokens(eagle_ids), mask, None)

    draft = Eagle3Draft(cfg, tensors, model.model.embed_tokens.weight, None, 128, "cpu", torch.float32)
    cache = draft.new_cache(4)  # grows on demand
    h = draft.step(draft.fuse(aux[0]), eagle_ids[0], torch.arange(12), cache, 0)
    torch.testing.assert_close(h, ref_pre[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(draft.logits(h), ref_logits[0].float(), atol=1e-4, rtol=1e-4)
    # Incremental decoding through the draft's own cache gives the same as the full pass.
    cache2 = draft.new_cache(4)
    h1 = draft.step(draft.fuse(aux[0, :7]), eagle_ids[0, :7], torch.arange(7), cache2, 0)
    cache2.length = 7
    h2 = draft.step(draft.fuse(aux[0, 7:]), eagle_ids[0, 7:], torch.arange(7, 12), cache2, 7)
    torch.testing.assert_close(torch.cat([h1, h2]), h, atol=1e-4, rtol=1e-4)
    assert draft.to_target_ids(torch.tensor([0, 5])).tolist() == [0, 10]


def test_bundle_round_trip(tiny_eagle, tmp_path):
    _, tc, out = tiny_eagle
    cfg, tensors = read_hf_draft(out, tc.to_dict())
    write_bundle_draft(tmp_path, cfg, tensors)
    cfg2, tensors2 = read_bundle_draft(tmp_path)
    assert cfg2 == cfg and set(tensors2) == set(tensors)


@pytest.mark.parametrize("field, value, msg", [
    ("hidden_size", 128, "hidden_size 64 does not match the target's hidden_size 128"),
    ("vocab_size", 512, "vocab_size 256 does not match the target's vocab_size 512"),
    ("num_hidden_layers", 2, "aux layer ids"),
])
def test_mismatched_draft_is_refused(tiny_eagle, field, value, msg):
    _, tc, out = tiny_eagle
    target = tc.to_dict()
    target[field] = value
    with pytest.raises(DraftCheckpointError, match=msg):
        read_hf_draft(out, target)


def test_broken_draft_folders_are_refused(tiny_eagle, tmp_path):
    _, tc, out = tiny_eagle
    with pytest.raises(DraftCheckpointError, match="no config.json"):
        read_hf_draft(tmp_path, tc.to_dict())
    (tmp_path / "config.json").write_text((out / "config.json").read_text())
    with pytest.raises(DraftCheckpointError, match="no \\*.safetensors"):
        read_hf_draft(tmp_path, tc.to_dict())
    from safetensors.torch import load_file, save_file
    t = load_file(str(out / "model.safetensors"))
    del t["fc.weight"]
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(DraftCheckpointError, match="missing tensor 'fc.weight'"):
        read_hf_draft(tmp_path, tc.to_dict())
    t = load_file(str(out / "model.safetensors"))
    del t["d2t"]
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(DraftCheckpointError, match="no 'd2t'"):
        read_hf_draft(tmp_path, tc.to_dict())
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(DraftCheckpointError, match="not valid JSON"):
        read_hf_draft(tmp_path, tc.to_dict())
