"""Write every TensorRT-convention plugin PTX an engine needs, checked, into a folder.

`compile_all(shapes, floats, sms, out_dir)` writes `out_dir/sm<sm>/<plugin>-<hash>.{ptx,json}` for each
variant of `convention.trt_plan` and each SM, after checking the entry against TensorRT's calling
convention and assembling it with ptxas for that SM; it returns the .json contents. The build calls it
for a bundle with `tensorrt.enabled` (builder/tensorrt/target.py). Under
TRITON_INTERPRET=1 (the CPU kernel tests) the @triton.jit wrappers cannot be compiled in process, so it
runs `python -m plugins.tensorrt.compile` in a child, as plugins.aot does.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ..aot import emit_json, shapes_from_dict
from ..common import EngineShapes
from .convention import TrtFloats, compile_trt, trt_plan
from .ptx import ConventionError
from .ptxas import arch, assemble


def file_stem(meta: dict) -> str:
    return f"{meta['plugin']}-{hashlib.sha256(meta['key'].encode()).hexdigest()[:12]}"


def compile_all(shapes: EngineShapes, floats: TrtFloats, sms: list[int], out_dir: str | os.PathLike,
                plugins: tuple[str, ...] | None = None) -> list[dict]:
    """``plugins``: only the variants of these plugin names (a graph's custom nodes); None = all."""
    out_dir = Path(out_dir)
    if os.environ.get("TRITON_INTERPRET") == "1":
        return _in_subprocess(shapes, floats, sms, out_dir, plugins)
    metas = []
    for sm in sms:
        (out_dir / f"sm{sm}").mkdir(parents=True, exist_ok=True)
        for tv in trt_plan(shapes, floats):
            if plugins is not None and tv.spec.plugin not in plugins:
                continue
            k = compile_trt(tv, sm)
            cubin = assemble(k.ptx, sm, k.meta["key"])
            meta = dict(k.meta, ptxas={"arch": arch(sm), "cubin_bytes": len(cubin)})
            stem = file_stem(meta)
            (out_dir / f"sm{sm}" / f"{stem}.ptx").write_text(k.ptx)
            (out_dir / f"sm{sm}" / f"{stem}.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
            metas.append(meta)
    return metas


def _in_subprocess(shapes: EngineShapes, floats: TrtFloats, sms: list[int], out_dir: Path,
                   plugins: tuple[str, ...] | None) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as tmp:
        shp, res = Path(tmp) / "shapes.json", Path(tmp) / "metas.json"
        shp.write_text(json.dumps(dataclasses.asdict(shapes)))
        cmd = [sys.executable, "-m", "plugins.tensorrt.compile", str(shp), str(out_dir), "--sms", *map(str, sms),
               "--rms-eps", repr(floats.rms_eps), "--metas", str(res)]
        if plugins is not None:
            cmd += ["--plugins", *plugins]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise ConventionError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else
                                  f"plugins.tensorrt.compile exited {proc.returncode}")
        return json.loads(res.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m plugins.tensorrt.compile",
                                 description="Compile an engine's TensorRT plugin PTX, checked (no GPU, no TensorRT).")
    ap.add_argument("shapes", help="path to a JSON object with the fields of plugins.common.EngineShapes")
    ap.add_argument("out_dir")
    ap.add_argument("--sms", type=int, nargs="+", default=[90, 100])
    ap.add_argument("--rms-eps", type=float, required=True)
    ap.add_argument("--metas", help="write the list of .json contents here (default: stdout)")
    ap.add_argument("--plugins", nargs="+", help="only these plugins (ONNX op types), e.g. kiln_paged_prefill")
    a = ap.parse_args(argv)
    try:
        metas = compile_all(shapes_from_dict(json.loads(Path(a.shapes).read_text())),
                            TrtFloats(a.rms_eps), a.sms, a.out_dir, tuple(a.plugins) if a.plugins else None)
    except ValueError as exc:   # ConventionError / PtxasError / AotError: one line naming the kernel
        print(f"error: {exc}", file=sys.stderr)
        return 2
    emit_json(metas, a.metas)
    return 0


if __name__ == "__main__":
    sys.exit(main())
