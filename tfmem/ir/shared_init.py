"""Variables that start out sharing one buffer, and the updates that give each its own in a session's first step.

A session initialises resource variables by running their ``AssignVariableOp`` initializers, and Grappler merges
identical constants in that init graph: every variable initialised to the same constant (zeros of one shape,
for the momentum or Adam slots of same-shaped weights, biases, batch-norm betas; ones for batch-norm gammas)
then holds the one buffer. The first in-place update of such a variable finds the buffer shared and copies it
into a new chunk, allocated mid-step and kept for the session (TF's copy-on-write in ``PrepareToUpdateVariable``);
the last holder of a buffer keeps it. Those small chunks, left between the first step's activations, split
the free memory of every later step, so a large request can find no free chunk (``tests/test_guarantee.py``: a
ResNet-20 with momentum at 112 MiB; ``tests/test_memsim.py`` checks which variables are copied). Variables on
different devices never share: each device receives its own copy of the constant.

Examples
--------
>>> import tensorflow as tf
>>> from tfmem.ir.loading import load
>>> g = tf.Graph()
>>> with g.as_default():
...     a = tf.compat.v1.get_variable("a", initializer=tf.zeros([64]), use_resource=True)
...     b = tf.compat.v1.get_variable("b", initializer=tf.zeros([64]), use_resource=True)
...     c = tf.compat.v1.get_variable("c", initializer=tf.ones([64]), use_resource=True)
>>> sorted(sharing_groups(load(g)).values())   # a and b share zeros; c alone shares with nobody
[['a', 'b']]
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import tensor_util

from tfmem.ir.graph import GraphIR, TensorRef
from tfmem.ir.ops import IN_PLACE_UPDATE_OPS, IN_PLACE_UPDATE_PREFIXES, INITIAL_VALUE_PASS_THROUGH_OPS


def updates_in_place(op: str) -> bool:
    """Whether ``op`` writes into a resource variable's buffer (rather than replacing it)."""
    return op in IN_PLACE_UPDATE_OPS or op.startswith(IN_PLACE_UPDATE_PREFIXES)


def sharing_groups(graph: GraphIR) -> dict[Hashable, list[str]]:
    """Variables initialised to one constant value on one device, by device and value: groups of two or more, in
    graph order."""
    groups: dict[Hashable, list[str]] = {}
    for node in graph.nodes:
        if node.op != "AssignVariableOp" or len(node.inputs) < 2:
            continue
        var = variable_of(graph, node.inputs[0])
        key = constant_key(graph, node.inputs[1])
        if var is None or key is None:
            continue
        key = (tf.DeviceSpec.from_string(graph[var].device).to_string().lower(), key)
        if var not in groups.get(key, ()):
            groups.setdefault(key, []).append(var)
    return {k: v for k, v in groups.items() if len(v) > 1}


def updated_in_place(graph: GraphIR) -> frozenset[str]:
    """Variables (``VarHandleOp`` names) that some op of ``graph`` updates in place, e.g. an optimizer's slots."""
    return frozenset(var for node in graph.nodes if updates_in_place(node.op)
                     for var in (variable_of(graph, t) for t in node.inputs) if var is not None)


def variable_of(graph: GraphIR, ref: TensorRef) -> str | None:
    """The ``VarHandleOp`` whose handle ``ref`` is (through ``Identity``/``Snapshot``), or None."""
    node = graph[ref.node]
    while node.op in INITIAL_VALUE_PASS_THROUGH_OPS and node.inputs:
        node = graph[node.inputs[0].node]
    return node.name if node.op == "VarHandleOp" else None


def constant_key(graph: GraphIR, ref: TensorRef) -> Hashable | None:
    """A key equal for tensors Grappler folds to the same constant: dtype, shape and value; None if not constant."""
    node = graph[ref.node]
    while node.op in INITIAL_VALUE_PASS_THROUGH_OPS and node.inputs:
        node = graph[node.inputs[0].node]
    if node.op == "Const" and "value" in node.attrs:
        value = tensor_util.MakeNdarray(node.attrs["value"].tensor)
    elif node.op == "Fill" and len(node.inputs) == 2:
        dims, scalar = (_const_array(graph, t) for t in node.inputs)
        if dims is None or scalar is None or scalar.size != 1:
            return None
        value = np.broadcast_to(scalar.reshape(()), tuple(int(d) for d in dims.reshape(-1)))
    else:
        return None
    if value.size and bool(np.all(value == value.flat[0])):  # a uniform fill: no need to hash every element
        return (str(value.dtype), value.shape, value.flat[0].item())
    return (str(value.dtype), value.shape, np.ascontiguousarray(value).tobytes())


def _const_array(graph: GraphIR, ref: TensorRef) -> np.ndarray | None:
    node = graph[ref.node]
    return tensor_util.MakeNdarray(node.attrs["value"].tensor) if node.op == "Const" else None
