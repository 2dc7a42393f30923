"""What the mixture-of-experts families share: the config.json fields that only shape training, the Qwen
rule for which layers are sparse, and the reader that turns a family's expert fields into the spec's
``Experts``."""
from __future__ import annotations

from typing import Mapping

from backend.arch_spec import ArchSpecError, Experts
from builder.families.base import HfConfig, num_layers

# Read by transformers only while training: the auxiliary load-balancing loss (its coefficient, and whether
# forward returns the router logits it is computed from) and the router's multiplicative jitter, applied
# only in training mode. None changes a token an engine computes.
TRAINING_ONLY = frozenset({"output_router_logits", "router_aux_loss_coef", "router_jitter_noise"})


def qwen_sparse_layers(cfg: HfConfig) -> list[int]:
    """Qwen2-MoE's and Qwen3-MoE's rule: layer i has experts unless it is in ``mlp_only_layers``, when
    ``(i + 1) % decoder_sparse_step == 0``."""
    n, step = num_layers(cfg), cfg.positive_int("decoder_sparse_step", 1)
    dense = cfg.get("mlp_only_layers", [])
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n
                                              for i in dense):
        raise cfg.refuse("mlp_only_layers", f"{dense!r:.60} is not a list of layer indices", f"indices in 0..{n - 1}")
    return [i for i in range(n) if i not in dense and (i + 1) % step == 0]


def experts(cfg: HfConfig, num_experts_field: str, intermediate_field: str, layers: list[int],
            renormalize: bool, defaults: Mapping[str, int], shared_field: str | None = None,
            shared_gate: bool = False) -> Experts:
    """The spec's ``Experts`` of this config; a value the spec refuses names the config.json field.
    ``defaults``: the config class's values of the fields read here, for a file that leaves one out;
    ``shared_field``: the field of the shared expert's width (the family has one)."""
    n = cfg.positive_int(num_experts_field, defaults.get(num_experts_field))
    if n is None:
        raise cfg.refuse(num_experts_field, "missing", "a positive integer")
    k = cfg.positive_int("num_experts_per_tok", defaults["num_experts_per_tok"])
    if k > n:
        raise cfg.refuse("num_experts_per_tok", f"{k} exceeds {num_experts_field} = {n}", f"1..{n}")
    width = cfg.positive_int(intermediate_field, defaults.get(intermediate_field))
    if width is None:
        raise cfg.refuse(intermediate_field, "missing", "a positive integer")
    if not layers:
        raise cfg.refuse(num_experts_field, "no layer has experts under this config", "a config with expert layers")
    shared = None
    if shared_field is not None:
        shared = cfg.positive_int(shared_field, defaults.get(shared_field))
        if shared is None:
            raise cfg.refuse(shared_field, "missing", "a positive integer")
    try:
        return Experts(num_experts=n, top_k=k, intermediate_size=width, layers=tuple(layers),
                       renormalize=renormalize, shared_intermediate_size=shared, shared_gate=shared_gate)
    except ArchSpecError as exc:   # (the readers above check what the spec would)
        raise cfg.refuse(exc.path, exc.problem, exc.allowed or "") from None
