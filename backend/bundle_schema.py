"""The engine bundle format's typed manifest (docs/contracts.md section 3): the frozen dataclasses
``engine.json`` is checked into (``Manifest`` and its sections, ``ModelConfig`` among them: the model
every runtime builds), the format's constants and its own rules (version, weight files, key order),
and ``as_dict`` to turn a section back into JSON.

Split from ``backend/bundle.py``, which stays the public module and re-exports everything here: this
module is the schema (what a manifest is, no files touched), bundle.py the bundle on disk (read,
verify, write, rewrite, ``Bundle``). Standard library only, like bundle.py (it runs inside Triton's
Python backend).
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from backend.arch_spec import ArchSpec, ArchSpecError
from backend.bundle_fields import FieldError as _FieldError, SectionError, from_dict as _from_dict
from backend.bundle_fields import parse as _parse

FORMAT = "kiln-engine"
# 2: a tensor-parallel bundle's weights in one file per rank (``weights``: rank<i>.safetensors).
# A bundle with one weights file is still written as 1, so runtimes that read only 1 keep loading it.
FORMAT_VERSION = 2                  # the newest write() produces (version_for: what one bundle needs)
SUPPORTED_VERSIONS = (1, 2)         # what read() accepts
MANIFEST = "engine.json"
WEIGHTS = "weights.safetensors"
# The model section's keys in the order the builder writes them (ModelConfig's fields, reordered).
MODEL_KEYS = ("architecture", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
              "head_dim", "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings",
              "tie_word_embeddings", "attention_bias", "mlp_bias", "sliding_window", "bos_token_id",
              "eos_token_ids", "pad_token_id", "dtype")
OMIT = {"omit_default": True}       # field metadata: not written while it holds its default
REQUIRED = {"required": True}       # field metadata: must be in engine.json although code has a default


def rank_weights(tp_size: int) -> tuple[str, ...]:
    """The weight files of a bundle built for ``tp_size`` ranks: ``weights.safetensors`` for one, else
    ``rank<i>.safetensors`` per rank (rank i's tensors only, named as the unsharded bundle's)."""
    return (WEIGHTS,) if tp_size == 1 else tuple(f"rank{r}.safetensors" for r in range(tp_size))


def version_for(weights: tuple[str, ...]) -> int:
    """The oldest format_version that describes a bundle with these weight files."""
    return 1 if tuple(weights) == (WEIGHTS,) else 2


class BundleError(RuntimeError):
    """The bundle cannot be used as it is; the message says what to rebuild."""


# -- the model section ----------------------------------------------------------------------------
MODEL_DTYPES = ("bfloat16", "float16", "float32")
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3", "mixtral", "qwen3_moe", "qwen2_moe")


class ModelConfigError(SectionError):
    """A bundle's model section is missing a key or has an unsupported value."""


@dataclass(frozen=True)
class ModelConfig:
    """Typed model configuration read from ``engine.json["model"]`` (docs/contracts.md section 3)."""
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
    sliding_window: int | None = None   # the sliding layers' window (model.arch has it per layer kind)

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ModelConfigError(f"engine.json: model.architecture: {self.architecture!r} is not "
                                   f"supported; allowed: {', '.join(ARCHITECTURES)}")
        if self.dtype not in MODEL_DTYPES:
            raise ModelConfigError(f"engine.json: model.dtype: {self.dtype!r}; allowed: {', '.join(MODEL_DTYPES)}")
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "vocab_size", "max_position_embeddings"):
            if int(getattr(self, name)) <= 0:
                raise ModelConfigError(f"engine.json: model.{name}: must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(f"engine.json: model.num_heads ({self.num_heads}) must be a multiple "
                                   f"of model.num_kv_heads ({self.num_kv_heads})")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
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

    @property
    def arch_spec(self) -> "ArchSpec | None":
        """The architecture spec (``ModelSection`` reads it from engine.json's ``model.arch``); a bare
        ModelConfig has none, and the runtime then runs the Llama layer its fields describe."""
        return None


@dataclass(frozen=True)
class ModelSection(ModelConfig):
    """engine.json's ``model``: the runtime's ModelConfig plus ``arch``, the architecture spec's JSON
    (``ArchSpec.to_dict``), checked when read; absent in bundles built before the spec existed."""
    arch: dict | None = field(default=None, metadata=OMIT)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.arch is not None:
            try:
                ArchSpec.from_dict(self.arch)
            except ArchSpecError as exc:
                raise ModelConfigError(f"engine.json: model.{exc}") from None

    @property
    def arch_spec(self) -> ArchSpec | None:
        return None if self.arch is None else ArchSpec.from_dict(self.arch)


@dataclass(frozen=True)
class Quantization:
    format: str
    kv_cache: str = "none"
    group_size: int | None = None
    exclude: tuple[str, ...] = ()
    unquantized_modules: tuple[str, ...] = ()
    source: str | None = None


def default_kv_cache_dtype(kv_cache: str, model_dtype: str) -> str:
    """engine.kv_cache_dtype for quantization.kv_cache: fp8 -> fp8_e4m3, none -> the model dtype."""
    return "fp8_e4m3" if kv_cache == "fp8" else model_dtype


