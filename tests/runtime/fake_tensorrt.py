"""A MOCK of NVIDIA TensorRT's Python API (``tensorrt`` and ``tensorrt.plugin``), for tests only.

TensorRT cannot be installed on this project's machines (shared/notes/environment.md: the wheels
download from NVIDIA's index, which is unreachable), so the plan builder and the plan runner are tested
up to the TensorRT call against this stand-in. It implements only what Kiln calls, with the names and
signatures of TensorRT's documentation, RECORDS every call (``Fake.calls``) so tests can check what
Kiln asked TensorRT to do, and builds nothing real: its "plan" is JSON naming the network's inputs,
outputs and profiles. Where TensorRT's own Python code validates (the schemas ``tensorrt.plugin``
checks with ``inspect.signature``), the mock applies the same documented rules, so a plugin signature
Kiln builds wrong fails here too. Every test that uses it says so in its docstring.

``install(monkeypatch, ...)`` puts fresh ``tensorrt`` and ``tensorrt.plugin`` modules into
``sys.modules`` and returns the ``Fake`` holding their state; ``tensorrt.plugin``'s part lives in
fake_tensorrt_plugin.py.
"""
from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass, field

from tests.runtime.fake_tensorrt_plugin import make_module


class DataType:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"DataType.{self.name}"


DTYPES = {n: DataType(n) for n in ("FLOAT", "HALF", "BF16", "INT8", "INT32", "INT64", "BOOL", "UINT8", "FP8")}
# onnx TensorProto elem_type -> DataType name
ONNX_TYPES = {1: "FLOAT", 10: "HALF", 16: "BF16", 3: "INT8", 6: "INT32", 7: "INT64", 9: "BOOL", 2: "UINT8", 17: "FP8"}


@dataclass
class Fake:
    version: str
    fail_parse: bool = False
    fail_build: bool = False
    calls: list = field(default_factory=list)        # (what, details) in call order
    plugins: dict = field(default_factory=dict)      # plugin id -> {"register", "autotune", "aot_impl", ...}
    executed: list = field(default_factory=list)     # one snapshot per execute_async_v3
    trt: types.ModuleType | None = None
    plugin: types.ModuleType | None = None

    def called(self, what: str) -> list:
        return [d for w, d in self.calls if w == what]


# ---- tensorrt ------------------------------------------------------------------------------------

