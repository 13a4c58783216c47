"""The outputs of a functional ``While`` (TF2 control flow in a TF1 graph): its body run to a fixed point.

TensorFlow gives a ``While``'s outputs the ``output_shapes`` its builder knew, with a dimension that was only
fed later (a batch) unknown, and no element shapes for the ``TensorList`` s it carries. ``while_outputs`` infers
the body function again on the loop's input shapes and lists (``complete`` is ``tfmem.ir.static_values``' shape
completion, lists included), joins each output with its input, and repeats until nothing changes: what the
body keeps comes out whole, what it changes as general as its iterations disagree.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import tensorflow as tf
from tensorflow.core.framework import function_pb2, graph_pb2
from tensorflow.python.framework import function_def_to_graph

from tfmem.ir.graph import GraphIR, OpNode, TensorRef, TensorSpec
from tfmem.ir.tensor_lists import ListInfo

Shapes = dict[TensorRef, tf.TensorShape]
Lists = dict[TensorRef, ListInfo]
Complete = Callable[[GraphIR, Shapes, Lists], tuple[Shapes, Lists]]
LoopState = tuple[list[tf.TensorShape], list[ListInfo | None]]
WHILE_OPS = frozenset({"While", "StatelessWhile"})
# A body's shapes settle in two or three rounds; a loop that needs more keeps TensorFlow's shapes.
MAX_ROUNDS = 8


def while_outputs(node: OpNode, library: function_pb2.FunctionDefLibrary, state: LoopState,
                  complete: Complete) -> LoopState | None:
    """The shapes and lists of ``node``'s outputs, from its inputs' (``state``); None where it cannot tell."""
    body = node.attrs["body"].func.name if "body" in node.attrs else ""
    fdef = next((f for f in library.function if f.signature.name == body), None)
    if fdef is None or len(fdef.signature.input_arg) != len(state[0]):
        return None
    shapes, infos = state
    for _ in range(MAX_ROUNDS):
        after = _body_outputs(fdef, library, shapes, infos, complete)
        if after is None or len(after[0]) != len(shapes):
            return None
        joined = [s.most_specific_compatible_shape(b) for s, b in zip(shapes, after[0], strict=True)]
        lists = [a.join(b) if a is not None and b is not None else None for a, b in zip(infos, after[1], strict=True)]
        if all(_same(a, b) for a, b in zip(joined, shapes, strict=True)) and lists == infos:
            return shapes, infos
        shapes, infos = joined, lists
    return None


def _body_outputs(fdef: function_pb2.FunctionDef, library: function_pb2.FunctionDefLibrary,
                  shapes: Sequence[tf.TensorShape], infos: Sequence[ListInfo | None],
                  complete: Complete) -> LoopState | None:
    """One pass of the body on inputs of ``shapes`` and lists ``infos``: its outputs' shapes and lists."""
    try:
        gd, flat = function_def_to_graph.function_def_to_graph_def(fdef, input_shapes=list(shapes))
        gd.library.CopyFrom(library)
        gd.versions.producer = tf.version.GRAPH_DEF_VERSION
        graph = tf.Graph()
        with graph.as_default():
            tf.graph_util.import_graph_def(gd, name="")
    except Exception:   # a body TensorFlow refuses on these shapes: leave the While as it is
        return None
    ir, base = _annotated(gd, graph)
    args = [TensorRef(a.name, 0) for a in fdef.signature.input_arg]
    lists = {a: i for a, i in zip(args, infos, strict=True) if i is not None}
    done, done_lists = complete(ir, base, lists)
    rets = [TensorRef.parse(flat[fdef.ret[a.name]]) for a in fdef.signature.output_arg]
    return [done[r] for r in rets], [done_lists.get(r) for r in rets]


def _annotated(gd: graph_pb2.GraphDef, graph: tf.Graph) -> tuple[GraphIR, Shapes]:
    """``gd`` as a ``GraphIR`` whose specs carry the imported ``graph``'s dtypes, and those shapes."""
    base = GraphIR.from_graph_def(gd)
    shapes: Shapes = {}
    nodes = []
    for node in base.nodes:
        outputs = graph.get_operation_by_name(node.name).outputs
        specs = []
        for i, t in enumerate(outputs):
            shapes[TensorRef(node.name, i)] = t.shape
            dims = None if t.shape.rank is None else tuple(t.shape.as_list())
            specs.append(TensorSpec(t.dtype.base_dtype.name, dims, None))
        nodes.append(OpNode(node.name, node.op, node.inputs, node.control_inputs, node.device, tuple(specs),
                            node.attrs, node.proto))
    return base.replace_nodes(tuple(nodes), annotated=True), shapes


def _same(a: tf.TensorShape, b: tf.TensorShape) -> bool:
    return a.rank == b.rank and (a.rank is None or a.as_list() == b.as_list())


def loop_inputs(node: OpNode, shapes: Mapping[TensorRef, tf.TensorShape],
                lists: Mapping[TensorRef, ListInfo]) -> LoopState:
    """A ``While``'s inputs as ``while_outputs`` takes them."""
    return [shapes.get(t, tf.TensorShape(None)) for t in node.inputs], [lists.get(t) for t in node.inputs]
