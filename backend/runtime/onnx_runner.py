"""``engine.runtime: onnx-reference``: a step is the bundle's ``decoder.onnx``, run by onnx's ReferenceEvaluator.

This is the TensorRT target checked without TensorRT: the same graph a plan is built from, its standard
nodes evaluated by onnx's reference implementation, its Kiln nodes by the kernels' PyTorch references
(backend/runtime/onnx_ops.py), the KV pool owned here and handed to the graph as inputs, exactly as the
TensorRT runner binds it. It is slow (numpy, one thread) and exists to prove the graph, not to serve.

Precision: the graph computes in the model's dtype (bf16 for TensorRT). ReferenceEvaluator has no fast
or bit-faithful bf16, so by default this runner evaluates the graph in float32: every cast to the compute
dtype (after each weight, onnx_export.py puts them there) is retargeted to float32, and a pool in the
model dtype becomes float32 too; fp8 weights, activations and KV stay fp8. Parity is then checked
against the native runner in float32. ``engine.cpu_dtype`` bfloat16 (or ``dtype=``) keeps the graph's
own types.
"""
from __future__ import annotations

from pathlib import Path

import torch

from backend.logs import get_logger
from backend.runtime import cpu_dtype, graph_io
from backend.runtime.kv_plan import KV_DTYPES, kv_pool_bytes, plan_kv_blocks, zeroed
from backend.runtime.spec import EngineError, EngineSpec
from backend.runtime.runtimes import StepRunner

_LOG = get_logger("model.onnx_runner")


def load_graph(graph: Path, weights_dir: Path, compute: torch.dtype | None = None):
    """The graph with its external data read from ``weights_dir`` (the bundle root), its compute-dtype
    casts retargeted to ``compute`` when given."""
    import onnx
    model = onnx.load(str(graph), load_external_data=False)
    onnx.load_external_data_for_model(model, str(weights_dir))
    if compute is not None:
        retarget(model, _onnx_type(compute))
    return model


def _onnx_type(dtype: torch.dtype) -> int:
    from onnx import TensorProto
    return {torch.float32: TensorProto.FLOAT, torch.bfloat16: TensorProto.BFLOAT16,
            torch.float16: TensorProto.FLOAT16}[dtype]


def graph_dtype(model) -> int:
    """The compute dtype the graph was exported in: the type of its ``embed.cast``."""
    for node in model.graph.node:
        if node.name == "embed.cast":
            return next(a.i for a in node.attribute if a.name == "to")
    raise EngineError("decoder.onnx: no embed.cast node; rebuild with OVERRIDES=\"tensorrt.enabled=true\"")


def retarget(model, to: int) -> None:
    """Evaluate the graph in ``to``: every Cast to the graph's compute dtype, and every graph input or
    output of that type (the pool, captured hidden states), now uses ``to``. Nothing else changes."""
    src = graph_dtype(model)
    if src == to:
        return
    for node in model.graph.node:
        if node.op_type == "Cast":
            for a in node.attribute:
                if a.name == "to" and a.i == src:
                    a.i = to
    for v in (*model.graph.input, *model.graph.output):
        if v.type.tensor_type.elem_type == src:
            v.type.tensor_type.elem_type = to


def fold_constants(model) -> dict:
    """Evaluate once the standard nodes whose inputs are all initializers (each weight's Cast,
    DequantizeLinear, Transpose) and turn their results into graph inputs fed every step: the same
    numbers, without redoing 1.9 s of weight conversions per step (SmolLM2 fp8). Returns the values."""
    from onnx import helper
    from onnx.reference import ReferenceEvaluator
    known = {i.name for i in model.graph.initializer}
    const, rest = [], []
    for node in model.graph.node:
        if node.domain == "" and node.input and all(x in known for x in node.input):
            const.append(node)
            known.update(node.output)
        else:
            rest.append(node)
    if not const:
        return {}
    used = {x for node in rest for x in node.input} | {o.name for o in model.graph.output}
    needed = [o for node in const for o in node.output if o in used]
    sub = helper.make_model(helper.make_graph(const, "constants", [], [helper.make_empty_tensor_value_info(n) for n in needed],
                                              initializer=list(model.graph.initializer)),
                            opset_imports=list(model.opset_import))
    values = dict(zip(needed, ReferenceEvaluator(sub).run(needed, {})))
    del model.graph.node[:]
    model.graph.node.extend(rest)
    keep = [i for i in model.graph.initializer if i.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)
    model.graph.input.extend(helper.make_empty_tensor_value_info(n) for n in needed)
    return values


