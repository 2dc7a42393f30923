"""The typed build config (docs/contracts.md section 1).

``BuildConfig.from_yaml(path, overrides=["engine.max_batch_size=64"])`` returns frozen dataclasses,
validated at construction. Every mistake raises :class:`ConfigError` with one line
``<file>: <key.path>: <problem>; allowed: <...>``. Checks that need the model's shape (tp_size vs
heads, KV heads, intermediate size and vocab by the runtime's ``tp_rules``; max_seq_len vs context,
int4 group size vs in-features) live in ``builder/config_model.py`` (``check_against_model``), which the import stage calls
once the checkpoint's config is known.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import yaml

from backend.runtime.tp_rules import MAX_TP_SIZE, SHARDABLE_FORMATS
from backend.serving.engine_model.settings import DEFAULTS as SERVING_DEFAULTS, REASONING_PARSERS, TOOL_PARSERS
from builder.config_overrides import apply_overrides
from builder.config_tensorrt import RUNTIMES, TensorRTConfig, check_tensorrt
from builder.schema import ConfigError, build, opt

__all__ = ["BuildConfig", "ConfigError", "QUANT_FORMATS"]

QUANT_FORMATS = ("none", "fp8", "nvfp4", "int4_awq", "int8_sq", "w4a8_awq")
GROUPED_FORMATS = ("int4_awq", "w4a8_awq")  # formats whose group_size must divide in-features
KNOWN_SMS = (80, 86, 89, 90, 100, 103, 120)


def _power_of_two(v: int) -> str | None:
    return None if v > 0 and v & (v - 1) == 0 else f"{v} is not a power of two"


def _nonempty(v: str) -> str | None:
    return None if v.strip() else "must not be empty"


_PATH_SEGMENT = re.compile(r"[A-Za-z0-9_.-]+")
PATH_SEGMENT_ALLOWED = "one folder name of letters, digits, '_', '.', '-' (not '.' or '..')"


def _path_segment(v: str) -> str | None:
    """Values that become a file or folder name must stay one segment inside the output folder."""
    if not v.strip():
        return "must not be empty"
    if not _PATH_SEGMENT.fullmatch(v) or v in (".", ".."):
        return f"{v!r} is not a plain folder name (it becomes one under the output folder)"
    return None


def _sms(v: tuple[int, ...]) -> str | None:
    if not v:
        return "needs at least one target SM"
    bad = [s for s in v if s not in KNOWN_SMS]
    return f"unknown SM {bad[0]}" if bad else None


def _tree_paths(v: tuple[tuple[int, ...], ...]) -> str | None:
    if not v:
        return "needs at least one path"
    if any(not p or min(p) < 0 for p in v):
        return "every path must be a non-empty list of child indices >= 0"
    seen = set(v)
    for p in v:  # a static tree must be prefix-closed, or nodes would have no parent to attach to
        if len(p) > 1 and p[:-1] not in seen:
            return f"path {list(p)} has no parent path {list(p[:-1])}"
    return None


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    source: str = opt("smollm2", check=_nonempty,
                      allowed="smollm2 | path to a HF checkpoint folder | path to a .gguf file")
    architecture: str = opt("auto", choices=("auto", "llama", "mistral", "qwen2", "qwen3", "phi3"))
    dtype: str = opt("bfloat16", choices=("bfloat16", "float16", "float32"))
    max_position_embeddings: int | None = opt(None, min=1)


@dataclasses.dataclass(frozen=True)
class CalibrationConfig:
    dataset: str = opt("builtin", check=_nonempty, allowed="builtin | path to a JSONL file with a 'text' field")
    num_samples: int = opt(32, min=1, max=4096)
    max_seq_len: int = opt(256, min=8, max=32768)


@dataclasses.dataclass(frozen=True)
class QuantizationConfig:
    format: str = opt("fp8", choices=QUANT_FORMATS)
    kv_cache: str = opt("fp8", choices=("none", "fp8"))
    group_size: int = opt(64, choices=(16, 32, 64, 128, 256))
    exclude: tuple[str, ...] = opt(("lm_head",))
    calibration: CalibrationConfig = opt(CalibrationConfig())


@dataclasses.dataclass(frozen=True)
class DraftTrainConfig:
    steps: int = opt(200, min=1)
    learning_rate: float = opt(3.0e-4, min=0.0, max=1.0)
    seq_len: int = opt(128, min=8)
    dataset: str = opt("builtin", check=_nonempty, allowed="builtin | path to a JSONL file with a 'text' field")
    num_prompts: int = opt(512, min=1, max=100_000)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str = opt("none", choices=("none", "eagle3"))
    draft: str = opt("train", check=_nonempty, allowed="train | path to an EAGLE-3 HF checkpoint")
    max_draft_len: int = opt(4, min=1, max=16)
    tree: str = opt("chain", choices=("chain", "static", "dynamic"))
    tree_choices: tuple[tuple[int, ...], ...] | None = opt(None, check=_tree_paths,
                                                             allowed="null | list of paths, e.g. [[0],[1],[0,0]]")
    top_k: int = opt(4, min=1, max=64)
    depth: int = opt(4, min=1, max=16)
    aux_layers: tuple[int, ...] | None = opt(None, allowed="null | list of layer indices")
    min_draft_prob: float = opt(0.0, min=0.0, max=1.0)
    train: DraftTrainConfig = opt(DraftTrainConfig())


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = opt(64, min=1, max=4096)
    max_num_tokens: int = opt(2048, min=1)
    max_seq_len: int = opt(2048, min=2)
    max_input_len: int = opt(1536, min=1)
    kv_block_size: int = opt(16, min=1, max=1024, check=_power_of_two, allowed="a power of two, 1..1024")
    kv_cache_free_mem_fraction: float = opt(0.9, min=0.01, max=1.0)
    max_kv_tokens: int | None = opt(None, min=1)
    enable_prefix_caching: bool = opt(True)
    enable_chunked_prefill: bool = opt(True)
    scheduler_policy: str = opt("max_utilization", choices=("max_utilization", "guaranteed_no_evict"))
    # any size that divides the model's heads, KV heads, intermediate size and vocab (checked at import)
    tp_size: int = opt(1, min=1, max=MAX_TP_SIZE)
    target_sms: tuple[int, ...] = opt((90, 100), check=_sms, allowed=" | ".join(map(str, KNOWN_SMS)))
    attention_backend: str = opt("auto", choices=("auto", "torch", "triton"))
    # CUDA graphs for decode and EAGLE verify steps: auto = on a GPU with the triton backend
    cuda_graphs: str | bool = opt("auto", choices=("auto", True, False), allowed="auto | true | false")
    # the host schedules step n+1 while the device runs step n: auto = on a GPU unless speculative
    # decoding is on (its drafts need each step's tokens on the host); true on CPU = same loop, no gain
    overlap_scheduling: str | bool = opt("auto", choices=("auto", True, False), allowed="auto | true | false")
    # compute dtype on a CPU: auto = bf16 where the CPU has bf16 instructions and one decoder layer
    # measured faster in it at load, else fp32 (backend/runtime/cpu_dtype.py); ignored on a GPU
    cpu_dtype: str = opt("auto", choices=("auto", "float32", "bfloat16"))
    # what runs a step (backend/runtime/runtimes.py); the graph runtimes need tensorrt.enabled
    runtime: str = opt("native", choices=RUNTIMES)


@dataclasses.dataclass(frozen=True)
class VerifyConfig:
    enabled: bool = opt(True)
    num_prompts: int = opt(8, min=1, max=1024)
    min_top1_agreement: float | None = opt(None, min=0.0, max=1.0)
    max_mean_kl: float | None = opt(None, min=0.0)
    # whole: both models loaded (fast on a small model); streamed: one decoder layer at a time, memory
    # flat in depth; auto: streamed above builder/stages/verify.py's STREAM_ABOVE_BYTES
    path: str = opt("auto", choices=("auto", "whole", "streamed"))
    # where the streamed comparison runs: auto = the GPU when one is visible (both models in fp32, the
    # torch attention backend: the numbers of quantization, not of the serving kernels), else the CPU;
    # the whole-model path always runs on the CPU
    device: str = opt("auto", choices=("auto", "cpu", "cuda"))


def _model_name_moved(v: str) -> str | None:
    return (f"replaced by serving.model_names.ensemble (the ensemble's name; every model's name is "
            f"configurable now, defaulting to NVIDIA's tensorrtllm_backend names): write "
            f"'model_names: {{ensemble: {v}}}' under serving")


@dataclasses.dataclass(frozen=True)
class ModelNamesConfig:
    """Triton model names (folder names in model_repository/); defaults are NVIDIA's
    tensorrtllm_backend inflight_batcher_llm names, so its clients find the models they expect."""
    preprocessing: str = opt("preprocessing", check=_path_segment, allowed=PATH_SEGMENT_ALLOWED)
    engine: str = opt("tensorrt_llm", check=_path_segment, allowed=PATH_SEGMENT_ALLOWED)
    postprocessing: str = opt("postprocessing", check=_path_segment, allowed=PATH_SEGMENT_ALLOWED)
    ensemble: str = opt("ensemble", check=_path_segment, allowed=PATH_SEGMENT_ALLOWED)
    bls: str = opt("tensorrt_llm_bls", check=_path_segment, allowed=PATH_SEGMENT_ALLOWED)

    def as_dict(self) -> dict[str, str]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True)
class ServingConfig:
    model_names: ModelNamesConfig = opt(ModelNamesConfig())
    # removed key: refused with a message naming its replacement (null is accepted and ignored)
    model_name: str | None = opt(None, check=_model_name_moved, allowed="serving.model_names.ensemble")
    # NVIDIA's decoupled_mode: true streams (gRPC streams, HTTP generate_stream); false makes the
    # engine and bls models answer one response per request (HTTP /infer, one-shot gRPC ModelInfer)
    # and refuses streaming requests
    decoupled: bool = opt(True)
    # where the engine model's instances run (backend/serving/engine_model/placement.py): cuda = one Triton KIND_GPU
    # instance per engine instance, instance i on GPUs [i*tp_size, (i+1)*tp_size) (DP x TP on one
    # node); cpu = KIND_CPU; auto = KIND_CPU, the engine on the GPU when one is visible (the build
    # cannot know the serving host, and a KIND_GPU group fails to load on a host without GPUs)
    device: str = opt(SERVING_DEFAULTS.device, choices=("auto", "cpu", "cuda"))
    engine_instances: int = opt(1, min=1, max=64)
    preprocessing_instances: int = opt(1, min=1, max=64)
    postprocessing_instances: int = opt(1, min=1, max=64)
    stream_interval: int = opt(SERVING_DEFAULTS.stream_interval, min=1)
    # a step running longer than this is a hung device: its requests end with an error and the
    # engine's stub exits (harness.serve then stops the server); 0 turns the watchdog off
    step_timeout_s: float = opt(SERVING_DEFAULTS.step_timeout_s, min=0.0)
    # true: the engine model's responses are made and sent by a thread of their own
    # (backend/serving/engine_model/responder.py): each send is a round trip to the server process, which the
    # engine's loop would otherwise wait for between steps; false: the loop thread sends them
    response_thread: bool = opt(SERVING_DEFAULTS.response_thread)
    # true (with response_thread): a stream's tokens that come while its previous response still waits
    # for the responder join that response, so a responder that cannot keep up with the engine sends
    # fewer, larger responses instead of falling further behind; false: one response per
    # stream_interval tokens, however far behind
    coalesce_responses: bool = opt(SERVING_DEFAULTS.coalesce_responses)
    # the OpenAI front door's tool-call syntax and reasoning split for this model (docs/openai.md):
    # auto = by the markers the bundle's chat template spells; `harness.openai --tool-parser` beats it
    tool_parser: str = opt(SERVING_DEFAULTS.tool_parser, choices=TOOL_PARSERS)
    reasoning_parser: str = opt(SERVING_DEFAULTS.reasoning_parser, choices=REASONING_PARSERS)
    http_port: int = opt(8000, min=1, max=65535)
    grpc_port: int = opt(8001, min=1, max=65535)
    metrics_port: int = opt(8002, min=1, max=65535)


@dataclasses.dataclass(frozen=True)
class OutputConfig:
    dir: str | None = opt(None, allowed="null (build/<config file stem>) | a folder path")


# Sections that do not change what the engine computes; left out of the config hash.
_UNHASHED_SECTIONS = ("output",)
# Sections added after bundles were built, left out of every hash while disabled (builds without them
# stay byte-identical, their hashes and caches included).
_HASH_NEUTRAL_SECTIONS = {"tensorrt": ("enabled", False)}
# Keys added after bundles were built, left out of the hashes while they hold their default: every
# existing build (and test cache) keeps its hash, a non-default value still rebuilds what it changes.
_HASH_NEUTRAL_DEFAULTS = {("engine", "overlap_scheduling"): "auto", ("engine", "cpu_dtype"): "auto",
                          ("verify", "path"): "auto", ("verify", "device"): "auto", ("serving", "device"): "auto",
                          ("serving", "coalesce_responses"): True,
                          ("serving", "tool_parser"): "auto", ("serving", "reasoning_parser"): "auto",
                          ("engine", "runtime"): "native"}


@dataclasses.dataclass(frozen=True)
class BuildConfig:
    model: ModelConfig = opt(ModelConfig())
    quantization: QuantizationConfig = opt(QuantizationConfig())
    speculative: SpeculativeConfig = opt(SpeculativeConfig())
    engine: EngineConfig = opt(EngineConfig())
    verify: VerifyConfig = opt(VerifyConfig())
    serving: ServingConfig = opt(ServingConfig())
    tensorrt: TensorRTConfig = opt(TensorRTConfig())
    output: OutputConfig = opt(OutputConfig())
    # Where the config came from: "<file>" in errors, stem for the default output folder.
    file: str = dataclasses.field(default="<config>", compare=False, metadata={"internal": True})

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_yaml(cls, path: str | Path, overrides: tuple[str, ...] | list[str] = ()) -> "BuildConfig":
        path = Path(path)
        file = str(path)
        if not path.is_file():
            what = "is a folder, not a config file" if path.is_dir() else "config file not found"
            raise ConfigError(file, "", what, "a YAML file, e.g. configs/smollm2-135m-fp8.yaml")
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ConfigError(file, "", f"invalid YAML: {where}{problem}") from None
        except UnicodeDecodeError:
            raise ConfigError(file, "", "invalid YAML: not UTF-8 text") from None
        if data is None:
            data = {}
        return cls.from_dict(data, file=file, overrides=overrides)

    @classmethod
    def from_dict(cls, data: dict, file: str = "<config>",
                  overrides: tuple[str, ...] | list[str] = ()) -> "BuildConfig":
        if not isinstance(data, dict):
            raise ConfigError(file, "", f"the top level must be a mapping of sections, got {type(data).__name__}",
                              ", ".join(_section_names()))
        data = apply_overrides(cls, data, overrides, file)
        cfg = build(cls, data, file)
        cfg = dataclasses.replace(cfg, file=file)
        cfg._check_combinations()
        check_tensorrt(cfg)
        return cfg

    def _check_combinations(self) -> None:
        e, s, f = self.engine, self.speculative, self.file
        if e.max_input_len >= e.max_seq_len:
            raise ConfigError(f, "engine.max_input_len", f"{e.max_input_len} must be below engine.max_seq_len "
                              f"({e.max_seq_len}) to leave room for output", f"1..{e.max_seq_len - 1}")
        if not e.enable_chunked_prefill and e.max_num_tokens < e.max_input_len:
            raise ConfigError(f, "engine.max_num_tokens", f"{e.max_num_tokens} cannot hold a whole prompt of "
                              f"engine.max_input_len={e.max_input_len} without chunked prefill",
                              f">= {e.max_input_len}, or engine.enable_chunked_prefill=true")
        if e.max_num_tokens < e.max_batch_size:
            raise ConfigError(f, "engine.max_num_tokens", f"{e.max_num_tokens} is below engine.max_batch_size "
                              f"({e.max_batch_size}): a full batch could not decode one token each",
                              f">= {e.max_batch_size}")
        if e.max_kv_tokens is not None and e.max_kv_tokens < e.max_seq_len:
            raise ConfigError(f, "engine.max_kv_tokens", f"{e.max_kv_tokens} cannot hold one sequence of "
                              f"engine.max_seq_len={e.max_seq_len}", f"null or >= {e.max_seq_len}")
        mpe = self.model.max_position_embeddings
        if mpe is not None and e.max_seq_len > mpe:
            raise ConfigError(f, "engine.max_seq_len", f"{e.max_seq_len} exceeds the model's context "
                              f"(model.max_position_embeddings={mpe})", f"2..{mpe}")
        if e.overlap_scheduling is True and s.method != "none":
            raise ConfigError(f, "engine.overlap_scheduling", f"true cannot run with speculative.method={s.method} "
                              "(the next drafts need each step's tokens on the host)", "auto | false")
        if e.tp_size > 1 and self.quantization.format not in SHARDABLE_FORMATS:   # every format today: a guard
            raise ConfigError(f, "engine.tp_size", f"{e.tp_size} cannot shard quantization.format="
                              f"{self.quantization.format} (tp_shard has no split rule for its tensors)",
                              f"1, or quantization.format {' | '.join(SHARDABLE_FORMATS)}")
        if e.tp_size > 1 and s.method != "none":
            raise ConfigError(f, "engine.tp_size", f"{e.tp_size} cannot run with speculative.method={s.method} "
                              "(the tensor-parallel runtime has no speculative decoding yet)",
                              "1, or speculative.method=none")
        if s.tree == "static" and s.tree_choices is None:
            raise ConfigError(f, "speculative.tree_choices", "required when speculative.tree=static",
                              "list of paths, e.g. [[0],[1],[0,0]]")
        if s.tree != "static" and s.tree_choices is not None:
            raise ConfigError(f, "speculative.tree_choices", f"only used with speculative.tree=static "
                              f"(tree is {s.tree})", "null")
        if s.tree != "chain" and s.min_draft_prob > 0:
            raise ConfigError(f, "speculative.min_draft_prob", f"only used with speculative.tree=chain "
                              f"(tree is {s.tree}; the dynamic tree already ranks by draft probability)", "0")
        names = self.serving.model_names.as_dict()
        if len(set(names.values())) != len(names):
            raise ConfigError(f, "serving.model_names", f"model names must differ, got {names}",
                              "five distinct names")
        ports = {"http_port": self.serving.http_port, "grpc_port": self.serving.grpc_port,
                 "metrics_port": self.serving.metrics_port}
        if len(set(ports.values())) != len(ports):
            raise ConfigError(f, "serving", f"ports must differ, got {ports}", "three distinct ports")

    # ---- hashing and export -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The normalized config as plain JSON-able data (tuples become lists)."""
        d = dataclasses.asdict(self)
        d.pop("file")
        return json.loads(json.dumps(d))

    def section_hash(self, section: str) -> str | None:
        """sha256 of one section's normalized JSON: stable across runs, key order and YAML layout.
        ``section`` may be a dotted path to one key of a section (``speculative.train``); None for a
        disabled hash-neutral section (``tensorrt`` while off)."""
        d: Any = self._hashable()
        if section in _HASH_NEUTRAL_SECTIONS and section not in d:
            return None   # a disabled section shapes nothing (callers leave it out of their hashes)
        for part in section.split("."):
            if not isinstance(d, dict) or part not in d:
                raise KeyError(f"unknown config section {section!r}; sections: {', '.join(self.to_dict())}")
            d = d[part]
        return _sha256_json(d)

    def config_hash(self) -> str:
        """sha256 of every section that changes the engine (output location excluded)."""
        d = {k: v for k, v in self._hashable().items() if k not in _UNHASHED_SECTIONS}
        return _sha256_json(d)

    def _hashable(self) -> dict[str, Any]:
        d = self.to_dict()
        for (section, key), default in _HASH_NEUTRAL_DEFAULTS.items():
            if d[section][key] == default:
                del d[section][key]
        for section, (key, off) in _HASH_NEUTRAL_SECTIONS.items():
            if d[section][key] == off:
                del d[section]
        return d

    @property
    def stem(self) -> str:
        return Path(self.file).stem if self.file != "<config>" else "engine"

    def output_dir(self, override: str | Path | None = None) -> Path:
        """--output beats output.dir, which beats build/<config file stem>."""
        if override is not None:
            return Path(override)
        if self.output.dir is not None:
            return Path(self.output.dir)
        return Path("build") / self.stem


def _sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _section_names() -> list[str]:
    return [f.name for f in dataclasses.fields(BuildConfig) if f.name != "file"]