@dataclass(frozen=True)
class EngineSettings:
    """The ``engine`` section; these defaults are the runtime's, stated nowhere else."""
    max_batch_size: int = 64
    max_num_tokens: int = 2048
    max_seq_len: int | None = None          # None: the model's max_position_embeddings
    max_input_len: int | None = None        # None: max_seq_len - 1
    kv_block_size: int = 16
    kv_cache_dtype: str | None = None       # None: default_kv_cache_dtype(quantization.kv_cache, model.dtype)
    kv_cache_free_mem_fraction: float = 0.9
    max_kv_tokens: int | None = None        # None: as many as kv_cache_free_mem_fraction allows
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduler_policy: str = "max_utilization"
    tp_size: int = 1
    # KV heads each rank holds, written only where tp_size exceeds model.num_kv_heads (each rank then
    # holds the one its query heads read, replicated: backend/runtime/tp_rules.py), so a runtime that
    # cannot replicate KV heads refuses the bundle by this field's name rather than mis-splitting it
    kv_heads_per_rank: int | None = field(default=None, metadata=OMIT)
    attention_backend: str = "auto"
    # engine.cuda_graphs of the config; not written while "auto", so older bundles read the same
    cuda_graphs: str | bool = field(default="auto", metadata=OMIT)
    # engine.overlap_scheduling of the config (auto = on for CUDA without speculation); omitted while auto
    overlap_scheduling: str | bool = field(default="auto", metadata=OMIT)
    # engine.cpu_dtype of the config (backend/runtime/cpu_dtype.py: auto = measured at load); omitted while auto
    cpu_dtype: str = field(default="auto", metadata=OMIT)
    # what runs a step (backend/runtime/runtimes.py): native | onnx-reference | tensorrt; omitted while native
    runtime: str = field(default="native", metadata=OMIT)

    def resolved(self, model: ModelConfig, quantization: Quantization) -> "EngineSettings":
        """These settings with every model-dependent default (None) filled in."""
        seq = self.max_seq_len if self.max_seq_len is not None else model.max_position_embeddings
        return dataclasses.replace(
            self, max_seq_len=seq, max_input_len=self.max_input_len if self.max_input_len is not None else seq - 1,
            kv_cache_dtype=self.kv_cache_dtype or default_kv_cache_dtype(quantization.kv_cache, model.dtype))

    def override(self, **changes: Any) -> "EngineSettings":
        """These settings with run-time overrides (``Executor(..., max_kv_tokens=4096)``), type-checked."""
        hints = typing.get_type_hints(EngineSettings)
        for key, value in changes.items():
            if key not in hints:
                raise BundleError(f"engine override {key!r}: unknown key; allowed: {', '.join(sorted(hints))}")
            try:
                _parse(value, hints[key], f"engine override {key!r}")
            except _FieldError as exc:
                raise BundleError(str(exc)) from None
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Targets:
    sms: tuple[int, ...] = ()


@dataclass(frozen=True)
class Kernel:
    """One AOT kernel; paths are relative to the bundle, ``sha256`` has cubin, ptx and meta."""
    name: str
    key: str
    sm: int
    cubin: str
    ptx: str
    meta: str
    sha256: dict[str, str]


@dataclass(frozen=True)
class Speculative:
    """The EAGLE-3 draft's runtime settings (its own shape is in draft/config.json)."""
    method: str
    draft_dir: str = "draft"
    max_draft_len: int = 4
    tree: str = "chain"
    tree_choices: list | None = None
    top_k: int = 4
    depth: int = 4
    min_draft_prob: float = 0.0
    aux_layers: tuple[int, ...] | None = field(default=None, metadata=OMIT)
    draft_vocab_size: int | None = field(default=None, metadata=OMIT)
    draft_source: str | None = field(default=None, metadata=OMIT)
    train: dict | None = field(default=None, metadata=OMIT)


@dataclass(frozen=True)
class TensorRT:
    """The TensorRT target (``tensorrt.enabled``): the decoder's ONNX graph beside the weights it points
    into (``graph``, relative to the bundle: onnx refuses external data outside a model's folder), the
    plugin PTX and the optimization profiles under ``dir``; ``plan`` and ``version`` stay null until
    ``python -m builder.tensorrt_build`` has run on a host with TensorRT."""
    graph: str = "decoder.onnx"
    dir: str = "tensorrt"
    opset: int = 21
    plugins: tuple[str, ...] = ()        # plugin names the graph's custom nodes use (op types)
    sms: tuple[int, ...] = ()
    workspace_gib: float = 8.0           # the plan build's defaults (tensorrt.* of the build config)
    timing_cache: str | None = None
    plan: str | None = None
    version: str | None = None
    # the EAGLE-3 draft's graph beside ``graph`` (builder/tensorrt/draft_export.py); absent without a draft
    draft_graph: str | None = field(default=None, metadata=OMIT)


