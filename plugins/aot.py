"""Ahead-of-time compilation of every kernel an engine uses, for each target SM, with no GPU.

`compile_for_bundle(shapes, sms, out_dir)` writes `out_dir/sm<sm>/<variant>.{cubin,ptx,json}` and
returns the entries for engine.json's "kernels" list. `shapes` (common.EngineShapes) is built by the
caller from the bundle's manifest (plugins do not read engine.json). The variants come from each kernel
module's `aot_variants(shapes)`, beside the wrapper that picks the same constexprs at launch, so what is
compiled is what the runtime asks for. The .json records what a launcher needs without Triton:
entry name, parameters in order, num_warps, shared memory, scratch sizes, constexprs, versions, hashes.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import (act_quant, fused_moe, gemm_fp8, gemm_fp8_small, gemm_w4a16, gemm_w4a16_small, kv_write, norm_quant,
               paged_decode, paged_prefill, rmsnorm, rope, rope_kv)
from .common import ACT_TYPES, AOT_META_VERSION, EngineShapes, Variant
from .rope_kv import QK_NORMS

KERNEL_MODULES = (kv_write, paged_decode, paged_prefill, rmsnorm, rope, gemm_w4a16, gemm_w4a16_small, gemm_fp8,
                  gemm_fp8_small, norm_quant, act_quant, rope_kv, fused_moe)
DEFAULT_SMS = (90, 100)
META_VERSION = AOT_META_VERSION


class AotError(ValueError):
    """The shapes lack something the kernels need, or a target cannot be compiled."""


def check_shapes(shapes: EngineShapes) -> EngineShapes:
    """Refuse shapes no kernel variant can be planned for, naming the field."""
    acts = tuple(ACT_TYPES.values())
    if shapes.act not in acts:
        raise AotError(f"shapes.act: {shapes.act!r}; allowed: {', '.join(acts)}")
    if shapes.kv not in (shapes.act, "fp8e4nv"):
        raise AotError(f"shapes.kv: {shapes.kv!r}; allowed: {shapes.act}, fp8e4nv")
    for name in ("num_heads", "num_kv_heads", "head_dim", "hidden_size", "intermediate_size", "block_size"):
        value = getattr(shapes, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise AotError(f"shapes.{name}: {value!r}; allowed: a positive integer")
    if not isinstance(shapes.sliding_window, bool):
        raise AotError(f"shapes.sliding_window: {shapes.sliding_window!r}; allowed: true, false")
    for name in ("num_experts", "moe_intermediate_size"):
        value = getattr(shapes, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise AotError(f"shapes.{name}: {value!r}; allowed: an integer >= 0 (0: no experts)")
    if shapes.num_experts and not shapes.moe_intermediate_size:
        raise AotError(f"shapes.moe_intermediate_size: 0 with {shapes.num_experts} experts; "
                       "allowed: a positive integer")
    if shapes.qk_norm not in QK_NORMS:
        raise AotError(f"shapes.qk_norm: {shapes.qk_norm!r}; allowed: {', '.join(QK_NORMS)}")
    return shapes


def shapes_from_dict(d: dict) -> EngineShapes:
    """EngineShapes from the small JSON the subprocess/CLI path passes (its fields, by name)."""
    names = set(EngineShapes.__dataclass_fields__)
    if not isinstance(d, dict) or set(d) != names:
        got = set(d) if isinstance(d, dict) else set()
        raise AotError(f"shapes: fields {sorted(names - got)} missing, {sorted(got - names)} unknown; "
                       f"expected exactly: {', '.join(sorted(names))}")
    return check_shapes(EngineShapes(**d))


def plan(shapes: EngineShapes) -> list[Variant]:
    """Every kernel variant the engine launches (deduplicated, stable order)."""
    check_shapes(shapes)
    seen: dict[str, Variant] = {}
    for mod in KERNEL_MODULES:
        for v in mod.aot_variants(shapes):
            seen.setdefault(v.key, v)
    return list(seen.values())


def variant_file_stem(v: Variant) -> str:
    """A short file name: kernel name + hash of the full variant key (the key itself is in the .json)."""
    return f"{v.fn.__name__}-{hashlib.sha256(v.key.encode()).hexdigest()[:12]}"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def ptx_params(ptx: str, entry: str) -> list[str]:
    """The .param types of the kernel entry in PTX, in order (includes Triton's trailing scratch pointers)."""
    m = re.search(r"\.entry\s+" + re.escape(entry) + r"\s*\(([^)]*)\)", ptx)
    if m is None:
        raise AotError(f"PTX has no entry {entry!r}")
    return re.findall(r"\.param\s+\.(\w+)", m.group(1))


# scalar parameters passed by pointer: may be views into larger tensors, so never assumed aligned
SCALAR_POINTERS = {"k_scale_ptr", "v_scale_ptr", "ws2_ptr", "xs_ptr", "scale_ptr", "out_scale_ptr"}
ALIGNED_TYPES = {"*fp16", "*bf16", "*fp32", "*fp8e4nv", "*u8"}


def aligned_params(sig: dict) -> list[str]:
    """Pointers compiled as 16-byte aligned (wider vector loads): the data tensors (activations, caches,
    weights, buffers). Not the int32/int64 metadata, which the runtime slices per step (e.g.
    seq_lens[num_prefills:]), nor scalars. The launcher checks these at run time."""
    return [n for n, t in sig.items() if t in ALIGNED_TYPES and n not in SCALAR_POINTERS]


def compile_variant(v: Variant, sm: int) -> tuple[object, dict]:
    """-> (compiled kernel, metadata dict)."""
    sig = v.signature()
    aligned = aligned_params(sig)
    bad = [n for n in v.divisible if sig.get(n) not in ("i32", "i64")]
    assert not bad, f"{v.key}: divisible names non-integer arguments {bad}"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig) if n in aligned or n in v.divisible}
    src = ASTSource(v.fn, sig, v.constexprs, attrs)
    try:
        k = triton.compile(src, target=GPUTarget("cuda", sm, 32),
                           options={"num_warps": v.num_warps, "num_stages": v.num_stages})
    except Exception as exc:  # triton raises many types; the variant and SM are what the user needs
        raise AotError(f"AOT compile of {v.key} for sm_{sm} failed: {exc}") from exc
    md = k.metadata
    params = [n for n, t in sig.items() if t != "constexpr"]
    ptx_types = ptx_params(k.asm["ptx"], md.name)
    meta = {
        "meta_version": META_VERSION, "name": variant_file_stem(v), "key": v.key, "kernel": v.fn.__name__,
        "entry": md.name, "sm": sm, "num_warps": md.num_warps, "num_stages": md.num_stages,
        "num_ctas": md.num_ctas, "shared": md.shared,
        "global_scratch_size": md.global_scratch_size, "global_scratch_align": md.global_scratch_align,
        "profile_scratch_size": getattr(md, "profile_scratch_size", 0),
        "profile_scratch_align": getattr(md, "profile_scratch_align", 1),
        "signature": [[n, t] for n, t in sig.items()], "params": params,
        "constexprs": {n: (int(c) if isinstance(c, bool) else c) for n, c in v.constexprs.items()},
        "aligned_pointers": 16, "aligned": aligned, "divisible": list(v.divisible), "ptx_param_types": ptx_types, "extra_params": len(ptx_types) - len(params),
        "triton_version": triton.__version__, "target": f"cuda:{sm}",
    }
    return k, meta


