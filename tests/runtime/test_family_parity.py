"""Each family the runtime runs reproduces transformers' own class: a random tiny fp32 checkpoint written by
``save_pretrained`` builds with ``quantization.format=none`` and Kiln's greedy tokens are transformers'
``generate(do_sample=False)`` tokens on 3 prompts x 32 tokens, with every step's logits within 1e-4.

One build per family per module (seconds each); SmolLM2's real tokenizer files ride along so the build's
tokenizer handling is the genuine one, while the prompts are random ids of the tiny vocabulary.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from backend.engine.sampling_params import SamplingParams
from tests.runtime.hf_reference import hf_greedy

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
PROMPT_LENS = (5, 23, 41)           # under, across and over two 16-token KV blocks
VOCAB = 256
WINDOW = 16                         # sliding layers' window: below every prompt + generated length
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=VOCAB, max_position_embeddings=1024, tie_word_embeddings=False)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32, "rope_theta": 500000.0}
# LongRoPE: 8 frequencies at head_dim 16; the prompts stay within the pretraining length, as transformers
# switches every position to the long factors past it (the runtime only the positions past it)
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + i / 4 for i in range(8)],
            "long_factor": [2.0 + i for i in range(8)]}
PHI3 = {"pad_token_id": 0, "sliding_window": None}     # Phi3Config's pad id 32000 is outside the tiny vocabulary
# name -> (config class, model class, config changes from TINY)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3_rope": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": LLAMA3, "num_hidden_layers": 3}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"hidden_size": 96, "num_attention_heads": 6}),
    # head_dim is not hidden / heads (64 / 4) in Qwen3; one checkpoint ties the head, one does not
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
    "qwen3_bias": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32, "attention_bias": True}),   # q/k/v and o
    "qwen3_tied": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16, "num_attention_heads": 8, "num_hidden_layers": 3,
                                                       "tie_word_embeddings": True}),
    # q/k/v in one qkv_proj and gate/up in one gate_up_proj
    "phi3": ("Phi3Config", "Phi3ForCausalLM", PHI3),
    "phi3_longrope": ("Phi3Config", "Phi3ForCausalLM", {**PHI3, "rope_parameters": LONGROPE,
                                                        "original_max_position_embeddings": 128}),
    # every layer slides, over a window shorter than every prompt + its 32 tokens
    "mistral_window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}),
    # 2 sliding : 1 full (rope bases 10k / 1M), four (1 + w) norms a layer, GELU-tanh, sqrt(hidden) embedding
    # scale, per-head q/k norms, a query scalar that is not head_dim, a tied head
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 32, "num_hidden_layers": 4, "sliding_window": WINDOW, "query_pre_attn_scalar": 24,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        "tie_word_embeddings": True}),
    # mixture of experts: Mixtral's top-2 of 4 renormalised on every layer; Qwen3-MoE's top-2 of 8 not
    # renormalised, layer 0 dense (mlp_only_layers); one renormalised on every second layer (decoder_sparse_step)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "head_dim": 16, "num_hidden_layers": 3, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "mlp_only_layers": [0]}),
    "qwen3_moe_step": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "decoder_sparse_step": 2, "norm_topk_prob": True}),
    # Qwen2-MoE: q/k/v biases, top-2 of 8 not renormalised plus a sigmoid-gated shared expert, layer 1 dense
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        "num_hidden_layers": 3, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48, "mlp_only_layers": [1]}),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _checkpoint(name: str, out: Path, tokenizer_src: Path, **extra) -> Path:
    import transformers

    cfg_cls, model_cls, change = FAMILIES[name]
    config = getattr(transformers, cfg_cls)(**{**TINY, **change, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).float()
    # random init leaves norm weights at 1 (and biases at 0): perturb them so a missing norm or bias shows
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or pname.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.2)
            elif pname.endswith("mlp.gate.weight"):   # a router: decisive choices, not near-ties of a random init
                p.copy_(torch.randn_like(p))
            elif pname.endswith("shared_expert_gate.weight"):   # a gate that varies per token, not ~0.5 for all
                p.copy_(torch.randn_like(p) * 0.2)
    model.save_pretrained(out)
    for f in TOKENIZER_FILES:
        shutil.copy2(tokenizer_src / f, out / f)
    return out


def _build(src: Path, out: Path, quantized: bool = False, dtype: str = "float32", fmt: str = "fp8",
           extra: tuple[str, ...] = ()) -> Path:
    from builder.config import BuildConfig
    from builder.pipeline import run_pipeline

    # ``fmt`` + fp8 KV with a light calibration, then the verify stage's gate at that format's defaults
    quant = ([f"quantization.format={fmt}", "quantization.kv_cache=fp8", "quantization.calibration.num_samples=4",
              "quantization.calibration.max_seq_len=64"] if quantized else
             ["quantization.format=none", "quantization.kv_cache=none", "verify.enabled=false"])
    cfg = BuildConfig.from_dict({}, f"{src.name}.yaml", [
        f"model.source={src}", f"model.dtype={dtype}", *quant, "engine.max_seq_len=256", "engine.max_input_len=128",
        "engine.max_kv_tokens=2048", "engine.cpu_dtype=float32", *extra])
    return run_pipeline(cfg, out, until="verify" if quantized else "compile", log=lambda m: None).bundle


@pytest.fixture(scope="module")
def built(tmp_path_factory, smollm2_hf_dir):
    """``built(name) -> (name, HF checkpoint dir, bundle dir)``, each family built once for this module."""
    done: dict[str, tuple[str, Path, Path]] = {}

    def get(name: str) -> tuple[str, Path, Path]:
        if name not in done:
            root = tmp_path_factory.mktemp(name)
            src = _checkpoint(name, root / name, Path(smollm2_hf_dir))
            done[name] = (name, src, _build(src, root / "out"))
        return done[name]
    return get


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, built):
    return built(request.param)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _hf_model(src: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    return hf_greedy(model, prompt, NEW_TOKENS)


def test_greedy_tokens_and_logits_equal_transformers(family, prompts):
    from backend.engine.executor import Executor
    from backend.runtime.native import ModelRunner, prefill_logits
    from backend.runtime.spec import load_engine_spec

    name, src, bundle_dir = family
    engine = json.loads((bundle_dir / "engine.json").read_text())
    assert engine["quantization"]["format"] == "none" and engine["model"]["dtype"] == "float32"
    hf = _hf_model(src)
    ex = Executor(bundle_dir, dtype=torch.float32, verify_hashes=False)
    try:
        ours = ex.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    finally:
        ex.shutdown()
    runner = ModelRunner(load_engine_spec(bundle_dir), device="cpu", dtype=torch.float32)
    for k, (prompt, res) in enumerate(zip(prompts, ours)):
        ref = _hf_greedy(hf, prompt)
        assert res.token_ids == ref, f"{name} prompt {k}: Kiln {res.token_ids} != transformers {ref}"
        # every generated token's logits: one teacher-forced pass over prompt + tokens on each side
        full = prompt + ref
        got = prefill_logits(runner, full)[len(prompt) - 1:-1]
        with torch.no_grad():
            want = hf(torch.tensor([full])).logits[0, len(prompt) - 1:-1]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0, msg=lambda m: f"{name} prompt {k}: {m}")


@pytest.mark.parametrize("name", ["gemma3", "mistral_window"])
def test_windows_hold_over_chunked_prefill(built, prompts, name):
    """A prefill split into 8-token chunks attends the window across chunk edges (the cached keys of earlier
    chunks fall out of it as the real positions say): the same greedy tokens as transformers. A prompt twice,
    the second reusing the first's cached prefix blocks, gives them again."""
    from backend.engine.executor import Executor

    _, src, bundle_dir = built(name)
    hf = _hf_model(src)
    runs = prompts + [prompts[2]]
    ex = Executor(bundle_dir, dtype=torch.float32, verify_hashes=False, max_num_tokens=8)
    try:
        ours = [ex.generate([p], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))[0]
                for p in runs]
    finally:
        ex.shutdown()
    for k, (prompt, res) in enumerate(zip(runs, ours)):
        assert res.token_ids == _hf_greedy(hf, prompt), f"{name} prompt {k}"