@dataclass(frozen=True)
class Verify:
    """The verify stage's figures (null until it ran); ``speculative``: the draft's, when there is one."""
    top1_agreement: float
    mean_kl: float
    num_prompts: int
    num_positions: int
    format: str
    kv_cache_dtype: str
    min_top1_agreement: float
    max_mean_kl: float
    passed: bool
    speculative: dict | None = field(default=None, metadata=OMIT)


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """The whole engine.json. Field order is the file's key order."""
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    created: str | None = None
    kiln_version: str | None = None
    config_file: str | None = None
    model: ModelSection
    quantization: Quantization
    engine: EngineSettings = field(default_factory=EngineSettings, metadata=REQUIRED)
    targets: Targets = field(default_factory=Targets)
    kernels: tuple[Kernel, ...] = ()
    speculative: Speculative | None = None
    tensorrt: TensorRT | None = field(default=None, metadata=OMIT)
    tools: dict[str, str | None] = field(default_factory=dict)
    hashes: dict[str, str | None] = field(default_factory=dict)
    verify: Verify | None = None
    # the weight files, one per rank (rank_weights(engine.tp_size)); omitted for the single file
    weights: tuple[str, ...] = field(default=(WEIGHTS,), metadata=OMIT)
    files: dict[str, str] = field(default_factory=dict, metadata=REQUIRED)

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine", self.engine.resolved(self.model, self.quantization))

    @classmethod
    def from_dict(cls, doc: Any, source: str = MANIFEST) -> "Manifest":
        """Check a parsed engine.json (format, version, fields, types); ``source`` names it in errors."""
        hint = rebuild_hint(doc if isinstance(doc, dict) else None)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise BundleError(f"{source}: format {got!r} is not {FORMAT!r}; {hint}")
        version = doc.get("format_version")
        if version not in SUPPORTED_VERSIONS or isinstance(version, bool):
            raise BundleError(f"{source}: format_version {version!r} is not supported by this runtime "
                              f"(supported: {', '.join(map(str, SUPPORTED_VERSIONS))}); {hint}")
        try:
            manifest = _from_dict(cls, doc, "")
            _check_weights(manifest)
            return manifest
        except _FieldError as exc:
            raise BundleError(f"{source}: {_problem(exc)}; {hint}") from None

    def replace(self, source: str = MANIFEST, **changes: Any) -> "Manifest":
        """A copy with sections replaced; plain dicts/lists are checked and converted like engine.json."""
        hints = typing.get_type_hints(Manifest)
        try:
            unknown = sorted(set(changes) - set(hints))
            if unknown:
                raise _FieldError(f"{unknown[0]}: unknown field", unknown=True)
            return dataclasses.replace(self, **{k: _parse(as_dict(v), hints[k], k) for k, v in changes.items()})
        except _FieldError as exc:
            raise BundleError(f"{source}: {_problem(exc)}; {rebuild_hint(self)}") from None


def _problem(exc: _FieldError) -> str:
    """The field's problem; an unknown field is one this runtime's newest format does not have."""
    return f"{exc} (format_version {FORMAT_VERSION} has no such field)" if exc.unknown else str(exc)


def _check_weights(m: Manifest) -> None:
    """The weight files are the single file or one per rank of engine.tp_size, in a version that has them.
    (engine.tp_size as written: a run-time override of it is the runtime's to check.)"""
    n = len(m.weights)
    if m.weights != rank_weights(n) or n == 0:
        raise _FieldError(f"weights: {list(m.weights)}; expected [{WEIGHTS!r}] or rank0.safetensors .. "
                          f"rank<tp_size-1>.safetensors")
    if n > 1 and m.engine.tp_size != n:
        raise _FieldError(f"weights: {n} rank files but engine.tp_size is {m.engine.tp_size}")
    if m.format_version < version_for(m.weights):
        raise _FieldError(f"weights: per-rank files need format_version {version_for(m.weights)}, "
                          f"got {m.format_version}")


# ---- converting back ------------------------------------------------------------------------

def as_dict(obj: Any) -> Any:
    """A section (or the whole Manifest) as the JSON engine.json holds, keys in the file's order."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = [f.name for f in dataclasses.fields(obj)]
        if isinstance(obj, ModelConfig):   # the builder's key order; arch (ModelSection only) last
            names = [*MODEL_KEYS, *(n for n in names if n not in MODEL_KEYS)]
        omit = {f.name: f.default for f in dataclasses.fields(obj) if f.metadata.get("omit_default")}
        return {n: as_dict(getattr(obj, n)) for n in names if not (n in omit and getattr(obj, n) == omit[n])}
    if isinstance(obj, (list, tuple)):
        return [as_dict(x) for x in obj]
    if isinstance(obj, dict):
        return {k: as_dict(x) for k, x in obj.items()}
    return obj


def rebuild_hint(manifest: Manifest | dict | None) -> str:
    cfg = manifest.get("config_file") if isinstance(manifest, dict) else getattr(manifest, "config_file", None)
    target = f"CONFIG={cfg}" if cfg and not str(cfg).startswith("<") else "CONFIG=<its config>"
    return f"rebuild with: make build {target} BUILD_ARGS=--force"
