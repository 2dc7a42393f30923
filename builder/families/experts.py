"""What the mixture-of-experts families share: the config.json fields that only shape training, and the
reader that turns a family's expert fields into the spec's ``Experts``."""
from __future__ import annotations

from backend.arch_spec import ArchSpecError, Experts
from builder.families.base import HfConfig

# Read by transformers only while training: the auxiliary load-balancing loss (its coefficient, and whether
# forward returns the router logits it is computed from) and the router's multiplicative jitter, applied
# only in training mode. None changes a token an engine computes.
TRAINING_ONLY = frozenset({"output_router_logits", "router_aux_loss_coef", "router_jitter_noise"})


def experts(cfg: HfConfig, num_experts_field: str, intermediate_field: str, layers: list[int],
            renormalize: bool, default_experts: int | None = None) -> Experts:
    """The spec's ``Experts`` of this config; a value the spec refuses names the config.json field."""
    n = cfg.positive_int(num_experts_field, default_experts)
    if n is None:
        raise cfg.refuse(num_experts_field, "missing", "a positive integer")
    k = cfg.positive_int("num_experts_per_tok", 2)
    if k > n:
        raise cfg.refuse("num_experts_per_tok", f"{k} exceeds {num_experts_field} = {n}", f"1..{n}")
    width = cfg.positive_int(intermediate_field)
    if width is None:
        raise cfg.refuse(intermediate_field, "missing", "a positive integer")
    if not layers:
        raise cfg.refuse(num_experts_field, "no layer has experts under this config", "a config with expert layers")
    try:
        return Experts(num_experts=n, top_k=k, intermediate_size=width, layers=tuple(layers),
                       renormalize=renormalize)
    except ArchSpecError as exc:   # (the readers above check what the spec would)
        raise cfg.refuse(exc.path, exc.problem, exc.allowed or "") from None
