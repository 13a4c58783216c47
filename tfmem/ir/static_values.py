"""Shapes that TensorFlow knows statically but a GraphDef's shape inference leaves partial, and the values behind them.

Importing a GraphDef infers shapes op by op, and some facts that Python knew when it built the graph do not
survive serialization. The one that matters most: a ``While`` op with an ``output_shapes`` attr does not pass a
resource handle's shape on, so ``VariableShape`` of a variable carried through a TF2 loop, and the
``zeros(VariableShape(...))`` its gradient starts from, come out unknown (``tests/test_loops.py``).

``complete_shapes`` walks the graph in topological order and, for each op with a partial output, asks
TensorFlow's own shape function again, on a scratch graph of that op alone whose inputs are placeholders of the
shapes known so far, or constants where their values are known statically: constants, the shape, size or rank
of a tensor of known shape, the shape of a variable a handle reaches back to, and the integer arithmetic of
shape subgraphs on such values (``SHAPE_ARITHMETIC_OPS``, evaluated by TensorFlow on the CPU). v1 control-flow
frames and function calls are left as they are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import networkx as nx
import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2, node_def_pb2
from tensorflow.python.framework import tensor_util

from tfmem.ir.frames import acyclic_view, find_regions
from tfmem.ir.graph import GraphIR, OpNode, TensorRef
from tfmem.ir.ops import (
    CONTROL_FLOW_OPS,
    FUNCTIONAL_OPS,
    IDENTITY_OPS,
    SHAPE_ARITHMETIC_OPS,
    VARIABLE_READ_OPS,
)

Shapes = dict[TensorRef, tf.TensorShape]

# Values larger than this are never materialised: shape-computing tensors hold a few dozen numbers.
MAX_VALUE_ELEMENTS = 4096
_SHAPE_OPS = frozenset({"Shape", "Size", "Rank"})
_WHILE_OPS = frozenset({"While", "StatelessWhile"})
_INTEGER_DTYPES = frozenset({"int32", "int64"})


def complete_shapes(graph: GraphIR, shapes: Mapping[TensorRef, tf.TensorShape]) -> Shapes:
    """Return ``shapes`` with the partial ones refined where TensorFlow can say more (see the module doc).

    ``shapes`` has one entry per output of ``graph``'s nodes; the result has the same keys. Nothing is ever
    made less specific, and an op TensorFlow's shape function rejects is left as it was.
    """
    out: Shapes = dict(shapes)
    partial = [n for n in graph.nodes if any(_partial(n, i, out) for i in range(len(n.outputs)))]
    if not partial:
        return out
    regions = find_regions(graph)
    functions = {f.signature.name for f in graph.library.function}
    values = _Values(graph, out)
    position = {n.name: i for i, n in enumerate(graph.nodes)}
    for name in nx.lexicographical_topological_sort(acyclic_view(graph), key=position.__getitem__):
        node = graph[name]
        if (name in regions or node.op in CONTROL_FLOW_OPS or node.op in FUNCTIONAL_OPS or node.op in functions
                or not any(_partial(node, i, out) for i in range(len(node.outputs)))):
            continue
        for i, shape in enumerate(_infer(node, out, values)):
            ref = TensorRef(name, i)
            if ref in out and shape.is_compatible_with(out[ref]):
                out[ref] = out[ref].merge_with(shape)
    return out


def _partial(node: OpNode, index: int, shapes: Shapes) -> bool:
    shape = shapes.get(TensorRef(node.name, index))
    return shape is not None and not shape.is_fully_defined() and node.outputs[index].dtype not in ("resource",
                                                                                                     "variant")


def _infer(node: OpNode, shapes: Shapes, values: _Values) -> list[tf.TensorShape]:
    known = [values.value(TensorRef(node.name, i)) for i in range(len(node.outputs))]
    if all(v is not None for v in known):
        return [tf.TensorShape(v.shape) for v in known]  # type: ignore[union-attr]
    if node.op in VARIABLE_READ_OPS:  # the shape of the variable its handle reaches back to
        dims = values.handle_shape(node.inputs[0])
        return [tf.TensorShape(dims)] if dims is not None else []
    inputs = [(t, values.value(t)) for t in node.inputs]
    graph = _scratch_graph(node, [(values.dtype(t), shapes.get(t, tf.TensorShape(None)), v) for t, v in inputs])
    if graph is None:
        return []
    return [t.shape for t in graph.get_operation_by_name(node.name).outputs]


def _scratch_graph(node: OpNode, inputs: Sequence[tuple[tf.DType, tf.TensorShape, np.ndarray | None]]
                   ) -> tf.Graph | None:
    """``node`` alone in a new ``tf.Graph``, its inputs constants (known values) or placeholders (None when
    TensorFlow refuses it)."""
    gd = graph_pb2.GraphDef()
    names = []
    for i, (dtype, shape, value) in enumerate(inputs):
        name = f"tfmem_input_{i}"
        nd = gd.node.add(name=name)
        if value is not None:
            nd.op = "Const"
            nd.attr["dtype"].type = dtype.as_datatype_enum
            nd.attr["value"].tensor.CopyFrom(tensor_util.make_tensor_proto(value, dtype))
        else:
            nd.op = "Placeholder"
            nd.attr["dtype"].type = dtype.as_datatype_enum
            nd.attr["shape"].shape.CopyFrom(shape.as_proto())
        names.append(name)
    op = node_def_pb2.NodeDef(name=node.name, op=node.op, input=names)
    for key, value in node.attrs.items():
        if key != "_class":  # colocation with nodes this graph does not have
            op.attr[key].CopyFrom(value)
    gd.node.append(op)
    graph = tf.Graph()
    try:
        with graph.as_default():
            tf.graph_util.import_graph_def(gd, name="")
    except Exception:  # a shape function that rejects the inputs it was given: leave the op as it was
        return None
    return graph


class _Values:
    """Integer tensors whose values are known without running the graph, computed on demand and kept."""

    def __init__(self, graph: GraphIR, shapes: Shapes) -> None:
        self.graph = graph
        self.shapes = shapes
        self.known: dict[TensorRef, np.ndarray | None] = {}

    def dtype(self, t: TensorRef) -> tf.DType:
        return tf.as_dtype(self.graph.spec(t).dtype)

    def value(self, t: TensorRef) -> np.ndarray | None:
        if t not in self.known:
            self.known[t] = None  # a cycle (none outside frames) finds no value
            self.known[t] = self._compute(t)
        return self.known[t]

    def _compute(self, t: TensorRef) -> np.ndarray | None:
        node = self.graph[t.node]
        if self.graph.spec(t).dtype not in _INTEGER_DTYPES:
            return None
        if node.op == "Const":
            shape = self.graph.spec(t).shape
            if shape is None or int(np.prod(shape)) > MAX_VALUE_ELEMENTS:  # type: ignore[arg-type]
                return None
            return np.asarray(tensor_util.MakeNdarray(node.attrs["value"].tensor))
        if node.op in _SHAPE_OPS or node.op == "ShapeN":
            source = self.shapes.get(node.inputs[t.index if node.op == "ShapeN" else 0], tf.TensorShape(None))
            return _shape_value(node.op, source, self.dtype(t))
        if node.op == "VariableShape":
            dims = self.handle_shape(node.inputs[0])
            return None if dims is None else np.array(dims, dtype=self.dtype(t).as_numpy_dtype)
        if node.op in IDENTITY_OPS:
            return self.value(node.inputs[0])
        return self._evaluated(node, t)

    def _evaluated(self, node: OpNode, t: TensorRef) -> np.ndarray | None:
        if (node.op not in SHAPE_ARITHMETIC_OPS or not node.inputs
                or not all(self.graph.spec(s).dtype in _INTEGER_DTYPES for s in node.inputs)):
            return None
        inputs = [v for v in (self.value(s) for s in node.inputs) if v is not None]
        if len(inputs) < len(node.inputs) or sum(v.size for v in inputs) > MAX_VALUE_ELEMENTS:
            return None
        graph = _scratch_graph(node, [(self.dtype(s), tf.TensorShape(v.shape), v)
                                      for s, v in zip(node.inputs, inputs, strict=True)])
        if graph is None:
            return None
        try:
            with tf.compat.v1.Session(graph=graph) as sess:
                value = sess.run(graph.get_operation_by_name(node.name).outputs[t.index])
        except Exception:
            return None
        return value if isinstance(value, np.ndarray) and value.size <= MAX_VALUE_ELEMENTS else None

    def handle_shape(self, t: TensorRef) -> tuple[int, ...] | None:
        """The full shape of the variable whose handle ``t`` is, following the ops that pass handles on."""
        seen = set()
        while t not in seen:
            seen.add(t)
            node = self.graph[t.node]
            if node.op == "VarHandleOp":
                shape = tf.TensorShape(node.attrs["shape"].shape) if "shape" in node.attrs else tf.TensorShape(None)
                return tuple(shape.as_list()) if shape.is_fully_defined() else None
            if node.op in IDENTITY_OPS and node.inputs:
                t = node.inputs[0]
            elif node.op in _WHILE_OPS and _loop_invariant(self.graph, node, t.index):
                t = node.inputs[t.index]
            else:
                return None
        return None


def _shape_value(op: str, shape: tf.TensorShape, dtype: tf.DType) -> np.ndarray | None:
    if op == "Rank":
        return None if shape.rank is None else np.array(shape.rank, dtype=dtype.as_numpy_dtype)
    if not shape.is_fully_defined():
        return None
    dims = shape.as_list()
    return np.array(int(np.prod(dims)) if op == "Size" else dims, dtype=dtype.as_numpy_dtype)


def _loop_invariant(graph: GraphIR, node: OpNode, index: int) -> bool:
    """Whether a ``While`` op's body returns its input ``index`` unchanged (as it does a variable's handle)."""
    body = node.attrs["body"].func.name if "body" in node.attrs else ""
    fdef = next((f for f in graph.library.function if f.signature.name == body), None)
    if fdef is None or index >= len(fdef.signature.output_arg) or index >= len(fdef.signature.input_arg):
        return False
    nodes = {n.name: n for n in fdef.node_def}
    source = fdef.ret.get(fdef.signature.output_arg[index].name, "")
    for _ in range(len(nodes) + 1):
        name = source.split(":")[0]
        if name not in nodes:
            return bool(name == fdef.signature.input_arg[index].name)
        if nodes[name].op not in IDENTITY_OPS or not nodes[name].input:
            return False
        source = nodes[name].input[0]
    return False
