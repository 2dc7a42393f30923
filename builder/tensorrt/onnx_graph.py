"""A small ONNX graph writer: named nodes, constants and external initializers, in order.

Every node gets a readable unique name (``layers.3.qkv.matmul``) so a TensorRT build log or a
profile points at the decoder part it came from.
"""
from __future__ import annotations

import numpy as np
from onnx import NodeProto, TensorProto, helper, numpy_helper

from .safetensors_refs import TensorRef, external_initializer

# the plugin namespace TensorRT looks Kiln's plugins up in; the node domain keeps onnx.checker able
# to tell Kiln's custom ops from standard ones
KILN_DOMAIN = "kiln"
PLUGIN_NAMESPACE = "kiln"


class Graph:
    def __init__(self, weights_location: str, refs: dict[str, TensorRef]) -> None:
        self.location = weights_location
        self.refs = refs
        self.nodes: list[NodeProto] = []
        self.initializers: dict[str, TensorProto] = {}
        self._count = 0

    def weight(self, name: str) -> str:
        """The bundle tensor ``name`` as an initializer (added once; its bytes stay in the weights file)."""
        if name not in self.initializers:
            if name not in self.refs:
                raise KeyError(f"{self.location}: missing tensor {name!r}")
            self.initializers[name] = external_initializer(self.refs[name], self.location)
        return name

    def has(self, name: str) -> bool:
        return name in self.refs

    def const(self, name: str, value: np.ndarray) -> str:
        if name not in self.initializers:
            self.initializers[name] = numpy_helper.from_array(np.asarray(value), name)
        return name

    def node(self, op: str, inputs: list[str], name: str, outputs: int | list[str] = 1,
             domain: str = "", **attrs) -> list[str]:
        """Append one node; returns its output names (``<name>`` or ``<name>.<i>`` unless given)."""
        if isinstance(outputs, int):
            outputs = [name] if outputs == 1 else [f"{name}.{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op, inputs, outputs, name=name, domain=domain, **attrs))
        return outputs

    def op(self, op: str, inputs: list[str], name: str, **attrs) -> str:
        """A one-output node."""
        return self.node(op, inputs, name, 1, **attrs)[0]

    def plugin(self, op: str, inputs: list[str], name: str, outputs: list[str], **attrs) -> list[str]:
        """A Kiln custom node: TensorRT resolves it as plugin ``PLUGIN_NAMESPACE::op``; ``aot=1`` asks
        its ONNX parser for the ahead-of-time implementation (the PTX), as NVIDIA's plugin samples do."""
        return self.node(op, inputs, name, outputs, domain=KILN_DOMAIN, plugin_namespace=PLUGIN_NAMESPACE, aot=1,
                         **attrs)

    def cast(self, x: str, to: int, name: str) -> str:
        return self.op("Cast", [x], name, to=to)


def value_info(name: str, elem_type: int, dims: tuple) -> "helper.ValueInfoProto":
    return helper.make_tensor_value_info(name, elem_type, list(dims))
