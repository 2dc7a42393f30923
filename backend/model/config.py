"""Typed model configuration read from ``engine.json["model"]`` (docs/contracts.md section 3)."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

DTYPES = ("bfloat16", "float16", "float32")
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3")


class ModelConfigError(ValueError):
    """A bundle's model section is missing a key or has an unsupported value."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    dtype: str = "bfloat16"
    sliding_window: int | None = None   # Mistral; attention is full-context, see ModelRunner

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ModelConfigError(f"engine.json: model.architecture: {self.architecture!r} is not "
                                   f"supported; allowed: {', '.join(ARCHITECTURES)}")
        if self.dtype not in DTYPES:
            raise ModelConfigError(f"engine.json: model.dtype: {self.dtype!r}; allowed: {', '.join(DTYPES)}")
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "vocab_size", "max_position_embeddings"):
            if int(getattr(self, name)) <= 0:
                raise ModelConfigError(f"engine.json: model.{name}: must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(f"engine.json: model.num_heads ({self.num_heads}) must be a multiple "
                                   f"of model.num_kv_heads ({self.num_kv_heads})")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known}
        # Lists from JSON become tuples so the config stays hashable and frozen.
        kwargs["eos_token_ids"] = tuple(kwargs.get("eos_token_ids") or ())
        try:
            return cls(**kwargs)
        except TypeError as exc:  # a missing required key
            raise ModelConfigError(f"engine.json: model: {exc}") from exc

    @property
    def torch_dtype(self):
        import torch
        return getattr(torch, self.dtype)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim
