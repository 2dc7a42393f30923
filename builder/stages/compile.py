"""Compile stage: checkpoint -> engine bundle (docs/contracts.md section 3).

Writes ``weights.safetensors`` in the runtime layout (``builder/weights.py``) or, with
``engine.tp_size`` > 1, ``rank<i>.safetensors`` per rank INSTEAD (rank i's share as
``backend.runtime.tp_shard`` splits it, names unchanged: a rank reads only its file), ``tokenizer/``,
``draft/`` (from the draft stage), ``kernels/`` (``plugins.aot.compile_for_bundle``) and finally
``engine.json`` with the sha256 of every other file, written through ``backend.bundle`` (the format's
owner: typed manifest, format version, ``write``).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
from pathlib import Path

import torch

import builder
from backend import bundle
from builder.sources import read_json_object
from builder.st_writer import SafetensorsWriter
from builder.memory import RUNTIME_BASE, MemoryEstimate, largest_tensor
from builder.stages.base import StageContext, StageError, build_time
from builder.weights import Checkpoint, runtime_tensors

STAGE_VERSION = 3   # 3: rank<i>.safetensors and per-rank kernel shapes under engine.tp_size
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def fingerprint(ctx: StageContext) -> str:
    """The kernels' sources and launch configurations (plugins/*.py, tuning.py among them): the bundle's
    AOT cubins are named by these, so a change there must rebuild this stage, never reuse stale cubins."""
    root = Path(__file__).resolve().parents[2]
    files = sorted((root / "plugins").glob("*.py"))
    if ctx.config.tensorrt.enabled:   # the graph export and the plugin PTX (only then: other keys stay)
        files += sorted((root / "builder" / "tensorrt").glob("*.py")) + sorted((root / "plugins" / "tensorrt").glob("*.py"))
    h = hashlib.sha256()
    for f in files:
        if not f.name.startswith("bench"):
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def memory_estimate(ctx: StageContext) -> MemoryEstimate:
    """Packing reads and writes one tensor at a time (builder/weights.py, st_writer.py): the largest
    one (the embedding) read, cast to fp32 and packed (2 + 4 + 4 bytes per element) bounds it;
    measured 0.80 GiB for 12 and 24 layers at hidden 2048 (docs/perf/build-memory.json)."""
    biggest = largest_tensor(ctx.checkpoint_dir())
    # tensor parallel: the ranks' parts of the tensor in hand, new storage, one more copy (<= 2 bytes)
    per = 10 + (2 if ctx.config.engine.tp_size > 1 else 0)
    return MemoryEstimate(RUNTIME_BASE + per * biggest, 0,
                          f"one tensor at a time, the largest {biggest / 1e6:.0f} M elements",
                          "a machine with more memory (packing already streams tensor by tensor)")


def run(ctx: StageContext) -> dict:
    return write_bundle(ctx, ctx.out_dir)


def write_bundle(ctx: StageContext, out: Path, *, with_draft: bool = True, aot: bool = True) -> dict:
    """The engine bundle of ``ctx``'s checkpoint into the empty folder ``out``. The draft stage also
    calls it (``with_draft=False, aot=False``) for the target it records training data from: one
    packing code path, so the draft learns from the very weights and layout the engine serves."""
    cfg = ctx.config
    imported = ctx.results["import"].info
    model = dict(imported["model"], dtype=cfg.model.dtype)
    ckpt = Checkpoint(ctx.checkpoint_dir())
    fmt, kv_algo, group_size = ckpt.quant_format()
    if cfg.quantization.kv_cache == "fp8" and kv_algo != "FP8":
        raise StageError(f"{cfg.file}: quantization.kv_cache: fp8 but {ckpt.path} has no FP8 KV-cache scales "
                         f"(kv_cache_quant_algo={kv_algo}); allowed: none, or a checkpoint quantized with FP8 KV")

    tp = cfg.engine.tp_size     # > 1 only without a draft (the config refuses both)
    split = _splitter(cfg, model, fmt, tp)
    unquantized: list[str] = []
    n_kv_scales = 0
    what = f"packing weights ({fmt})" + (f", {tp} ranks" if tp > 1 else "")
    with ctx.progress(what, model["num_layers"]) as advance, contextlib.ExitStack() as stack:
        # every rank's file in the same pass: the checkpoint is read once, one tensor at a time
        writers = [stack.enter_context(SafetensorsWriter(out / f, _metadata(fmt, r, tp)))
                   for r, f in enumerate(bundle.rank_weights(tp))]
        for name, tensor in runtime_tensors(ckpt, model, getattr(torch, cfg.model.dtype), fmt,
                                            unquantized, advance):
            n_kv_scales += name.endswith(("attn.k_scale", "attn.v_scale"))
            for r, w in enumerate(writers):
                w.add(name, split(name, tensor, r))
    if cfg.quantization.kv_cache == "fp8" and n_kv_scales != 2 * model["num_layers"]:
        raise StageError(f"{ckpt.path}: expected k/v scales for {model['num_layers']} layers, found "
                         f"{n_kv_scales // 2}; re-run the quantize stage (--force)")

    _copy_tokenizer(ctx.results["import"].path, out / "tokenizer")
    speculative = _copy_draft(ctx, out) if with_draft else None
    try:
        manifest = _manifest(ctx, model, fmt, kv_algo, group_size, unquantized, speculative, out, aot, tp)
    except bundle.BundleError as exc:
        raise StageError(str(exc)) from None
    bundle.write(out, manifest)
    if aot:
        _build_cpu_kernels(ctx)
    return {"format": fmt, "files": len(manifest.files), "kernels": len(manifest.kernels),
            "bytes": sum(p.stat().st_size for p in out.rglob("*") if p.is_file()),
            "weights_bytes_per_rank": [(out / f).stat().st_size for f in manifest.weights]}


def _metadata(fmt: str, rank: int, tp: int) -> dict[str, str]:
    return {"format": "pt", "kiln_format": fmt, **({"kiln_rank": str(rank), "kiln_tp_size": str(tp)} if tp > 1 else {})}


def _splitter(cfg, model: dict, fmt: str, tp: int):
    """``(name, tensor, rank) -> rank's tensor``: the tensor itself for one rank, else its share as the
    runtime's ``tp_shard`` splits it (refused here, at the build, when the runtime could not split it)."""
    if tp == 1:
        return lambda name, t, rank: t
    from backend.bundle_schema import ModelConfig, ModelConfigError
    from backend.runtime.tp_shard import ShardError, check_tp, shard_tensor
    try:
        config = ModelConfig.from_dict(model)   # its own keys: the section's arch is not the runtime's yet
        check_tp(config, fmt, tp)
    except (ModelConfigError, ShardError) as exc:
        raise StageError(f"{cfg.file}: engine.tp_size: {exc}") from None

    def split(name: str, t: torch.Tensor, rank: int) -> torch.Tensor:
        try:
            return shard_tensor(name, t, config, tp, rank)
        except ShardError as exc:
            raise StageError(f"{cfg.file}: engine.tp_size={tp}: {exc}") from None
    return split


