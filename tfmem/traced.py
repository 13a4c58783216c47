"""A TF2 step as one flat graph that tfmem can plan, and back to a function on the same variables.

``trace`` takes a traced ``tf.function`` (a ``ConcreteFunction``) and returns its graph with nested function
calls inlined and functional control flow lowered (Grappler's function optimizer alone, the way TF-TRT
canonicalises a function), each captured variable handle standing as a ``VarHandleOp`` on the variable's
device, tagged ``PINNED_TAG`` (a TF2 variable lives where it was created), so that the simulator sizes it and
no pass moves it. ``rebuild`` turns a rewrite of that graph back into a ``ConcreteFunction`` that captures the
very same handles (``wrap_function.function_from_graph_def``), so it reads and updates the user's variables.

Examples
--------
>>> import tensorflow as tf
>>> v = tf.Variable(tf.ones((4,)), name="v")
>>> @tf.function
... def step(x):
...     v.assign_add(x)
...     return tf.reduce_sum(v * x)
>>> traced = trace(step.get_concrete_function(tf.TensorSpec((4,), tf.float32)))
>>> sorted(n.op for n in traced.graph_def.node if n.name in traced.variables)
['VarHandleOp']
>>> float(rebuild(traced, traced.graph_def)(tf.ones((4,)))[0])
8.0
>>> v.numpy().tolist()
[2.0, 2.0, 2.0, 2.0]
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import tensorflow as tf
from tensorflow.core.framework import graph_pb2, node_def_pb2
from tensorflow.python.eager import wrap_function

from tfmem.errors import BadInputError, MalformedGraphError, first_line
from tfmem.ir.tags import PINNED_TAG, SHAPED_ARGUMENT_TAG
from tfmem.lowering import lower_functional


@dataclass(frozen=True)
class TracedStep:
    """One traced step, flat, with the names that map it back to the function and its variables."""

    graph_def: graph_pb2.GraphDef
    inputs: tuple[str, ...]            # the arguments' placeholders (tensor names), in call order
    outputs: tuple[str, ...]           # the function's outputs (tensor names), flattened
    control_outputs: tuple[str, ...]   # stateful ops the step runs for their effect (variable updates)
    captures: Mapping[str, Any]        # placeholder node -> the eager tensor it stands for
    variables: Mapping[str, tf.Variable]   # the captured variables, by the node that now stands for each
    placeholders: Mapping[str, node_def_pb2.NodeDef]   # each capture's own placeholder, to restore it
    structured_outputs: Any            # how the flat outputs nest (the function's return value)

    @property
    def fetches(self) -> list[str]:
        """What a step must compute: the outputs, and the updates nothing reads."""
        return list(self.outputs) + list(self.control_outputs)


def trace(concrete: Any) -> TracedStep:
    """The flat graph of ``concrete`` (a ``ConcreteFunction``), captured variables as pinned ``VarHandleOp``s.

    Raises ``BadInputError`` for a function XLA compiles (``jit_compile=True``): its graph is replaced by a
    cluster that tfmem cannot plan and a rebuilt function would lose.
    """
    graph = concrete.graph
    gd = graph.as_graph_def()
    if any(n.attr["_XlaMustCompile"].b for n in gd.node if "_XlaMustCompile" in n.attr) or _jit(concrete):
        raise BadInputError("the step is compiled with XLA (jit_compile=True); tfmem plans the TensorFlow graph, "
                            "which XLA replaces: trace it with tf.function(step, jit_compile=False)")
    n_args = len(concrete.inputs) - len(concrete.captured_inputs)
    inputs = tuple(t.name for t in concrete.inputs[:n_args])
    outputs = tuple(t.name for t in concrete.outputs)
    control = tuple(sorted(op.name for op in graph.control_outputs if op.name not in {o.split(":")[0] for o in outputs}))
    by_handle = {id(v.handle): v for v in graph.variables}
    captures: dict[str, Any] = {}
    variables: dict[str, tf.Variable] = {}
    for external, internal in graph.captures:
        captures[internal.op.name] = external
        v = by_handle.get(id(external))
        if v is not None:
            variables[internal.op.name] = v
    flat = lower_functional(gd, [*(o.split(":")[0] for o in outputs), *control])
    placeholders = {}
    arguments = {i.split(":")[0] for i in inputs}
    for node in flat.node:
        if node.name in arguments and node.op == "Placeholder":
            node.attr[SHAPED_ARGUMENT_TAG].b = True
        if node.name in variables:
            placeholders[node.name] = _copy(node)
            _as_variable(node, variables[node.name])
    _colocate_with_variables(flat, variables)
    return TracedStep(flat, inputs, outputs, control, MappingProxyType(captures), MappingProxyType(variables),
                      MappingProxyType(placeholders), concrete.structured_outputs)


def rebuild(traced: TracedStep, graph_def: graph_pb2.GraphDef) -> Any:
    """A ``ConcreteFunction`` running ``graph_def`` (a rewrite of ``traced.graph_def``) on the captured tensors.

    It takes the arguments flat, in ``traced.inputs`` order, and returns the flat outputs (a list).
    """
    gd = graph_pb2.GraphDef()
    gd.CopyFrom(graph_def)
    present = set()
    for i, node in enumerate(gd.node):
        original = traced.placeholders.get(node.name)
        if original is not None:
            gd.node[i].CopyFrom(original)
        present.add(node.name)
    captures = {name: tensor for name, tensor in traced.captures.items() if name in present}
    fetches = list(traced.outputs) + [c for c in traced.control_outputs if c in present]
    try:
        return wrap_function.function_from_graph_def(gd, list(traced.inputs), fetches, captures=captures)
    except (ValueError, TypeError) as e:
        raise MalformedGraphError(f"TensorFlow cannot rebuild a function from the planned graph: {first_line(e)}") from e


def _colocate_with_variables(gd: graph_pb2.GraphDef, variables: Mapping[str, tf.Variable]) -> None:
    """Place each unplaced op that takes a variable's handle on the variable's device, as TensorFlow's placer does
    (a resource op runs where its resource lives): a variable created in host memory is read and updated there,
    and only the values read travel to the device."""
    for node in gd.node:
        if node.device:
            continue
        handles = [i.split(":")[0] for i in node.input if not i.startswith("^") and i.split(":")[0] in variables]
        if handles:
            node.device = variables[handles[0]].device


def _as_variable(node: node_def_pb2.NodeDef, variable: tf.Variable) -> None:
    """Turn a captured handle's placeholder into a ``VarHandleOp`` of ``variable``'s dtype, shape and device."""
    name, device = node.name, variable.device
    node.Clear()
    node.name, node.op, node.device = name, "VarHandleOp", device
    node.attr["dtype"].type = variable.dtype.as_datatype_enum
    node.attr["shape"].shape.CopyFrom(variable.shape.as_proto())
    node.attr["container"].s = b""
    node.attr["shared_name"].s = f"tfmem_traced/{name}".encode()
    node.attr[PINNED_TAG].b = True


def _copy(node: node_def_pb2.NodeDef) -> node_def_pb2.NodeDef:
    out = node_def_pb2.NodeDef()
    out.CopyFrom(node)
    return out


def _jit(concrete: Any) -> bool:
    """Whether the ``tf.function`` behind ``concrete`` was declared with ``jit_compile=True``."""
    attrs = getattr(concrete, "_attrs", None) or {}
    value = attrs.get("_XlaMustCompile")
    return bool(getattr(value, "b", value))