def test_the_bundle_holds_the_checkpoint_norms_under_runtime_names(family):
    """Every norm of the checkpoint (Qwen3's per-head q/k norms included) is in the bundle, renamed, as it was."""
    from safetensors import safe_open

    name, src, bundle_dir = family
    hf, ours = safe_open(str(src / "model.safetensors"), "pt"), safe_open(str(bundle_dir / "weights.safetensors"), "pt")
    renames = {"input_layernorm": "input_norm", "post_attention_layernorm": "post_attn_norm",
               "self_attn.q_norm": "q_norm", "self_attn.k_norm": "k_norm",
               "pre_feedforward_layernorm": "pre_ff_norm", "post_feedforward_layernorm": "post_ff_norm"}
    norms = [n for n in hf.keys() if n.startswith("model.layers.") and "norm" in n]
    assert any("q_norm" in n for n in norms) == name.startswith(("qwen3", "gemma3"))
    for n in norms:
        i, module = n[len("model.layers."):].split(".", 1)
        assert torch.equal(ours.get_tensor(f"layers.{i}.{renames[module.removesuffix('.weight')]}.weight"),
                           hf.get_tensor(n)), n
    assert ("lm_head.weight" in ours.keys()) == (not json.loads((src / "config.json").read_text())["tie_word_embeddings"])
    for hf_name, runtime in (("self_attn.q_proj.bias", "qkv.bias"), ("self_attn.o_proj.bias", "o.bias")):
        assert (f"layers.0.{runtime}" in ours.keys()) == (f"model.layers.0.{hf_name}" in hf.keys()), runtime
    assert ("model.layers.0.self_attn.o_proj.bias" in hf.keys()) == (name == "qwen3_bias")


