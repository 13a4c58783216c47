"""What TensorFlow's executor folds into constants after Grappler, for the simulator.

Grappler is not the last rewrite a session makes: when a device's executor is built, TF's older graph optimizer
runs its own constant folding on that device's partition. Its rules differ from Grappler's: it folds an op
whose *data* inputs are all constant even when control edges from other ops gate it (it moves those edges onto
the new constant), where Grappler leaves such an op alone. The new ``Const`` kernels hold their tensors for as
long as the session lives, so the folded values are persistent device memory
(``tests/test_memsim.py::test_executor_folds_gated_constants_into_persistent_memory``).

``fold_like_executor`` marks the same folds in a runtime graph: each folded output of 64 KiB or more becomes a
``Const`` of its shape (its value is not needed to count memory) that its readers read instead; smaller folded
outputs are left to run (their bytes are noise, and a folded slice bound must keep its value for the views rule).
"""

from __future__ import annotations

from collections.abc import Iterable
from types import MappingProxyType

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, tensor_pb2, tensor_shape_pb2
from tensorflow.python.framework import op_def_registry

from tfmem.ir.devices import same_device
from tfmem.ir.graph import GraphIR, OpNode, TensorRef, TensorSpec
from tfmem.ir.ops import NEVER_FOLDED, PERSISTENT_OUTPUT_OPS

# TF's ConstantFoldingOptions default: a larger result is not turned into a constant.
MAX_CONSTANT_BYTES = 10 * 2**20
# Folded outputs smaller than this keep running in the simulation (see the module docstring).
MIN_REPLACED_BYTES = 64 * 1024
FOLDED_ATTR = "_tfmem_executor_folded"


def fold_like_executor(graph: GraphIR, fetches: Iterable[str] = ()) -> GraphIR:
    """``graph`` (annotated, after Grappler) with what the executor would fold replaced by constants.

    Examples
    --------
    >>> import tensorflow as tf
    >>> from tfmem.ir.loading import load
    >>> g = tf.Graph()
    >>> with g.as_default():
    ...     x = tf.compat.v1.placeholder(tf.float32, (256, 256), name="x")
    ...     with tf.control_dependencies([x.op]):        # gated by a non-constant op: Grappler leaves it
    ...         ones = tf.fill((256, 256), 1.0, name="ones")
    ...     y = tf.add(x, ones, name="y")
    >>> folded = fold_like_executor(load(g), ["y:0"])
    >>> [(t.node, folded[t.node].op) for t in folded["y"].inputs]
    [('x', 'Placeholder'), ('ones__cf__0', 'Const')]
    >>> folded["ones__cf__0"].control_inputs           # the gate moves onto the constant
    ('x',)
    """
    fetched = {TensorRef.parse(f) if ":" in f else TensorRef(f, 0) for f in fetches}
    constant: set[str] = set()
    gates: dict[str, set[str]] = {}   # folded op -> the non-constant ops whose control edges it inherits
    for node in _topological(graph):
        if node.op in PERSISTENT_OUTPUT_OPS:
            constant.add(node.name)
            gates[node.name] = set(node.control_inputs)
        elif node.inputs and _foldable(node) and all(
                t.node in constant and same_device(graph[t.node].device, node.device) for t in node.inputs):
            constant.add(node.name)
            gates[node.name] = {c for c in node.control_inputs if c not in constant}.union(
                *(gates[t.node] for t in node.inputs))
    replaced: dict[TensorRef, OpNode] = {}
    for name in constant:
        node = graph[name]
        if node.op in PERSISTENT_OUTPUT_OPS:
            continue
        for i, spec in enumerate(node.outputs):
            t = TensorRef(name, i)
            readers = [c for c in graph.consumers.get(t, ()) if c not in constant]
            if readers and t not in fetched and MIN_REPLACED_BYTES <= (spec.nbytes or 0) <= MAX_CONSTANT_BYTES:
                replaced[t] = _shaped_const(f"{name}__cf__{len(replaced)}", node.device, spec,
                                            sorted(gates[name] - constant))
    if not replaced:
        return graph
    nodes: list[OpNode] = []
    placed: set[str] = set()
    for node in graph.nodes:
        if node.name not in constant and any(t in replaced for t in node.inputs):
            for t in node.inputs:
                if t in replaced and replaced[t].name not in placed:
                    placed.add(replaced[t].name)
                    nodes.append(replaced[t])
            node = OpNode(node.name, node.op, tuple(replaced[t].output() if t in replaced else t for t in node.inputs),
                          node.control_inputs, node.device, node.outputs, node.attrs, node.proto)
        nodes.append(node)
    return graph.replace_nodes(tuple(nodes))


def _foldable(node: OpNode) -> bool:
    if node.op in NEVER_FOLDED:
        return False
    op_def = op_def_registry.get(node.op)
    return op_def is not None and not op_def.is_stateful and bool(node.outputs) and all(
        s.nbytes is not None and s.nbytes <= MAX_CONSTANT_BYTES for s in node.outputs)


def _shaped_const(name: str, device: str, spec: TensorSpec, gates: list[str]) -> OpNode:
    """A ``Const`` with ``spec``'s dtype and shape (no values: the simulator counts bytes, never reads them)."""
    dtype = tf.as_dtype(spec.dtype).as_datatype_enum
    shape = tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=d or 0)
                                                   for d in (spec.shape or ())])
    attrs = {"dtype": attr_value_pb2.AttrValue(type=dtype),
             "value": attr_value_pb2.AttrValue(tensor=tensor_pb2.TensorProto(dtype=dtype, tensor_shape=shape)),
             FOLDED_ATTR: attr_value_pb2.AttrValue(b=True)}
    return OpNode(name, "Const", (), tuple(gates), device, (spec,), MappingProxyType(attrs))


def _topological(graph: GraphIR) -> list[OpNode]:
    """The nodes with every node after its predecessors (Grappler's output need not be ordered so).

    A loop's back edge (``NextIteration`` into ``Merge``) is skipped where it closes a cycle; neither op folds.
    """
    done: set[str] = set()
    entered: set[str] = set()
    out: list[OpNode] = []
    for root in graph.nodes:
        stack = [(root.name, False)]
        while stack:
            name, expanded = stack.pop()
            if expanded:
                done.add(name)
                out.append(graph[name])
                continue
            if name in entered:
                continue
            entered.add(name)
            stack.append((name, True))
            stack.extend((p, False) for p in graph[name].predecessors if p not in entered and p in graph)
    return out