def _manifest(ctx: StageContext, model: dict, fmt: str, kv_algo, group_size, unquantized: list[str],
              speculative: dict | None, out: Path, aot: bool = True, tp: int = 1) -> bundle.Manifest:
    cfg = ctx.config
    manifest = bundle.Manifest.from_dict({   # checked here, at the build, not first by the runtime
        "format": bundle.FORMAT,
        "format_version": bundle.version_for(bundle.rank_weights(tp)),
        "created": build_time().isoformat(timespec="seconds"),
        "kiln_version": getattr(builder, "__version__", "0.1.0"),
        "config_file": _display_path(cfg.file),
        "model": model,
        "quantization": {
            "format": fmt,
            "kv_cache": cfg.quantization.kv_cache,
            "group_size": group_size if fmt in ("int4_awq", "w4a8_awq") else None,
            "exclude": list(cfg.quantization.exclude),
            "unquantized_modules": sorted(set(_family(n) for n in unquantized)) if fmt != "none" else [],
            "source": _modelopt_version() if fmt != "none" or kv_algo else None,
        },
        "engine": {**_engine_section(cfg), **_kv_replication(model, tp)},
        "targets": {"sms": list(cfg.engine.target_sms)},
        "kernels": [],
        "speculative": speculative,
        "tools": _tool_versions(),
        # the sections that shaped this bundle (compile is not rebuilt when only verify/serving change)
        "hashes": {"config": _sections_hash(cfg, "compile"),
                   "source": ctx.results["import"].info["source_sha256"]},
        "verify": None,
        "weights": list(bundle.rank_weights(tp)),
        "files": {},
    }, f"{out / bundle.MANIFEST} (being built)")
    # Without ``aot`` the runtime JIT-compiles the same kernels (the draft stage's short-lived target)
    if aot:
        manifest = manifest.replace(kernels=_compile_kernels(ctx, manifest, out))
    if aot and cfg.tensorrt.enabled:
        from builder.tensorrt.target import write_target   # imports onnx: only builds that ask for it
        with ctx.progress("TensorRT target: decoder.onnx, plugin PTX, profiles", 1) as advance:
            try:
                trt = write_target(out, manifest, kernel_shapes(manifest), cfg.tensorrt)
            except Exception as exc:  # noqa: BLE001 - export, PTX convention, onnx checker: one line, the cause chained
                raise StageError(f"{cfg.file}: tensorrt.enabled: {exc}") from exc
            manifest = manifest.replace(tensorrt=trt)
            advance()
    return manifest.replace(files=bundle.file_hashes(out))