# name -> the tiny checkpoint's changes for the gate (the whole vocabulary is added)
# Llama's gate runs on the real SmolLM2 and Gemma 3's on the real 270M (tests/runtime/test_gemma3_real.py:
# a tiny random Gemma 3's logits are too flat for the gate's top-1 to mean anything)
GATED = {"qwen3_tied": {"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 32},
         "phi3_longrope": {"original_max_position_embeddings": 512},
         "mistral_window": {"num_attention_heads": 4}, "qwen2": {}}


@pytest.fixture(scope="module")
def gated(tmp_path_factory, smollm2_hf_dir):
    """``gated(name) -> checkpoint dir``: the family's gate checkpoint (GATED), written once for this module.
    The held-out and calibration prompts are real text, so it has the tokenizer's whole vocabulary."""
    done: dict[str, Path] = {}
    vocab = json.loads((Path(smollm2_hf_dir) / "config.json").read_text())["vocab_size"]

    def get(name: str) -> Path:
        if name not in done:
            root = tmp_path_factory.mktemp(f"gated-{name}")
            done[name] = _checkpoint(name, root / name, Path(smollm2_hf_dir), vocab_size=vocab, **GATED[name])
        return done[name]
    return get


def _gate(bundle_dir: Path, name: str, fmt: str) -> dict:
    """The bundle's verify report, checked to be ``fmt`` + fp8 KV held to that format's default thresholds."""
    from builder.stages.verify import DEFAULT_THRESHOLDS

    engine = json.loads((bundle_dir / "engine.json").read_text())
    gate = engine["verify"]
    assert (engine["quantization"]["format"], engine["engine"]["kv_cache_dtype"]) == (fmt, "fp8_e4m3")
    assert (gate["min_top1_agreement"], gate["max_mean_kl"]) == DEFAULT_THRESHOLDS[fmt]
    print(f"{name}: {fmt} + fp8 KV top-1 {gate['top1_agreement']:.3f}, mean KL {gate['mean_kl']:.2g}")
    return gate


@pytest.mark.parametrize("name", sorted(GATED))
def test_fp8_with_fp8_kv_passes_the_accuracy_gate(name, gated, tmp_path):
    """The verify stage's reference is the same one: the imported checkpoint run by transformers in fp32.
    Measured on qwen3: top-1 0.90 (the bundle run without its q/k norms: 0.61, failing the 0.80 gate)."""
    from safetensors import safe_open

    bundle_dir = _build(gated(name), tmp_path / "out", quantized=True)
    gate = _gate(bundle_dir, name, "fp8")
    assert gate["passed"] is True, gate
    ours = safe_open(str(bundle_dir / "weights.safetensors"), "pt")
    assert ours.get_tensor("layers.1.qkv.weight").dtype == torch.float8_e4m3fn
    assert "layers.1.attn.k_scale" in ours.keys()
    if json.loads((bundle_dir / "engine.json").read_text())["model"]["arch"]["qk_norm"]:
        # the q/k norms stay unquantized: fp32 as the checkpoint has them
        assert ours.get_tensor("layers.1.q_norm.weight").dtype == torch.float32


@pytest.mark.parametrize("fmt", ["nvfp4", "int4_awq", "int8_sq", "w4a8_awq"])
@pytest.mark.parametrize("name", sorted(GATED))
def test_every_format_passes_the_accuracy_gate(name, fmt, gated, tmp_path):
    """The 4-bit and int8 formats with an fp8 KV cache on every gated family (Qwen3's per-head q/k norms stay
    unquantized; Phi-3 quantizes its checkpoint's fused qkv_proj and gate_up_proj as single linears; Qwen2 has
    q/k/v biases), each held to its own gate (builder/stages/verify.py DEFAULT_THRESHOLDS)."""
    # (the AWQ formats' groups of 32: 64 does not divide the tiny models' 96 features)
    extra = ("quantization.group_size=32",) if fmt.endswith("awq") else ()
    bundle_dir = _build(gated(name), tmp_path / "out", quantized=True, fmt=fmt, extra=extra)
    gate = _gate(bundle_dir, name, fmt)
    assert gate["passed"] is True, gate
    if name.startswith("phi3"):
        # a checkpoint's fused linear is one ModelOpt module: its scales (per row, per group, per 16-block) and
        # its AWQ / SmoothQuant input scale reach the bundle whole. The gate alone misses a lost pre-quant
        # scale here (int4_awq with it replaced by ones: top-1 0.739 against 0.746)
        from safetensors import safe_open

        export = safe_open(str(tmp_path / "out" / "work" / "quantize" / "model.safetensors"), "pt")
        ours = safe_open(str(bundle_dir / "weights.safetensors"), "pt")
        for runtime, hf in (("qkv", "self_attn.qkv_proj"), ("gate_up", "mlp.gate_up_proj")):
            for t in ("weight_scale", "pre_quant_scale"):
                if f"model.layers.1.{hf}.{t}" in export.keys():
                    assert torch.equal(ours.get_tensor(f"layers.1.{runtime}.{t}").float(),
                                       export.get_tensor(f"model.layers.1.{hf}.{t}").float()), (runtime, t)
            assert (f"layers.1.{runtime}.pre_quant_scale" in ours.keys()) == (fmt != "nvfp4"), runtime


@pytest.mark.parametrize("name", ["qwen3", "qwen3_bias"])
def test_the_onnx_graph_computes_qwen3s_qk_norms(built, name, tmp_path):
    """The TensorRT target's decoder graph (onnx's ReferenceEvaluator, the Kiln nodes by the kernels'
    references) applies the per-head q/k norms as standard nodes before the rope plugin: the native
    runner's logits over a 40-token prefill, and its KV pool."""
    import onnx

    from backend import bundle
    from builder.tensorrt.onnx_export import decoder_model
    from tests.runtime.graph_helpers import prefill_parity, runners

    _, _, bundle_dir = built(name)
    graph = tmp_path / "decoder.onnx"
    model = decoder_model(bundle_dir, bundle.read(bundle_dir))
    assert sum(n.name.endswith("qk_norm.rsqrt") for n in model.graph.node) == 2   # one per layer
    onnx.save_model(model, graph)
    native, onnx_runner = runners(bundle_dir, graph=graph)
    prefill_parity(native, onnx_runner, list(range(3, 43)))


@pytest.mark.parametrize("name, field", [("gemma3", "model.arch.norm: 'rms_one_plus'"),
                                         ("mistral_window", "model: a sliding window of 16 below engine.max_seq_len 256")])
def test_the_onnx_export_refuses_what_its_graph_does_not_compute(built, name, field):
    from backend import bundle
    from builder.tensorrt.onnx_export import ExportError, decoder_model

    _, _, bundle_dir = built(name)
    with pytest.raises(ExportError) as exc:
        decoder_model(bundle_dir, bundle.read(bundle_dir))
    assert str(exc.value).startswith(f"{bundle_dir / 'engine.json'}: {field}")
    assert str(exc.value).endswith("tensorrt.enabled=false")
    llama_dir = built("llama")[2]
    assert decoder_model(llama_dir, bundle.read(llama_dir)).graph.node   # the llama layer still exports


@pytest.mark.parametrize("name", ["phi3_longrope", "qwen3", "mixtral"])
def test_the_load_time_dtype_probe_runs_the_family_layer(name, built, tmp_path):
    """A bf16 bundle with engine.cpu_dtype auto times one decoder layer in each dtype at load
    (backend/runtime/layer_probe.py), with the bundle's own rope and q/k norms; the fp32 parity builds skip it."""
    from backend.runtime.native import ModelRunner
    from backend.runtime.spec import load_engine_spec

    _, src, _ = built(name)
    bundle_dir = _build(src, tmp_path / "bf16", dtype="bfloat16")
    runner = ModelRunner(load_engine_spec(bundle_dir, {"cpu_dtype": "auto"}), device="cpu")
    # (a CPU without bf16 instructions skips the timing; one that has them times both dtypes)
    assert "timing failed" not in runner.dtype_choice.reason, runner.dtype_choice


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_the_bundle_packs_each_expert_as_the_checkpoint_has_it(built, name):
    """Expert e of layer i in the bundle is the checkpoint's expert e (gate rows, then up, then down apart),
    only on the spec's sparse layers; a dense layer keeps its gate_up/down. So is a shared expert and its gate."""
    from safetensors import safe_open

    _, src, bundle_dir = built(name)
    hf, ours = safe_open(str(src / "model.safetensors"), "pt"), safe_open(str(bundle_dir / "weights.safetensors"), "pt")
    experts = json.loads((bundle_dir / "engine.json").read_text())["model"]["arch"]["experts"]
    moe, names = (("block_sparse_moe", ("w1", "w3", "w2")) if name == "mixtral"
                  else ("mlp", ("gate_proj", "up_proj", "down_proj")))
    for i in range(json.loads((src / "config.json").read_text())["num_hidden_layers"]):
        assert (f"layers.{i}.experts.gate_up.weight" in ours.keys()) == (i in experts["layers"]) \
            != (f"layers.{i}.gate_up.weight" in ours.keys()), i
        if i not in experts["layers"]:
            continue
        assert torch.equal(ours.get_tensor(f"layers.{i}.router.weight"), hf.get_tensor(f"model.layers.{i}.{moe}.gate.weight"))
        gate_up, down = ours.get_tensor(f"layers.{i}.experts.gate_up.weight"), ours.get_tensor(f"layers.{i}.experts.down.weight")
        for e in range(experts["num_experts"]):
            g, u, d = (hf.get_tensor(f"model.layers.{i}.{moe}.experts.{e}.{n}.weight") for n in names)
            assert torch.equal(gate_up[e], torch.cat([g, u])) and torch.equal(down[e], d), (i, e)
        shared = {f"layers.{i}.shared_expert.gate_up.weight": torch.cat(
                      [hf.get_tensor(f"model.layers.{i}.mlp.shared_expert.{n}.weight") for n in ("gate_proj", "up_proj")]),
                  f"layers.{i}.shared_expert.down.weight": hf.get_tensor(f"model.layers.{i}.mlp.shared_expert.down_proj.weight"),
                  f"layers.{i}.shared_expert_gate.weight": hf.get_tensor(f"model.layers.{i}.mlp.shared_expert_gate.weight")
                  } if "shared_intermediate_size" in experts else {}
        assert (f"layers.{i}.shared_expert.gate_up.weight" in ours.keys()) == bool(shared) == (name == "qwen2_moe")
        for runtime, want in shared.items():
            assert torch.equal(ours.get_tensor(runtime), want), runtime
