"""EAGLE-3 draft checkpoints: read the public Hugging Face layout, check it against the target,
write and read the bundle's ``draft/`` folder. Imports only torch, safetensors and json, so both the
builder and the runtime use it.

Public layout (``LlamaForCausalLMEagle3``, as written by ModelOpt's ``export_speculative_decoding``
and by the EAGLE/SpecForge trainers): ``config.json`` plus ``*.safetensors`` (or
``pytorch_model.bin``) holding ``fc.weight``, ONE decoder layer under ``layers.0.`` (ModelOpt) or
``midlayer.`` (EAGLE reference code), ``norm.weight``, optionally ``lm_head.weight`` (over the draft
vocabulary) and the vocabulary maps ``d2t`` (draft id -> target id offset) / ``t2d``.

Bundle layout (``draft/``): ``weights.safetensors`` with the names of ``DRAFT_TENSORS`` (layer
prefix normalised to ``layers.0.``, ``d2t`` int64 when the draft vocabulary is smaller) and
``config.json`` = :class:`DraftConfig` as JSON.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

DRAFT_FORMAT = "kiln-eagle3"
DRAFT_FORMAT_VERSION = 1

_LAYER = "layers.0."
REQUIRED = ("fc.weight", "norm.weight",
            _LAYER + "input_layernorm.weight", _LAYER + "hidden_norm.weight",
            _LAYER + "post_attention_layernorm.weight",
            _LAYER + "self_attn.q_proj.weight", _LAYER + "self_attn.k_proj.weight",
            _LAYER + "self_attn.v_proj.weight", _LAYER + "self_attn.o_proj.weight",
            _LAYER + "mlp.gate_proj.weight", _LAYER + "mlp.up_proj.weight",
            _LAYER + "mlp.down_proj.weight")
OPTIONAL = ("lm_head.weight", "d2t")


class DraftCheckpointError(ValueError):
    """A draft checkpoint that cannot be used with this target: the message is one line."""


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int                 # target vocabulary (ids the draft emits after d2t)
    draft_vocab_size: int           # rows of the draft lm_head
    rms_norm_eps: float
    rope_theta: float
    aux_layers: tuple[int, ...]     # target layers whose OUTPUT hidden states feed ``fc``
    has_lm_head: bool               # False: use the target's lm_head (same vocabulary)
    # ModelOpt's EagleModule runs the fc output through layers[0].input_layernorm (the decoder
    # layer's own pre-norm) and THEN hidden_norm; the EAGLE reference code applies hidden_norm only.
    # A draft must be run the way it was trained, so the flag travels with the weights.
    double_hidden_norm: bool = False
    rope_scaling: dict | None = None
    dtype: str = "bfloat16"
    format: str = DRAFT_FORMAT
    format_version: int = DRAFT_FORMAT_VERSION

    @property
    def arch_spec(self) -> None:
        """A draft is one Llama decoder layer (EAGLE-3 drafts stay dense): no architecture spec, as a
        target's ModelConfig answers for the graph export's shared layer code."""
        return None

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["aux_layers"] = list(self.aux_layers)
        return d

    @classmethod
    def from_json(cls, d: dict, where: str = "draft/config.json") -> "DraftConfig":
        if d.get("format") != DRAFT_FORMAT or d.get("format_version") != DRAFT_FORMAT_VERSION:
            raise DraftCheckpointError(
                f"{where}: format {d.get('format')!r} version {d.get('format_version')!r} is not "
                f"{DRAFT_FORMAT!r} version {DRAFT_FORMAT_VERSION}; rebuild the engine")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise DraftCheckpointError(f"{where}: unknown key {unknown[0]!r}")
        d = dict(d)
        d["aux_layers"] = tuple(d["aux_layers"])
        return cls(**d)


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's early/middle/late layers (the same rule ModelOpt uses when training)."""
    return tuple(sorted({1, max(0, num_layers // 2 - 1), max(0, num_layers - 4)}))


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    if files:
        for f in files:
            tensors.update(load_file(str(f)))
    elif (path / "pytorch_model.bin").is_file():
        tensors = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise DraftCheckpointError(f"{path}: no *.safetensors or pytorch_model.bin in the draft folder")
    out = {}
    for k, v in tensors.items():
        k = k.removeprefix("model.")
        if k.startswith("midlayer."):
            k = _LAYER + k[len("midlayer."):]
        out[k] = v
    return out


def read_hf_draft(path: str | Path, target: dict) -> tuple[DraftConfig, dict[str, torch.Tensor]]:
    """Read a public EAGLE-3 checkpoint and check it fits ``target`` (the target's HF config dict).

    Raises :class:`DraftCheckpointError` naming the file and field on any mismatch.
    """
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise DraftCheckpointError(f"speculative.draft: {path} has no config.json "
                                   f"(expected an EAGLE-3 Hugging Face checkpoint folder)")
    try:
        hf = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise DraftCheckpointError(f"{cfg_file}: not valid JSON ({exc})") from exc
    tensors = _load_tensors(path)

    missing = [k for k in REQUIRED if k not in tensors]
    if missing:
        raise DraftCheckpointError(f"{path}: missing tensor {missing[0]!r}; an EAGLE-3 draft needs "
                                   f"{', '.join(REQUIRED)}")
    extra = [k for k in tensors if k not in REQUIRED + OPTIONAL and k not in ("t2d", "embed_tokens.weight")]
    if any(k.startswith("layers.1.") for k in extra):
        raise DraftCheckpointError(f"{path}: drafts with more than one decoder layer are not supported")

    hidden = int(tensors["fc.weight"].shape[0])
    t_hidden, t_vocab = int(target["hidden_size"]), int(target["vocab_size"])
    if hidden != t_hidden or int(hf.get("hidden_size", hidden)) != t_hidden:
        raise DraftCheckpointError(f"{cfg_file}: hidden_size {hf.get('hidden_size', hidden)} does not "
                                   f"match the target's hidden_size {t_hidden}")
    vocab = int(hf.get("vocab_size", t_vocab))
    if vocab != t_vocab:
        raise DraftCheckpointError(f"{cfg_file}: vocab_size {vocab} does not match the target's "
                                   f"vocab_size {t_vocab}")
    has_lm_head = "lm_head.weight" in tensors
    draft_vocab = int(tensors["lm_head.weight"].shape[0]) if has_lm_head else t_vocab
    if int(hf.get("draft_vocab_size") or draft_vocab) != draft_vocab:
        raise DraftCheckpointError(f"{cfg_file}: draft_vocab_size {hf['draft_vocab_size']} does not "
                                   f"match lm_head.weight rows {draft_vocab}")
    if draft_vocab > t_vocab:
        raise DraftCheckpointError(f"{cfg_file}: draft vocabulary {draft_vocab} is larger than the "
                                   f"target's vocab_size {t_vocab}")
    if draft_vocab < t_vocab:
        if "d2t" not in tensors:
            raise DraftCheckpointError(f"{path}: draft vocabulary {draft_vocab} < {t_vocab} but no "
                                       f"'d2t' tensor maps draft ids to target ids")
        d2t = tensors["d2t"].to(torch.int64)
        if d2t.shape != (draft_vocab,):
            raise DraftCheckpointError(f"{path}: d2t has shape {tuple(d2t.shape)}, expected ({draft_vocab},)")
        ids = torch.arange(draft_vocab) + d2t
        if int(ids.min()) < 0 or int(ids.max()) >= t_vocab:
            raise DraftCheckpointError(f"{path}: d2t maps draft ids outside the target vocabulary")
        tensors["d2t"] = d2t
    else:
        tensors.pop("d2t", None)

    eagle = hf.get("eagle_config") or {}
    aux = eagle.get("eagle_aux_hidden_state_layer_ids") or hf.get("eagle_aux_hidden_state_layer_ids")
    n_target_layers = int(target["num_hidden_layers"])
    aux = tuple(int(a) for a in aux) if aux else default_aux_layers(n_target_layers)
    if tensors["fc.weight"].shape[1] != len(aux) * t_hidden:
        raise DraftCheckpointError(f"{path}: fc.weight takes {tensors['fc.weight'].shape[1]} inputs, "
                                   f"expected {len(aux)} aux layers x hidden {t_hidden}")
    if any(not 0 <= a < n_target_layers for a in aux):
        raise DraftCheckpointError(f"{cfg_file}: aux layer ids {list(aux)} outside the target's "
                                   f"{n_target_layers} layers")

    heads = int(hf.get("num_attention_heads", 0))
    head_dim = int(hf.get("head_dim") or (hidden // heads if heads else 0))
    q_rows = int(tensors[_LAYER + "self_attn.q_proj.weight"].shape[0])
    kv_rows = int(tensors[_LAYER + "self_attn.k_proj.weight"].shape[0])
    if not heads or heads * head_dim != q_rows or kv_rows % head_dim:
        raise DraftCheckpointError(f"{cfg_file}: num_attention_heads {heads} x head_dim {head_dim} "
                                   f"does not match q_proj rows {q_rows}")
    rope_theta = hf.get("rope_theta") or (hf.get("rope_scaling") or {}).get("rope_theta") or 10000.0
    rope_scaling = hf.get("rope_scaling")
    if rope_scaling and (rope_scaling.get("rope_type") or rope_scaling.get("type")) in ("default", None):
        rope_scaling = None
    cfg = DraftConfig(
        hidden_size=hidden, num_heads=heads, num_kv_heads=kv_rows // head_dim, head_dim=head_dim,
        intermediate_size=int(tensors[_LAYER + "mlp.gate_proj.weight"].shape[0]),
        vocab_size=t_vocab, draft_vocab_size=draft_vocab,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)), rope_theta=float(rope_theta),
        aux_layers=aux, has_lm_head=has_lm_head,
        # ModelOpt's exports say so with eagle_config.use_input_layernorm_in_first_layer; the
        # EAGLE reference checkpoints carry no eagle_config and normalise the feature once.
        double_hidden_norm=bool(eagle.get("use_input_layernorm_in_first_layer", False)),
        rope_scaling=rope_scaling, dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"),
    )
    keep = {k: v.contiguous() for k, v in tensors.items() if k in REQUIRED + OPTIONAL}
    return cfg, keep


def write_bundle_draft(out_dir: str | Path, cfg: DraftConfig, tensors: dict[str, torch.Tensor]) -> None:
    """Write ``weights.safetensors`` + ``config.json`` (the bundle's ``draft/`` content)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "weights.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(cfg.to_json(), indent=2) + "\n")


def read_bundle_draft(draft_dir: str | Path) -> tuple[DraftConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    draft_dir = Path(draft_dir)
    cfg = DraftConfig.from_json(json.loads((draft_dir / "config.json").read_text()),
                                where=str(draft_dir / "config.json"))
    tensors = load_file(str(draft_dir / "weights.safetensors"))
    missing = [k for k in REQUIRED if k not in tensors]
    if missing:
        raise DraftCheckpointError(f"{draft_dir}/weights.safetensors: missing {missing[0]!r}; rebuild the engine")
    return cfg, tensors


__all__ = ["DraftCheckpointError", "DraftConfig", "default_aux_layers", "read_bundle_draft",
           "read_hf_draft", "write_bundle_draft"]