def compile_for_bundle(shapes: EngineShapes, sms: list[int] | None, out_dir: str | os.PathLike) -> list[dict]:
    """Compile every kernel the engine uses for each SM in `sms` (default 90 and 100) into
    `out_dir/sm<sm>/`. -> engine.json "kernels" entries, paths relative to out_dir's parent (the bundle)."""
    sms = list(sms or DEFAULT_SMS)
    for sm in sms:
        if not isinstance(sm, int) or sm < 80:
            raise AotError(f"engine.target_sms: {sm!r} is not supported; allowed: integers >= 80 (e.g. 90, 100)")
    out_dir = Path(out_dir)
    variants = plan(shapes)  # validates the shapes before anything is written
    if os.environ.get("TRITON_INTERPRET") == "1":
        return _compile_in_subprocess(shapes, sms, out_dir)
    prefix = out_dir.name
    entries = []
    for sm in sms:
        sm_dir = out_dir / f"sm{sm}"
        sm_dir.mkdir(parents=True, exist_ok=True)
        for v in variants:
            k, meta = compile_variant(v, sm)
            stem = meta["name"]
            cubin, ptx = k.asm["cubin"], k.asm["ptx"].encode()
            meta["sha256"] = {"cubin": _sha256(cubin), "ptx": _sha256(ptx)}
            (sm_dir / f"{stem}.cubin").write_bytes(cubin)
            (sm_dir / f"{stem}.ptx").write_bytes(ptx)
            meta_bytes = (json.dumps(meta, indent=1, sort_keys=True) + "\n").encode()
            (sm_dir / f"{stem}.json").write_bytes(meta_bytes)
            rel = f"{prefix}/sm{sm}/{stem}"
            entries.append({"name": stem, "key": v.key, "sm": sm, "cubin": f"{rel}.cubin", "ptx": f"{rel}.ptx",
                            "meta": f"{rel}.json", "sha256": {"cubin": meta["sha256"]["cubin"],
                                                              "ptx": meta["sha256"]["ptx"],
                                                              "meta": _sha256(meta_bytes)}})
    return entries


def _compile_in_subprocess(shapes: EngineShapes, sms: list[int], out_dir: Path) -> list[dict]:
    """Under TRITON_INTERPRET=1 (the CPU tests) @triton.jit yields interpreter objects that cannot be
    compiled, so compile in a child process that imports the kernels normally."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as tmp:
        shp, res = Path(tmp) / "shapes.json", Path(tmp) / "entries.json"
        shp.write_text(json.dumps(dataclasses.asdict(shapes)))
        cmd = [sys.executable, "-m", "plugins.aot", str(shp), str(out_dir), "--sms", *map(str, sms), "--entries", str(res)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise AotError(f"AOT compile subprocess failed: {proc.stderr.strip().splitlines()[-1:] or proc.returncode}")
        return json.loads(res.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m plugins.aot",
                                 description="Compile an engine's kernels ahead of time (no GPU needed).")
    ap.add_argument("shapes", help="path to a JSON object with the fields of plugins.common.EngineShapes")
    ap.add_argument("out_dir", help="output folder (a bundle's kernels/)")
    ap.add_argument("--sms", type=int, nargs="+", default=list(DEFAULT_SMS))
    ap.add_argument("--entries", help="write the engine.json kernel entries here (default: stdout)")
    a = ap.parse_args(argv)
    try:
        entries = compile_for_bundle(shapes_from_dict(json.loads(Path(a.shapes).read_text())), a.sms, a.out_dir)
    except ValueError as exc:  # AotError, or a shapes file that is not JSON
        print(f"error: {exc}", file=sys.stderr)
        return 2
    emit_json(entries, a.entries)
    return 0


def emit_json(obj, path: str | None) -> None:
    """A CLI's result: to ``path`` when given (the builder reads it back), else to stdout."""
    text = json.dumps(obj, indent=1)
    if path:
        Path(path).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    sys.exit(main())
