"""``engine.runtime=tensorrt``: one step = one run of the bundle's TensorRT plan (``tensorrt/engine.plan``,
built on a TensorRT host by ``make engine-plan``), behind the same StepRunner seam as the native model.

The runner owns what the executor's block manager hands out (the KV pool, one k/v tensor pair per
layer, sized like ModelRunner's: ``plan_kv_blocks`` with the pool's dtype from ``kv_cache_dtypes``,
capped at the plan's ``blocks`` dimension); the plan holds the weights. Per step, trt_session.PlanSession
picks the optimization profile, binds every graph input and output by name (cache outputs on the pool's
own addresses) and enqueues on torch's current stream; logits and captured hidden rows are copied out
of the session's buffers before the next step reuses them.

Refused in one line (EngineError), before anything is allocated: a device that is not CUDA, a bundle
without a plan (the command that builds it), no importable tensorrt, a plan built by another TensorRT
version, no visible GPU. The plugins are registered before the plan is deserialized: an AOT plan
carries its kernels, but registering first also checks that the bundle's PTX fits this GPU's SM.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from backend.bundle import BundleError
from backend.runtime import cpu_dtype, graph_io
from backend.runtime.kv_plan import kv_cache_dtypes, kv_pool_bytes, plan_kv_blocks, zeroed
from backend.runtime.spec import EngineError, EngineSpec
from backend.runtime.runtimes import StepRunner
from backend.runtime.trt_files import (PROFILES, TensorRTFilesError, TensorRTMissing, import_tensorrt, load_profiles,
                                     register_plugins, section)
from backend.runtime.trt_session import PlanSession
from plugins.tensorrt.variants import VariantError


def build_command(spec: EngineSpec) -> str:
    return f"make engine-plan OUT={spec.path.parent}  (python -m builder.tensorrt_build {spec.path})"


class TensorRTRunner(StepRunner):
    """Runs steps through the bundle's TensorRT plan (see the module docstring)."""

    def __init__(self, spec: EngineSpec, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                 weights: dict[str, torch.Tensor] | None = None) -> None:
        del weights   # the plan holds its own weights
        self.spec = spec
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise EngineError(f"engine.runtime tensorrt: device {str(self.device)!r} is not a CUDA GPU; a TensorRT "
                              f"plan runs on the GPU it was built for (on a CPU: engine.runtime native or "
                              f"onnx-reference)")
        try:
            sec = section(spec.manifest, spec.path)
        except TensorRTFilesError as exc:
            raise EngineError(str(exc)) from None
        if sec.plan is None:
            raise EngineError(f"{spec.path / 'engine.json'}: tensorrt.plan is null: the plan is built on a host "
                              f"with TensorRT and the GPU: {build_command(spec)}")
        try:
            trt = import_tensorrt(f"serve {spec.path} with engine.runtime=tensorrt")
        except TensorRTMissing as exc:
            raise EngineError(str(exc)) from None
        if sec.version != trt.__version__:
            raise EngineError(f"{spec.path / sec.plan}: built by TensorRT {sec.version}, this host has "
                              f"{trt.__version__} (a plan runs only on the version that built it); rebuild: "
                              f"{build_command(spec)}")
        if not torch.cuda.is_available():
            raise EngineError("device 'cuda' requested but no CUDA GPU is visible; a TensorRT plan needs one")
        model_dtype = spec.model.torch_dtype
        if dtype is not None and dtype != model_dtype:
            raise EngineError(f"dtype {dtype}: the TensorRT plan computes in {model_dtype} (fixed when its graph "
                              f"was exported); pass no dtype")
        self.dtype = model_dtype
        self.dtype_choice = cpu_dtype.DtypeChoice(model_dtype, "device", "the TensorRT plan's compute dtype")
        major, minor = torch.cuda.get_device_capability(self.device)
        try:
            self.profiles = load_profiles(spec.path / sec.dir / PROFILES)
            self.plugins = register_plugins(spec.path, spec.manifest, major * 10 + minor, self.profiles)
        except (TensorRTFilesError, VariantError, BundleError) as exc:
            raise EngineError(str(exc)) from None
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine((spec.path / sec.plan).read_bytes())
        if self.engine is None:
            raise EngineError(f"{spec.path / sec.plan}: TensorRT could not load the plan (built for another GPU? "
                              f"its log says why); rebuild: {build_command(spec)}")

        cfg = spec.model
        # the pool's dtype as ModelRunner picks it (on a GPU: the KV dtype itself; fp8 stays fp8)
        self.kv_dtype, self.kv_storage_dtype = kv_cache_dtypes(spec, self.dtype, self.device,
                                                               SimpleNamespace(name="tensorrt"))
        self.block_size = spec.engine.kv_block_size
        free = torch.cuda.mem_get_info(self.device)[0]
        self.num_blocks = min(plan_kv_blocks(spec, self.kv_storage_dtype, cfg.num_kv_heads, free),
                              min(d["blocks"][2] for d in self.profiles.dims))   # the plan's limit
        shape = (self.num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [(zeroed(shape, self.kv_storage_dtype, self.device),
                           zeroed(shape, self.kv_storage_dtype, self.device))
                          for _ in range(cfg.num_layers)]
        self.context = self.engine.create_execution_context()
        self.session = PlanSession(self.engine, self.context, self.profiles, self.kv_caches, cfg.vocab_size,
                                   cfg.hidden_size, self.dtype, self.device)

    @property
    def kv_cache_bytes(self) -> int:
        return kv_pool_bytes(self.kv_caches)

    @torch.inference_mode()
    def execute(self, input_ids: torch.Tensor, meta, logits_indices: torch.Tensor,
                capture_hidden_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """One step: fp32 logits [N, V] for ``logits_indices``, and the hidden rows of the captured layers."""
        self.session.check_capture(capture_hidden_layers)
        feeds = graph_io.step_feeds(input_ids, meta, logits_indices)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        out = self.session.run(feeds, int(meta.max_query_len), stream)
        # copies: the session's buffers belong to the next step
        return out.logits.clone(), {layer: out.hidden[layer].clone() for layer in capture_hidden_layers}

    def shutdown(self) -> None:
        """Free the context and the pool (the executor calls this once, at shutdown)."""
        self.session = None    # type: ignore[assignment]
        self.context = None
        self.engine = None
        self.kv_caches = []