def _make_trt_module(fake: Fake) -> types.ModuleType:
    m = types.ModuleType("tensorrt")
    m.__version__ = fake.version
    m.DataType = types.SimpleNamespace(**DTYPES)
    m.TensorIOMode = types.SimpleNamespace(INPUT="INPUT", OUTPUT="OUTPUT")
    m.NetworkDefinitionCreationFlag = types.SimpleNamespace(STRONGLY_TYPED=1, PREFER_AOT_PYTHON_PLUGINS=2,
                                                            PREFER_JIT_PYTHON_PLUGINS=3)
    m.MemoryPoolType = types.SimpleNamespace(WORKSPACE="WORKSPACE")
    m.PreviewFeature = types.SimpleNamespace(ALIASED_PLUGIN_IO_10_03="ALIASED_PLUGIN_IO_10_03")

    class Logger:
        WARNING, INFO, ERROR, VERBOSE = "WARNING", "INFO", "ERROR", "VERBOSE"

        def __init__(self, min_severity="WARNING"):
            self.min_severity = min_severity

    class Network:
        def __init__(self, flags):
            self.flags, self.inputs, self.outputs = flags, [], []

        num_inputs = property(lambda self: len(self.inputs))
        num_outputs = property(lambda self: len(self.outputs))

        def get_input(self, i):
            return self.inputs[i]

        def get_output(self, i):
            return self.outputs[i]

    class OnnxParser:
        def __init__(self, network, logger):
            self.network, self.errors = network, []

        def parse(self, model, path=None):
            import onnx
            fake.calls.append(("parse", {"bytes": bytes(model), "path": path}))
            if fake.fail_parse:
                self.errors = ["In node 3 (kiln_paged_prefill): UNSUPPORTED_NODE: mock parse failure"]
                return False
            graph = onnx.load_model_from_string(bytes(model)).graph
            ts = lambda vs: [types.SimpleNamespace(name=v.name, dtype=DTYPES[ONNX_TYPES[v.type.tensor_type.elem_type]])
                             for v in vs]
            self.network.inputs, self.network.outputs = ts(graph.input), ts(graph.output)
            return True

        num_errors = property(lambda self: len(self.errors))

        def get_error(self, i):
            return self.errors[i]

    class TimingCache:
        def __init__(self, data):
            self.data = bytes(data)

        def serialize(self):
            return self.data + b"+tuned"

    class Profile:
        def __init__(self):
            self.shapes = {}

        def set_shape(self, name, min, opt, max):
            self.shapes[name] = (tuple(min), tuple(opt), tuple(max))

    class Config:
        def __init__(self):
            self.profiles, self.cache = [], None

        def set_memory_pool_limit(self, pool, size):
            fake.calls.append(("set_memory_pool_limit", (pool, size)))

        def set_preview_feature(self, feature, enable):
            fake.calls.append(("set_preview_feature", (feature, enable)))

        def add_optimization_profile(self, profile):
            self.profiles.append(profile)
            return len(self.profiles) - 1

        def create_timing_cache(self, data):
            fake.calls.append(("create_timing_cache", bytes(data)))
            return TimingCache(data)

        def set_timing_cache(self, cache, ignore_mismatch):
            self.cache = cache
            return True

        def get_timing_cache(self):
            return self.cache

    class Builder:
        def __init__(self, logger):
            self.logger = logger

        def create_network(self, flags=0):
            fake.calls.append(("create_network", flags))
            return Network(flags)

        def create_builder_config(self):
            return Config()

        def create_optimization_profile(self):
            return Profile()

        def build_serialized_network(self, network, config):
            fake.calls.append(("build_serialized_network", [p.shapes for p in config.profiles]))
            if fake.fail_build:
                return None
            io = [[t.name, "INPUT", t.dtype.name] for t in network.inputs]
            io += [[t.name, "OUTPUT", t.dtype.name] for t in network.outputs]
            profiles = [{n: [list(s) for s in v] for n, v in p.shapes.items()} for p in config.profiles]
            return json.dumps({"mock_plan": fake.version, "io": io, "profiles": profiles}).encode()

    class Context:
        def __init__(self, engine):
            self.engine, self.profile, self.shapes, self.addresses = engine, None, {}, {}

        def set_optimization_profile_async(self, index, stream):
            fake.calls.append(("set_optimization_profile_async", index))
            self.profile = index
            return 0 <= index < self.engine.num_optimization_profiles

        def set_input_shape(self, name, shape):
            lo, _, hi = self.engine.get_tensor_profile_shape(name, self.profile)
            ok = len(shape) == len(lo) and all(a <= s <= b for a, s, b in zip(lo, shape, hi))
            self.shapes[name] = tuple(shape)
            return ok

        def set_tensor_address(self, name, ptr):
            if name not in self.engine.modes or not isinstance(ptr, int) or ptr == 0:
                raise ValueError(f"set_tensor_address({name!r}, {ptr!r})")
            self.addresses[name] = ptr
            return True

        def execute_async_v3(self, stream_handle):
            unbound = [n for n in self.engine.modes if n not in self.addresses]
            unshaped = [n for n, mo in self.engine.modes.items() if mo == "INPUT" and n not in self.shapes]
            if unbound or unshaped:
                raise AssertionError(f"execute with unbound {unbound} / unshaped {unshaped}")
            fake.executed.append({"profile": self.profile, "shapes": dict(self.shapes),
                                  "addresses": dict(self.addresses), "stream": stream_handle})
            return True

    class Engine:
        def __init__(self, doc):
            self.names = [n for n, _, _ in doc["io"]]
            self.modes = {n: mo for n, mo, _ in doc["io"]}
            self.dtypes = {n: DTYPES[d] for n, _, d in doc["io"]}
            self.profile_shapes = doc["profiles"]

        num_io_tensors = property(lambda self: len(self.names))
        num_optimization_profiles = property(lambda self: len(self.profile_shapes))

        def get_tensor_name(self, i):
            return self.names[i]

        def get_tensor_mode(self, name):
            return self.modes[name]

        def get_tensor_dtype(self, name):
            return self.dtypes[name]

        def get_tensor_profile_shape(self, name, index):
            return [tuple(s) for s in self.profile_shapes[index][name]]

        def create_execution_context(self):
            return Context(self)

    class Runtime:
        def __init__(self, logger):
            self.logger = logger

        def deserialize_cuda_engine(self, data):
            doc = json.loads(bytes(data))
            return Engine(doc) if doc.get("mock_plan") == fake.version else None

    for cls in (Logger, OnnxParser, Builder, Runtime):
        setattr(m, cls.__name__, cls)
    return m


def install(monkeypatch, version: str = "11.3.0.1-mock", **flags) -> Fake:
    """Fresh mock ``tensorrt`` / ``tensorrt.plugin`` modules in sys.modules for one test."""
    fake = Fake(version, **flags)
    fake.trt, fake.plugin = _make_trt_module(fake), make_module(fake)
    fake.trt.plugin = fake.plugin
    monkeypatch.setitem(sys.modules, "tensorrt", fake.trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", fake.plugin)
    return fake


def uninstall(monkeypatch) -> None:
    """Make ``import tensorrt`` fail, as on this project's machines (also where one is installed)."""
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", None)


def build_time_calls(fake: Fake, plugin_id: str, inputs: dict[str, tuple[tuple[int, ...], str]], attrs: dict):
    """What TensorRT does with a registered plugin while building (fake_tensorrt_plugin.build_time_calls)."""
    from tests.runtime import fake_tensorrt_plugin
    return fake_tensorrt_plugin.build_time_calls(fake, plugin_id, inputs, attrs, DTYPES)