def _display_path(file: str) -> str:
    """The config path as a user in the repository would type it (relative when under the cwd)."""
    try:
        return str(Path(file).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return file


def _sections_hash(cfg, stage: str) -> str:
    from builder.stages import get
    # a disabled hash-neutral section (tensorrt) is left out: the hash is what it was before it existed
    parts = {s: h for s in get(stage).sections if (h := cfg.section_hash(s)) is not None}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _family(name: str) -> str:
    """layers.12.qkv -> qkv: the runtime cares which kinds of linear stay plain, not each layer."""
    return name.split(".")[-1] if name.startswith("layers.") else name


def _engine_section(cfg) -> dict:
    e = cfg.engine
    return {
        "max_batch_size": e.max_batch_size, "max_num_tokens": e.max_num_tokens,
        "max_seq_len": e.max_seq_len, "max_input_len": e.max_input_len,
        "kv_block_size": e.kv_block_size,
        "kv_cache_dtype": bundle.default_kv_cache_dtype(cfg.quantization.kv_cache, cfg.model.dtype),
        "kv_cache_free_mem_fraction": e.kv_cache_free_mem_fraction, "max_kv_tokens": e.max_kv_tokens,
        "cuda_graphs": e.cuda_graphs, "overlap_scheduling": e.overlap_scheduling, "cpu_dtype": e.cpu_dtype,
        "enable_prefix_caching": e.enable_prefix_caching, "enable_chunked_prefill": e.enable_chunked_prefill,
        "scheduler_policy": e.scheduler_policy, "tp_size": e.tp_size, "attention_backend": e.attention_backend,
        "runtime": e.runtime,
    }


def _kv_replication(model: dict, tp: int) -> dict:
    """engine.kv_heads_per_rank where the ranks outnumber the KV heads (each holds one, replicated);
    nothing otherwise, so those bundles read as before in every runtime."""
    from backend.runtime.tp_rules import kv_heads_per_rank
    return {"kv_heads_per_rank": kv_heads_per_rank(model["num_kv_heads"], tp)} if tp > model["num_kv_heads"] else {}


def _copy_tokenizer(src: Path, dst: Path) -> None:
    dst.mkdir()
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    if not (dst / "tokenizer.json").is_file():
        raise StageError(f"{src}: tokenizer.json missing from the imported checkpoint; rebuild with --force")
    if not (dst / "special_tokens_map.json").is_file():
        # transformers 5 no longer writes this file; the contract promises it to runtime readers
        tok_cfg = read_json_object(dst / "tokenizer_config.json") if (dst / "tokenizer_config.json").is_file() else {}
        special = {k: tok_cfg[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if tok_cfg.get(k)}
        (dst / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def _copy_draft(ctx: StageContext, out: Path) -> dict | None:
    draft = ctx.results["draft"]
    if draft.path is None:  # skipped: speculative.method is none
        return None
    (out / "draft").mkdir()
    for f in draft.path.iterdir():
        if f.is_file() and f.name != "stage.json":
            shutil.copy2(f, out / "draft" / f.name)
    from builder.stages.draft_settings import runtime_settings

    # The draft stage may be cached from a build with other tree settings: these come from now.
    return {**(draft.info.get("speculative") or {"method": ctx.config.speculative.method}),
            **runtime_settings(ctx.config)}


def _compile_kernels(ctx: StageContext, manifest: bundle.Manifest, out: Path) -> list:
    from plugins import aot  # noqa: PLC0415 - imports Triton's compiler

    kdir = out / "kernels"
    kdir.mkdir()
    sms = list(ctx.config.engine.target_sms)
    with ctx.progress(f"AOT-compiling kernels for sm {sms}"):
        entries = aot.compile_for_bundle(kernel_shapes(manifest), sms, kdir)
    return list(entries or [])


def _build_cpu_kernels(ctx: StageContext) -> None:
    """The CPU kernels for this machine (plugins/cpu), compiled now into their cache so that serving
    on this machine loads them without compiling. Not part of the bundle: they are built for the CPU
    that runs them, by the first process there that lacks them. No compiler is not an error: the CPU
    path then runs the same numbers on PyTorch ops, which the note says."""
    from plugins.cpu import build as cpu_build   # noqa: PLC0415

    try:
        ctx.log(f"CPU kernels: {cpu_build.ensure()}")
    except cpu_build.CpuKernelBuildError as exc:
        ctx.log(f"CPU kernels not built: {exc}")


def kernel_shapes(manifest: bundle.Manifest):
    """The shapes that decide which kernel variants the engine launches (plugins.common.EngineShapes):
    one rank's under engine.tp_size (its heads, KV heads and MLP slice; every rank has the same: one KV
    head where there are fewer than ranks, so the kernels' GQA group is the rank's heads / its KV heads),
    so a tensor-parallel engine finds its cubins too instead of compiling them at start."""
    from backend.runtime.tp_rules import kv_heads_per_rank
    from plugins.common import ACT_TYPES, EngineShapes
    m, q, e = manifest.model, manifest.quantization, manifest.engine
    act = ACT_TYPES[m.dtype]   # ModelConfig has checked the dtype
    tp = e.tp_size             # divides these (builder/config.py checks it with tp_rules)
    arch = getattr(m, "arch_spec", None)   # engine.json model.arch (None: a Llama-shaped model)
    experts = arch.experts if arch is not None else None
    return EngineShapes(
        act=act, kv="fp8e4nv" if e.kv_cache_dtype.startswith("fp8") else act,
        num_heads=m.num_heads // tp, num_kv_heads=kv_heads_per_rank(m.num_kv_heads, tp), head_dim=m.head_dim,
        hidden_size=m.hidden_size, intermediate_size=m.intermediate_size // tp, block_size=e.kv_block_size,
        quant_format=q.format,
        group_size=q.group_size, speculative=manifest.speculative is not None,
        # the fused expert kernel's variants (one rank's expert width, should tp ever split experts)
        num_experts=experts.num_experts if experts else 0,
        moe_intermediate_size=experts.intermediate_size // tp if experts else 0)


def _modelopt_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return f"modelopt {version('nvidia-modelopt')}"
    except PackageNotFoundError:
        return "modelopt"


def _tool_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for key, dist in (("torch", "torch"), ("transformers", "transformers"), ("modelopt", "nvidia-modelopt"),
                      ("triton", "triton"), ("safetensors", "safetensors"), ("gguf", "gguf")):
        try:
            out[key] = version(dist)
        except PackageNotFoundError:
            out[key] = None
    return out
