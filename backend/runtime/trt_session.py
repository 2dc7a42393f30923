"""One TensorRT plan's execution context, step by step: pick the optimization profile, bind every graph
input and output by name, enqueue. Device-agnostic (the tensors' addresses are all it passes), so it is
tested on CPU tensors against a mock TensorRT; ``TensorRTRunner`` (trt_runner.py) runs it on the GPU.

Binding rules (backend/runtime/graph_io.py is the contract):
- step inputs come from ``graph_io.step_feeds``, converted to the plan's dtype where they differ;
- ``k_cache.{i}``/``v_cache.{i}`` are the KV pool's tensors; ``k_cache_out.{i}``/``v_cache_out.{i}``
  alias them: bound to the same address, so the graph's writes land in the pool;
- ``logits`` and ``hidden.{i}`` go to buffers preallocated for the profiles' largest step; the caller
  copies the rows it keeps before the next step overwrites them;
- a zero-size input (the tree mask of a step without a tree: [T, 0]) is bound to an all-True buffer of
  ``max tokens`` bytes, never to a null pointer: the prefill plugin compiled with a tree mask reads it
  at row stride 0 then, i.e. every query may see every new token of its sequence, and causality alone
  masks (the native wrapper runs the no-tree variant for such a step; a plan has one variant per layer).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.runtime import graph_io
from backend.runtime.spec import EngineError
from backend.runtime.trt_files import Profiles

# trt.DataType member name -> torch dtype
TORCH_DTYPES = {"FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16, "INT32": torch.int32,
                "INT64": torch.int64, "BOOL": torch.bool, "FP8": torch.float8_e4m3fn, "UINT8": torch.uint8,
                "INT8": torch.int8}


def step_dims(profiles: Profiles, shapes: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """The symbolic dims' values in one step (every input's shape read against profiles.json)."""
    dims: dict[str, int] = {}
    for name, spec in profiles.inputs.items():
        shape = shapes[name]
        if len(shape) != len(spec):
            raise EngineError(f"TensorRT plan input {name}: shape {tuple(shape)}, profiles.json gives {len(spec)} dims")
        for k, (d, v) in enumerate(zip(spec, shape)):
            if isinstance(d, int):
                if v != d:
                    raise EngineError(f"TensorRT plan input {name}: dim {k} is {v}, the plan fixes it at {d}")
            elif dims.setdefault(d, v) != v:
                raise EngineError(f"TensorRT plan input {name}: dim {k} ({d}) is {v}, another input has {dims[d]}")
    return dims


def _fits(ranges: dict[str, tuple[int, int, int]], dims: dict[str, int]) -> str | None:
    """None when every dim is in range, else the first that is not."""
    for d, v in dims.items():
        lo, _, hi = ranges[d]
        if not lo <= v <= hi:
            return f"{d}={v} outside [{lo}, {hi}]"
    return None


def choose_profile(profiles: Profiles, dims: dict[str, int], max_query_len: int) -> int:
    """generation when every sequence has at most 1 + draft tokens (the generation profile's tokens per
    sequence) and the step fits it, else context; a step neither fits is refused naming the dim."""
    if "generation" in profiles.names:
        g = profiles.index("generation")
        ranges = profiles.dims[g]
        per_seq = ranges["tokens"][2] // max(1, ranges["seqs"][2])
        if max_query_len <= per_seq and _fits(ranges, dims) is None:
            return g
    order = [profiles.index("context")] if "context" in profiles.names else []
    order += [i for i in range(len(profiles.names)) if i not in order]
    why = []
    for i in order:
        bad = _fits(profiles.dims[i], dims)
        if bad is None:
            return i
        why.append(f"{profiles.names[i]}: {bad}")
    raise EngineError(f"this step fits no optimization profile of the TensorRT plan ({'; '.join(why)}); "
                      f"the scheduler's limits (engine.max_num_tokens, max_batch_size) exceed the plan's")


@dataclass(frozen=True)
class Outputs:
    logits: torch.Tensor                    # fp32 [rows, vocab], a view of the session's buffer
    hidden: dict[int, torch.Tensor]         # layer -> [tokens, hidden], views


class PlanSession:
    """Binds and enqueues steps on ``context`` (an IExecutionContext of ``engine``)."""

    def __init__(self, engine, context, profiles: Profiles, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        import tensorrt as trt
        self.engine, self.context, self.profiles, self.kv_caches = engine, context, profiles, kv_caches
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        is_input = {n: engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT for n in names}
        self.inputs = [n for n in names if is_input[n]]
        self.outputs = [n for n in names if not is_input[n]]
        self.dtypes = {n: TORCH_DTYPES[engine.get_tensor_dtype(n).name] for n in self.inputs}
        if engine.num_optimization_profiles != len(profiles.names):
            raise EngineError(f"the TensorRT plan has {engine.num_optimization_profiles} optimization profiles, "
                              f"{profiles.path} {len(profiles.names)}; rebuild the plan: make engine-plan")
        missing = sorted(set(self.inputs) ^ set(profiles.inputs))
        if missing:
            raise EngineError(f"the TensorRT plan's inputs and {profiles.path} differ ({', '.join(missing)}); "
                              f"rebuild the plan: make engine-plan")
        self.caches = {}
        for i, (k, v) in enumerate(kv_caches):
            self.caches.update({graph_io.k_cache(i): k, graph_io.v_cache(i): v})
        self.aliases = {graph_io.k_cache_out(i): graph_io.k_cache(i) for i in range(len(kv_caches))}
        self.aliases.update({graph_io.v_cache_out(i): graph_io.v_cache(i) for i in range(len(kv_caches))})
        self.hidden_layers = {n: int(n.split(".")[1]) for n in self.outputs if n.startswith("hidden.")}
        unknown = set(self.outputs) - set(self.aliases) - set(self.hidden_layers) - {graph_io.LOGITS}
        if unknown or graph_io.LOGITS not in self.outputs:
            raise EngineError(f"the TensorRT plan's outputs {sorted(self.outputs)} are not the decoder graph's "
                              f"(logits, k/v_cache_out.i, hidden.i); rebuild the bundle and the plan")
        rows, tokens = profiles.max_dim("rows"), profiles.max_dim("tokens")
        self.logits = torch.empty((rows, vocab_size), dtype=torch.float32, device=device)
        self.hidden = {n: torch.empty((tokens, hidden_size), dtype=dtype, device=device) for n in self.hidden_layers}
        # what a zero-size input is bound to (see the module docstring)
        self.all_true = torch.ones(max(1, tokens), dtype=torch.bool, device=device)
        self.profile: int | None = None
        self._held: dict[str, torch.Tensor] = {}

    def check_capture(self, layers: tuple[int, ...]) -> None:
        """Refuse capturing a layer the plan does not output (hidden.i are graph outputs or nothing)."""
        have = sorted(self.hidden_layers.values())
        missing = sorted(set(layers) - set(have))
        if missing:
            raise EngineError(f"capture of hidden layers {missing}: the TensorRT plan outputs only {have or 'none'} "
                              f"(the graph's hidden.i); rebuild the bundle with the draft head these layers feed")

    def run(self, feeds: dict[str, torch.Tensor], max_query_len: int, stream: int) -> Outputs:
        """Bind one step (``graph_io.step_feeds``) and enqueue it on ``stream``."""
        tensors = dict(self.caches)
        for name, t in feeds.items():
            want = self.dtypes.get(name)
            if want is None:
                raise EngineError(f"step input {name} is not an input of the TensorRT plan; rebuild the plan")
            tensors[name] = t.to(want).contiguous() if t.dtype != want or not t.is_contiguous() else t
        absent = [n for n in self.inputs if n not in tensors]
        if absent:
            raise EngineError(f"the TensorRT plan needs inputs {absent} that no step provides; rebuild the bundle")
        profile = choose_profile(self.profiles, step_dims(self.profiles, {n: tuple(t.shape) for n, t in
                                                                          tensors.items()}), max_query_len)
        ctx = self.context
        if profile != self.profile:
            if not ctx.set_optimization_profile_async(profile, stream):
                raise EngineError(f"TensorRT refused optimization profile {self.profiles.names[profile]!r}")
            self.profile = profile
        for name in self.inputs:
            t = tensors[name]
            if not ctx.set_input_shape(name, tuple(t.shape)):
                raise EngineError(f"TensorRT refused input {name} of shape {tuple(t.shape)} "
                                  f"(profile {self.profiles.names[profile]})")
            ctx.set_tensor_address(name, t.data_ptr() if t.numel() else self.all_true.data_ptr())
        rows, tokens = feeds["logits_indices"].shape[0], feeds["input_ids"].shape[0]
        for name in self.outputs:
            if name in self.aliases:
                addr = tensors[self.aliases[name]].data_ptr()   # in place: the pool itself
            elif name == graph_io.LOGITS:
                addr = self.logits.data_ptr()
            else:
                addr = self.hidden[name].data_ptr()
            ctx.set_tensor_address(name, addr)
        self._held = tensors    # converted feeds must outlive the enqueued step
        if not ctx.execute_async_v3(stream):
            raise EngineError("TensorRT failed to enqueue the step (its log says why)")
        return Outputs(self.logits[:rows], {layer: self.hidden[n][:tokens] for n, layer in self.hidden_layers.items()})