class OnnxReferenceRunner(StepRunner):
    """The StepRunner of backend/runtime/runtimes.py over the bundle's decoder graph (CPU only)."""

    def __init__(self, spec: EngineSpec, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                 weights=None, graph: Path | None = None) -> None:
        from onnx.reference import ReferenceEvaluator
        from backend.runtime.onnx_ops import CUSTOM_OPS
        self.spec = spec
        self.device = torch.device(device)
        if self.device.type != "cpu":
            raise EngineError(f"engine.runtime onnx-reference runs on the CPU (device {device} asked); "
                              f"allowed there: native, tensorrt")
        trt = spec.manifest.tensorrt
        if trt is None and graph is None:
            raise EngineError(f"{spec.path}: engine.runtime onnx-reference needs the bundle's decoder.onnx; "
                              f"rebuild with OVERRIDES=\"tensorrt.enabled=true\"")
        self.graph_path = graph or spec.path / trt.graph
        self.dtype_choice = self._choose_dtype(dtype)
        self.dtype = self.dtype_choice.dtype
        model = load_graph(self.graph_path, spec.path, self.dtype)
        self.outputs = [o.name for o in model.graph.output]
        self.captures = {int(n.split(".")[1]) for n in self.outputs if n.startswith("hidden.")}
        self.constants = fold_constants(model)
        self.session = ReferenceEvaluator(model, new_ops=CUSTOM_OPS)
        cfg = spec.model
        kv = KV_DTYPES.get(spec.kv_cache_dtype)
        if kv is None:
            raise EngineError(f"engine.kv_cache_dtype: {spec.kv_cache_dtype!r}; allowed: {', '.join(KV_DTYPES)}")
        # fp8 stays fp8 (the graph's pool inputs are fp8); a model-dtype pool follows the compute dtype
        self.kv_dtype = kv if kv == torch.float8_e4m3fn else self.dtype
        self.block_size = spec.engine.kv_block_size
        self.num_blocks = plan_kv_blocks(spec, self.kv_dtype, cfg.num_kv_heads, None)
        shape = (self.num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [(zeroed(shape, self.kv_dtype, "cpu"), zeroed(shape, self.kv_dtype, "cpu"))
                          for _ in range(cfg.num_layers)]
        _LOG.info("onnx-reference runner: %s in %s, %d KV blocks", self.graph_path.name, self.dtype, self.num_blocks)

    def _choose_dtype(self, dtype: torch.dtype | None) -> cpu_dtype.DtypeChoice:
        if dtype is not None:
            return cpu_dtype.DtypeChoice(dtype, "dtype=", "the caller's dtype argument")
        asked = self.spec.engine.cpu_dtype
        if asked == "auto":
            return cpu_dtype.DtypeChoice(torch.float32, asked, "onnx-reference evaluates the graph in float32 "
                                         "(its casts retargeted; onnx_runner.py says why)")
        return cpu_dtype.DtypeChoice(getattr(torch, asked), asked, "engine.cpu_dtype")

    @property
    def kv_cache_bytes(self) -> int:
        return kv_pool_bytes(self.kv_caches)

    @torch.inference_mode()
    def execute(self, input_ids: torch.Tensor, meta, logits_indices: torch.Tensor,
                capture_hidden_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        from backend.runtime.onnx_ops import to_numpy, to_torch
        missing = set(capture_hidden_layers) - self.captures
        if missing:
            raise EngineError(f"{self.graph_path.name}: layers {sorted(missing)} are not graph outputs "
                              f"(captured: {sorted(self.captures)}); rebuild the bundle with that draft")
        feeds = dict(self.constants)
        feeds |= {k: to_numpy(v.contiguous()) for k, v in graph_io.step_feeds(input_ids, meta, logits_indices).items()}
        for i, (k, v) in enumerate(self.kv_caches):
            feeds[graph_io.k_cache(i)], feeds[graph_io.v_cache(i)] = to_numpy(k), to_numpy(v)
        names = [graph_io.LOGITS] + [graph_io.hidden_out(i) for i in capture_hidden_layers]
        results = self.session.run(names, feeds)
        captured = {i: to_torch(r) for i, r in zip(capture_hidden_layers, results[1:])}
        return to_torch(results[0]).float(), captured

    def shutdown(self) -> None:
        self.session = None
