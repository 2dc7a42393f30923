"""Architecture-spec parts of the decoder layer that not every family has, beside the Llama layer of
``backend/model/llama.py``: what the bundle's ``model.arch`` (backend/arch_spec.py) asks of the runtime,
checked once at load, and the per-head q/k RMSNorm (Qwen3) applied before rope.

Kept apart from llama.py so the layer code there calls these in a few lines: a spec field this runtime
does not compute yet is refused at load in one line instead of being run as the Llama layer.
"""
from __future__ import annotations

import torch

from backend.arch_spec import ArchSpec

# spec fields -> the only value this runtime computes today (the Llama layer's). ``qkv`` and ``gate_up`` say how
# the checkpoint stores them: the bundle always holds them fused (builder/weights.py), so both layouts run
LLAMA_LAYER = {"norm": "rms", "norm_placement": "pre", "activation": "silu", "mlp": "gated",
               "embedding_scale": "none", "query_pre_attn_scalar": None}
# the fields whose every value the torch path's spec layer computes (backend/model/spec_layer.py)
SPEC_LAYER = ("norm", "norm_placement", "activation", "embedding_scale", "query_pre_attn_scalar")
QK_NORMS = ("q_norm", "k_norm")


def check_spec(spec: ArchSpec | None) -> None:
    """Refuse, in one line naming the field, a spec the layer code would not compute as written. Both
    layer paths compute the spec-layer fields (the torch path in backend/model/spec_layer.py, the fused
    Triton one in llama.py's ``_forward_fused``), q/k norms and windows."""
    if spec is None:        # a bundle from before the spec: the Llama layer by construction
        return
    for name, value in LLAMA_LAYER.items():
        got = getattr(spec, name)
        if got == value or name in SPEC_LAYER:
            continue
        raise ValueError(f"engine.json: model.arch.{name}: {got!r} is not run by this runtime yet; allowed: {value!r}")
    if spec.experts is not None and spec.activation != "silu":   # backend/model/moe.py's experts are SwiGLU
        raise ValueError(f"engine.json: model.arch.activation: {spec.activation!r} in expert layers is not run by "
                         f"this runtime yet; allowed: 'silu'")


def rope_args(config, spec: ArchSpec | None) -> tuple[float, dict | None]:
    """``(theta, scaling)`` for ``layers.RotaryEmbedding``: the spec's rope (every variant resolved by the
    builder), else, for a bundle from before the spec, the model section's ``rope_theta`` / ``rope_scaling``.
    One rope for every layer (the fused path, the layer probe, the layerwise runner, the ONNX export);
    ``spec_layer.rope_tables`` gives one per attention kind."""
    if spec is None:
        return config.rope_theta, config.rope_scaling
    ropes = list(dict.fromkeys(a.rope for a in spec.attention))
    if len(ropes) > 1:
        raise ValueError("engine.json: model.arch.attention: its kinds rotate with different ropes, which this "
                         "path does not run yet; allowed: one rope for every layer")
    return rope_of(ropes[0], f"model.arch.attention.{spec.attention[0].kind}.rope")


def rope_of(rope, where: str) -> tuple[float, dict | None]:
    """One spec ``Rope`` as ``RotaryEmbedding``'s ``(theta, scaling)``; what it cannot rotate is refused
    in one line naming the spec field (``where``)."""
    if rope.partial_rotary_factor != 1.0:
        raise ValueError(f"engine.json: {where}.partial_rotary_factor: {rope.partial_rotary_factor} is not run "
                         f"by this runtime yet; allowed: 1.0")
    scaling = {k: v for k, v in rope.to_dict().items() if k not in ("theta", "partial_rotary_factor")}
    return rope.theta, None if rope.type == "default" else scaling


def layer_qk_norms(weights: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype,
                   device: torch.device) -> dict[str, torch.Tensor | None]:
    """``{"q_norm": w [D], "k_norm": w [D]}`` of the layer at ``prefix`` (``layers.3``), both None when the
    bundle has neither; one without the other is a broken bundle."""
    names = [f"{prefix}.{n}.weight" for n in QK_NORMS]
    have = [n in weights for n in names]
    if any(have) and not all(have):
        missing = names[have.index(False)]
        raise KeyError(f"weights.safetensors: missing tensor {missing!r} (its q/k norm pair is present)")
    return {n: weights[w].to(device=device, dtype=dtype) if all(have) else None for n, w in zip(QK_NORMS, names)}


def check_qk_norms(spec: ArchSpec | None, layers) -> None:
    """The bundle's q/k norm tensors agree with ``model.arch.qk_norm``: neither run without the other."""
    want = bool(spec is not None and spec.qk_norm)
    for i, layer in enumerate(layers):
        if (layer.q_norm is not None) != want:
            problem = "missing" if want else "present, but model.arch.qk_norm is not true"
            raise KeyError(f"weights.safetensors: tensor 'layers.{i}.q_norm.weight' {problem}; "
                           f"rebuild the bundle")


def qk_norm(qk: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, num_heads: int,
            eps: float) -> torch.Tensor:
    """RMSNorm over head_dim of each head of ``qk [T, Hq + Hkv, D]`` (queries first), with ``q_weight [D]``
    on the query heads and ``k_weight [D]`` on the key heads, as transformers' Qwen3 does: in fp32,
    cast back to the input dtype before the weight multiply."""
    xf = qk.float()
    xf = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(qk.dtype)
    return torch.cat([q_weight * xf[:, :num_heads], k_weight * xf[:, num_heads:]], dim=1)
