"""The runtime on an NVIDIA GPU, checked end to end: `python -m harness.gpucheck run [--out F]`.

Reads the bundles and CPU outputs `prepare` left in build/gpu-check/ (built on the CPU machine) and,
for each bundle:
  1. AOT: runs in bf16 (the dtype the cubins were compiled for) with the triton attention backend and
     an EMPTY Triton cache, then counts launches through the bundle's cubins and the .cubin files a
     JIT compile would have left in the cache (0 = nothing was compiled on this machine);
  2. backends: fp32 greedy outputs of the triton backend equal those of the torch reference backend;
  3. CPU parity: fp32 greedy outputs on the GPU vs the CPU machine's (fraction identical, first
     divergence); FP8 must have taken the torch._scaled_mm path;
  4. the bf16 bundle vs Hugging Face transformers `generate` of the source checkpoint on the GPU (fp32);
     a family bundle (``--group families``: Qwen3, Mistral, Gemma 3) vs transformers' teacher-forced
     logits, on each attention backend it runs on;
  5. the build's streamed accuracy check (verify.device: cuda) on the FP8 bundle: the same top-1
     agreement and KL against the source checkpoint on the GPU as on this machine's CPU.
Writes one JSON (default build/perf/gpu-check-<gpu>.json) and prints a table. Exit 1 when a check fails.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DIR = REPO / "build" / "gpu-check"

# The JIT check needs a Triton cache that is empty before Triton is first imported.
_JIT_CACHE = os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="kiln-gpucheck-triton-"))


def jit_cubins() -> int:
    return sum(n.endswith(".cubin") for _, _, files in os.walk(_JIT_CACHE) for n in files)


MAX_KL = 0.02     # per-position mean KL allowed between two devices or backends on the same bundle
DEVICE = "cuda"   # --device cpu smoke-tests this script on CPU (triton backend under TRITON_INTERPRET=1)


def _greedy(bundle: Path, prompts, max_tokens: int, dtype, backend: str):
    import torch

    from backend.engine.executor import Executor
    from backend.engine.sampling_params import SamplingParams
    cuda = DEVICE == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    ex = Executor(bundle, device=DEVICE, dtype=dtype, start=False, attention_backend=backend)
    outs = [r.token_ids for r in ex.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                     ignore_eos=True))]
    aot = getattr(ex.runner.attention, "aot", None)
    info = {"launched_aot": sum(aot.launched.values()) if aot is not None else 0,
            "aot_kernels_loaded": len(aot.kernels) if aot is not None else 0,
            "peak_gpu_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1) if cuda else None,
            "kv_cache_mib": round(ex.runner.kv_cache_bytes / 2**20, 1)}
    graphs = ex.runner.graphs
    info["decode_graph_steps"] = graphs.steps if graphs is not None else 0
    info["cuda_graphs"] = (graphs.failed or f"{len(graphs.graphs)} captured") if graphs is not None else "off"
    lin = ex.runner.model.layers[0].qkv
    info["linear"] = type(lin).__name__ + (" scaled_mm" if getattr(lin, "native", False) else "") + \
        (" + small-M kernel (M <= 16)" if getattr(lin, "small_m", None) is not None else "") + \
        (" packed-kernel" if getattr(lin, "kernels", False) else "")
    del ex
    if cuda:
        torch.cuda.empty_cache()
    return outs, info


def teacher_forced(bundle: Path, prompts, cpu_outs, dtype, backend: str):
    """Feed each prompt plus the CPU's own output; -> this device's next-token logits at every generated
    position [positions, V]. Greedy identity over many tokens is chaotic wherever two logits are nearly
    tied (fp8 rounding, reduced-precision MMA); per-position distributions measure the numerics."""
    import torch

    from backend.engine.executor import Executor
    from backend.runtime.native import prefill_logits
    ex = Executor(bundle, device=DEVICE, dtype=dtype, start=False, attention_backend=backend)
    out = torch.cat([prefill_logits(ex.runner, list(p) + list(o[:-1]))[len(p) - 1:] for p, o in zip(prompts, cpu_outs)])
    del ex
    return out


def distribution_gap(ref, got, ref_tokens=None) -> dict:
    """Mean KL(ref || got) per position, top-1 agreement, and the largest logit difference relative to
    the spread of the reference logits."""
    lr, lg = ref.float().log_softmax(-1), got.float().log_softmax(-1)
    kl = (lr.exp() * (lr - lg)).sum(-1).clamp_min(0).mean().item()
    top = ref_tokens if ref_tokens is not None else ref.argmax(-1)
    agree = (got.argmax(-1) == top).float().mean().item()
    rel = ((got.float() - ref.float()).abs().max() / ref.float().std()).item()
    return {"mean_kl": round(kl, 6), "top1_agreement": round(agree, 4), "max_logit_diff_rel": round(rel, 4),
            "positions": int(ref.shape[0])}


def _compare(a, b) -> dict:
    same = sum(x == y for x, y in zip(a, b))
    first = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None) for x, y in zip(a, b)]
    return {"identical": f"{same}/{len(a)}", "first_divergence": first, "all_equal": same == len(a)}


def hf_greedy(hf_dir: Path, prompts, max_tokens: int):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(DEVICE).eval()
    outs = []
    for p in prompts:
        ids = torch.tensor([p], device=DEVICE)
        g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                           min_new_tokens=max_tokens, do_sample=False, pad_token_id=2)
        outs.append(g[0, len(p):].tolist())
    return outs


def streamed_verify(bundle: Path, prompts) -> dict:
    """The verify stage's layer-by-layer comparison (builder/stages/verify_stream.py) of ``bundle``
    against its source checkpoint, on DEVICE and on the CPU: both fp32 with the torch attention
    backend, so they differ by summation order only (KL of order 1e-6, not a changed top-1)."""
    from contextlib import contextmanager

    from backend.runtime.spec import load_engine_spec
    from builder.stages.verify_stream import streamed_compare

    @contextmanager
    def progress(_description, _total):
        yield lambda _n=1: None
    spec = load_engine_spec(bundle)
    out = {}
    for key, dev in (("device", DEVICE), ("cpu", "cpu")):
        agree, kl_sum, n = streamed_compare(DIR / "hf", spec, prompts, progress, device=dev)
        out[key] = {"top1_agree": agree, "positions": n, "mean_kl": kl_sum / max(n, 1)}
    d, c = out["device"], out["cpu"]
    out["ok"] = (d["positions"] == c["positions"] > 0 and abs(d["top1_agree"] - c["top1_agree"]) <= 1
                 and abs(d["mean_kl"] - c["mean_kl"]) <= 1e-3 * max(c["mean_kl"], 1e-3))
    return out


def check_bundle(name: str, entry: dict, ref: dict) -> dict:
    import torch
    bundle = REPO / entry["path"]
    # a family bundle names its prompts, the attention backends it runs on, and transformers' logits as
    # its teacher-forced reference (harness/gpucheck/families.py); a format bundle this CPU's Kiln logits
    prompts, n = entry.get("prompts", ref["prompts"]), ref["max_tokens"]
    backends = entry.get("backends", ["triton", "torch"])
    family = entry.get("group") == "families"
    res: dict = {"bundle": entry["path"], "backends": backends}
    if "triton" in backends:
        before = jit_cubins()
        _, aot = _greedy(bundle, prompts, n, torch.bfloat16, "triton")
        res["aot_bf16"] = {**aot, "jit_cubins_compiled": jit_cubins() - before}
    outs, infos = {}, {}
    for b in backends:
        outs[b], infos[b] = _greedy(bundle, prompts, n, torch.float32, b)
    info_r, info_t = infos[backends[-1]], infos[backends[0]]
    if "triton" in backends:
        res["fp32_triton_vs_torch"] = _compare(outs["triton"], outs["torch"])
        res["fp32_triton_cuda_graphs"] = {k: infos["triton"][k] for k in ("cuda_graphs", "decode_graph_steps")}
    res["fp32_gpu_vs_cpu"] = _compare(outs[backends[-1]], entry["cpu_fp32_greedy"])
    from safetensors.torch import load_file
    kind = "hf" if family else "cpu"
    teacher = load_file(str(DIR / "ref" / f"{name}-{kind}-logits.safetensors"))["logits"].float()
    cpu_tokens = torch.tensor([t for o in entry["cpu_fp32_greedy"] for t in o])
    tf = {b: teacher_forced(bundle, prompts, entry["cpu_fp32_greedy"], torch.float32, b) for b in backends}
    for b in backends:
        res[f"fp32_teacher_forced_vs_{kind}_{b}"] = distribution_gap(teacher, tf[b], cpu_tokens)
    gaps = []
    if "triton" in backends:
        res["fp32_teacher_forced_triton_vs_torch"] = distribution_gap(tf["torch"], tf["triton"])
        gaps.append(res["fp32_teacher_forced_triton_vs_torch"])
    res["linear_path"] = info_r["linear"]
    res["peak_gpu_mib_fp32"] = info_t["peak_gpu_mib"]
    # A wrong scale, layout or mask moves whole distributions (KL of order 1); rounding differences
    # (fp8 MMA accumulation, tf32 dots, fp8 KV codes flipping) stay orders of magnitude below.
    # nvfp4 runs W4A16 on Hopper but W4A4 (fake-quantized activations) on CPU: compared GPU to GPU only.
    if name != "nvfp4":
        gaps += [res[f"fp32_teacher_forced_vs_{kind}_{b}"] for b in backends]
    aot_ok = "triton" not in backends or res["aot_bf16"]["launched_aot"] > 0 or DEVICE == "cpu"
    ok = aot_ok and all(g["mean_kl"] < MAX_KL for g in gaps)
    if name == "fp8":
        ok = ok and "scaled_mm" in res["linear_path"]
        res["verify_streamed_device_vs_cpu"] = streamed_verify(bundle, prompts)
        ok = ok and res["verify_streamed_device_vs_cpu"]["ok"]
    if name in ("nvfp4", "int4_awq"):
        ok = ok and "packed-kernel" in res["linear_path"]
    if name == "bf16":
        res["fp32_vs_hf_generate"] = _compare(outs["torch"], hf_greedy(DIR / "hf", prompts, n))
        ok = ok and res["fp32_vs_hf_generate"]["all_equal"]
    res["ok"] = bool(ok)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.gpucheck run", description=__doc__.splitlines()[0])
    ap.add_argument("--out", "--output", dest="out", help="result JSON (default build/perf/gpu-check-<gpu>.json)")
    ap.add_argument("--only", nargs="*", help="bundle names to check (default: every bundle of --group)")
    ap.add_argument("--group", default="formats", choices=("formats", "families", "all"),
                    help="formats: the Llama bundles of every linear format (default); families: Qwen3, "
                         "Mistral, Gemma 3 (bf16); all: both")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: smoke-test this script here (needs TRITON_INTERPRET=1; no AOT, no speed)")
    a = ap.parse_args(argv)
    import json

    import torch
    global DEVICE
    DEVICE = a.device
    if a.device == "cpu":
        return _smoke(a)
    if not torch.cuda.is_available():
        print("gpucheck run: no NVIDIA GPU visible; run it on the GPU machine "
              "(prepare runs here: python -m harness.gpucheck prepare)", file=sys.stderr)
        return 2
    ref_file = DIR / "ref" / "reference.json"
    if not ref_file.is_file():
        print(f"gpucheck run: {ref_file} missing; run: python -m harness.gpucheck prepare", file=sys.stderr)
        return 2
    ref = json.loads(ref_file.read_text())
    from harness.perf.lib.results import header, write_checks
    res = header("gpu-check", "harness.gpucheck", ["run", *(sys.argv[2:] if argv is None else argv)], torch=torch)
    return _check_all(ref, a, res, write_checks)


def _smoke(a) -> int:
    import json
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("gpucheck run --device cpu: set TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    from harness.perf.lib.results import write_checks
    ref = json.loads((DIR / "ref" / "reference.json").read_text())
    return _check_all(ref, a, {"gpu": "cpu-smoke"}, write_checks)


def _check_all(ref: dict, a, res: dict, write_report) -> int:
    import json
    res["bundles"] = {}
    for name, entry in ref["bundles"].items():
        if a.only and name not in a.only:
            continue
        if not a.only and a.group != "all" and entry.get("group", "formats") != a.group:
            continue
        try:
            res["bundles"][name] = check_bundle(name, entry, ref)
        except Exception as exc:  # noqa: BLE001 - one broken format must not hide the others' results
            import traceback
            res["bundles"][name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                                    "traceback": traceback.format_exc()[-3000:]}
        print(f"[{name}] {json.dumps(res['bundles'][name])[:600]}", flush=True)
    return write_report(res, a.out, "gpu-check")
