"""Kernel launches of one decode step, per decoder layer, on the Triton path:
`python -m harness.perf.step.launches [--out F] [--check docs/perf/launches.json]`.

Runs on any machine. On CPU the Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1, set
here before triton is imported) and the engine is told it is on a Hopper GPU where that changes which
kernels run (``gpu_emulation``): FP8 linears take their GPU paths (the small-M Triton GEMM up to 16
rows, ``torch._scaled_mm`` above; both run on CPU),
the split-K decode kernel plans its splits for 132 SMs, the compute dtype is bf16. With
``--device cuda`` the same count runs on a real GPU, with nothing emulated.

What counts as a launch (the rule, one place):
  * every Triton kernel launched through ``plugins.common.launch`` (JIT or an AOT cubin);
  * every PyTorch op that reaches the dispatcher as an ATen op and would run a kernel (or a copy) on
    the GPU: all ATen ops except views and aliases (``OpOverload.is_view``: view, slice, split,
    expand, transpose, ...; ops that only may alias, like ``to`` and ``reshape``, count when they
    copied), uninitialized allocations (``empty*``, free with the caching allocator)
    and metadata-only ops (``_unsafe_view``, ``detach``, ``lift_fresh``, ``set_``, ``resize_``);
  * ATen ops issued by the Triton interpreter inside a launch are the interpreter's, not counted.

Per decoder layer = the count of an engine with L+1 layers minus that of the same engine with L
layers (op by op), so what runs once per step (embedding, final norm, logits, metadata) is apart.
The step is ``ModelRunner.execute`` of one decode token at batch 1 over ``--context`` cached tokens
(long enough that the decode kernel splits, as on the GPU), after a short prefill that brings the
runner into its serving state; sampling is not part of it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

# Llama-shaped, tiny (GQA group 2): the number of launches does not depend on the sizes
TINY = {"hidden_size": 128, "intermediate_size": 256, "num_heads": 4, "num_kv_heads": 2, "head_dim": 32,
        "vocab_size": 512, "max_position_embeddings": 1024}
ENGINE = {"max_batch_size": 8, "max_num_tokens": 512, "max_seq_len": 1024, "max_input_len": 512,
          "kv_block_size": 16, "kv_cache_dtype": "fp8_e4m3", "max_kv_tokens": 2048,
          "attention_backend": "triton", "cuda_graphs": False}
H100_SMS = 132
GOAL_PER_LAYER = 10

# ATen ops that launch nothing on a GPU although the dispatcher does not call them views
NOT_KERNELS = {"empty.memory_format", "empty_like.default", "empty_strided.default", "new_empty.default",
               "new_empty_strided.default", "_unsafe_view.default", "detach.default", "lift_fresh.default",
               "set_.source_Storage_storage_offset", "set_.source_Tensor", "resize_.default"}


def counts_as_kernel(func, args: tuple = (), out=None) -> bool:
    """The rule of the module docstring for one call of an ATen op overload."""
    if func.__name__ in NOT_KERNELS:
        return False
    if func.is_view:
        # ops that MAY alias (to, reshape, contiguous under inference mode): a kernel when they copied
        import torch
        src = args[0] if args else None
        return (isinstance(out, torch.Tensor) and isinstance(src, torch.Tensor)
                and out.untyped_storage().data_ptr() != src.untyped_storage().data_ptr())
    return True


class LaunchCounter:
    """Counts launches while active: ``with LaunchCounter() as c: ...; c.counts``."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self._paused = 0
        self._mode = None
        self._patched: list[tuple[object, object]] = []

    def __enter__(self) -> "LaunchCounter":
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        import plugins.aot  # noqa: F401  (imports every kernel module, so all their `launch` names get patched)
        from plugins import common
        counter = self
        original = common.launch

        def counted_launch(fn, *args, **kwargs):
            counter.counts[f"triton.{fn.__name__}"] += 1
            counter._paused += 1
            try:
                return original(fn, *args, **kwargs)
            finally:
                counter._paused -= 1

        for name, mod in list(sys.modules.items()):
            if name.startswith("plugins.") and getattr(mod, "launch", None) is original:
                self._patched.append((mod, original))
                mod.launch = counted_launch

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if not counter._paused and counts_as_kernel(func, args, out):
                    counter.counts[f"aten.{func.__name__}"] += 1
                return out

        del torch
        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        for mod, original in self._patched:
            mod.launch = original
        self._patched.clear()


@contextmanager
def gpu_emulation(enabled: bool):
    """On CPU, take the code paths a Hopper GPU takes where they differ in launches (see the docstring)."""
    if not enabled:
        yield
        return
    from backend.ops import linear
    from plugins import paged_decode, tuning
    saved = linear.has_fp8_matmul, linear.small_m_kernel, paged_decode._target_programs
    linear.has_fp8_matmul = lambda device: True
    linear.small_m_kernel = lambda device: True
    paged_decode._target_programs = lambda device, fp8=False: (
        H100_SMS * tuning.get("paged_decode_fp8" if fp8 else "paged_decode")["programs_per_sm"])
    try:
        yield
    finally:
        linear.has_fp8_matmul, linear.small_m_kernel, paged_decode._target_programs = saved


PREFILL_TOKENS = 16


def count_decode_step(num_layers: int, device: str = "cpu", context: int = 300, root: Path | None = None) -> Counter:
    """Launches of one batch-1 decode step over ``context`` cached tokens of a tiny Llama-shaped FP8
    (+ FP8 KV) engine of ``num_layers`` layers."""
    import torch

    from backend.runtime.native import ModelRunner, prefill_logits
    from backend.runtime.spec import load_engine_spec
    from backend.ops.attention.metadata import AttentionMetadata
    from harness.perf.lib import models

    m = dict(models.LLAMA31_8B, **TINY, num_layers=num_layers)
    with tempfile.TemporaryDirectory() as tmp:
        path = models.manifest_bundle(m, ENGINE, Path(root or tmp) / f"engine-L{num_layers}")
        w = models.synthetic_fp8_weights(m, device=device, seed=0, std=0.05)
        with gpu_emulation(device == "cpu"):
            runner = ModelRunner(load_engine_spec(path), device, torch.bfloat16, weights=w)
            ids = torch.Generator().manual_seed(0)
            prompt = torch.randint(0, m["vocab_size"], (context,), generator=ids).tolist()
            # A short prefill brings the runner into its serving state (its first call sets things up).
            # The decode step below reads ``context`` tokens of KV whatever their values: the launches
            # do not depend on them, and a full prefill in the interpreter took most of the count's time.
            prefill_logits(runner, prompt[:PREFILL_TOKENS])
            t, bs = context, runner.block_size
            dev, i32 = runner.device, torch.int32
            nblk = -(-(t + 1) // bs)
            meta = AttentionMetadata(
                positions=torch.tensor([t], device=dev), slot_mapping=torch.tensor([t], device=dev),
                block_tables=torch.arange(nblk, dtype=i32, device=dev).view(1, -1),
                seq_lens=torch.tensor([t + 1], dtype=i32, device=dev),
                query_start_loc=torch.tensor([0, 1], dtype=i32, device=dev),
                context_lens=torch.tensor([t], dtype=i32, device=dev), num_prefills=0, num_prefill_tokens=0,
                num_decode_tokens=1, max_query_len=1, max_seq_len=t + 1)
            ids = torch.tensor([prompt[-1]], device=dev)
            logits_indices = torch.zeros(1, dtype=torch.long, device=dev)
            with LaunchCounter() as c:
                runner.execute(ids, meta, logits_indices)
            if dev.type == "cuda":
                torch.cuda.synchronize()
    return c.counts


def measure(device: str = "cpu", layers: int = 1, context: int = 300) -> dict:
    """Per-layer launches (difference of a ``layers + 1`` and a ``layers`` engine) and the rest."""
    small = count_decode_step(layers, device, context)
    big = count_decode_step(layers + 1, device, context)
    per_layer = {k: big[k] - small[k] for k in sorted(set(big) | set(small)) if big[k] != small[k]}
    outside = {k: v - layers * per_layer.get(k, 0) for k, v in sorted(small.items())
               if v - layers * per_layer.get(k, 0)}
    total = sum(per_layer.values())
    return {"per_layer": {"total": total,
                          "triton": sum(v for k, v in per_layer.items() if k.startswith("triton.")),
                          "torch": sum(v for k, v in per_layer.items() if k.startswith("aten.")),
                          "ops": per_layer},
            "outside_layers": {"total": sum(outside.values()), "ops": outside}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.perf.step.launches", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cpu: Triton interpreter, GPU code paths emulated (default); cuda: a real GPU")
    ap.add_argument("--context", type=int, default=300, help="prompt tokens before the decode step (default 300)")
    ap.add_argument("--out", "--output", dest="out", help="result JSON (default build/perf/launches-<device>.json)")
    ap.add_argument("--check", metavar="JSON", help="fail (exit 1) if launches per layer exceed this file's")
    a = ap.parse_args(argv)
    if a.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if os.environ["TRITON_INTERPRET"] != "1":
            print("launches: --device cpu needs TRITON_INTERPRET=1", file=sys.stderr)
            return 2
    import torch
    import triton

    from harness.perf.lib.results import header, write_result
    res = {**header("launches", "harness.perf.step.launches", argv, torch=torch if a.device == "cuda" else None),
           "what": "kernel launches of one batch-1 decode step on the Triton path, per decoder layer",
           "torch": torch.__version__, "triton": triton.__version__, "device": a.device,
           "emulated": ({"fp8_linear": "M <= 16: Triton fp8_gemm_small_m_kernel; larger: torch._scaled_mm",
                         "decode_splits_for_sms": H100_SMS,
                         "compute_dtype": "bfloat16"} if a.device == "cpu" else None),
           "model": "Llama-shaped FP8 (per-row weights, static input scales) + FP8 KV, tiny sizes",
           "rule": __doc__.split("What counts as a launch (the rule, one place):")[1].split("\n\n")[0].strip(),
           "context": a.context, "goal_per_layer": GOAL_PER_LAYER}
    res.update(measure(a.device, context=a.context))
    n = res["per_layer"]["total"]
    print(f"launches per decoder layer: {n} (triton {res['per_layer']['triton']}, torch {res['per_layer']['torch']}); "
          f"outside the layers: {res['outside_layers']['total']}; goal <= {GOAL_PER_LAYER}")
    for k, v in res["per_layer"]["ops"].items():
        print(f"  {v:3d}  {k}")
    write_result(res, a.out, f"launches-{a.device}.json", indent=1)
    if a.check:
        allowed = json.loads(Path(a.check).read_text())["per_layer"]["total"]
        if n > allowed:
            print(f"launches: {n} per layer > {allowed} committed in {a.check}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
