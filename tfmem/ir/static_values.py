"""Shapes that TensorFlow knows statically but a GraphDef's shape inference leaves partial, and the values behind them.

Importing a GraphDef infers shapes op by op, and some facts that Python knew when it built the graph do not
survive serialization. The one that matters most: a ``While`` op with an ``output_shapes`` attr does not pass a
resource handle's shape on, so ``VariableShape`` of a variable carried through a TF2 loop, and the
``zeros(VariableShape(...))`` its gradient starts from, come out unknown (``tests/test_loops.py``).

``complete_shapes`` starts where tfmem may know more than TensorFlow's import did: ``VariableShape`` ops and
variable reads of a partial shape (their handle's shape, lost through a ``While``), and the tensors whose shape
Grappler knew better (``refined``). It follows only what those feed, in topological
order, and only while each op it reaches learns something: an op reached that way with a partial
output asks TensorFlow's own shape function again, on a scratch graph of that op alone whose inputs are
placeholders of the shapes known so far, or constants where their values are known statically (constants, the
shape, size or rank of a tensor of known shape, the shape of a variable a handle reaches back to, and the
integer arithmetic of shape subgraphs on such values: ``SHAPE_ARITHMETIC_OPS``, evaluated with numpy by
``tfmem.ir.shape_arithmetic``, else by TensorFlow). An op none of that reaches costs nothing: its shape is
the import's. Ops in v1 loop frames are all visited, a loop's ``Merge`` joining its inputs until the shapes
settle; ``TensorList`` handles carry what ``tfmem.ir.tensor_lists`` knows of their elements, and a functional
``While``'s outputs come from its body (``tfmem.ir.while_bodies``). Other function calls are left as they are.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterable, Mapping, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2, node_def_pb2
from tensorflow.python.framework import tensor_util

from tfmem.ir import shape_arithmetic
from tfmem.ir.frames import find_regions, topological_order
from tfmem.ir.graph import GraphIR, OpNode, TensorRef
from tfmem.ir.ops import (
    ENTER_OPS,
    EXIT_OPS,
    FUNCTIONAL_OPS,
    IDENTITY_OPS,
    MERGE_OPS,
    NEXT_ITERATION_OPS,
    SHAPE_ARITHMETIC_OPS,
    SWITCH_OPS,
    VARIABLE_READ_OPS,
)
from tfmem.ir.tensor_lists import LIST_SOURCES, ListInfo, list_outputs, list_value, read_shapes
from tfmem.ir.while_bodies import WHILE_OPS, loop_inputs, while_outputs

Shapes = dict[TensorRef, tf.TensorShape]

# Outputs whose shape TensorFlow's shape function leaves unknown but whose kernel always gives one: fused batch
# norm's third reserve space is a scalar of type ``U`` from the Eigen CPU kernel (a 0-element vector with oneDNN; a
# GPU's is cuDNN's workspace, sized at run time), and nothing reads its values but the gradient kernel. The zoos'
# default batch norm (tests/test_zoo.py).
KERNEL_OUTPUT_SHAPES: dict[str, dict[int, tuple[int, ...]]] = {
    "FusedBatchNormV3": {5: ()},
    "_FusedBatchNormEx": {5: ()},
}

# Values larger than this are never materialised: shape-computing tensors hold a few dozen numbers.
MAX_VALUE_ELEMENTS = 4096
_SHAPE_OPS = frozenset({"Shape", "Size", "Rank"})
_INTEGER_DTYPES = frozenset({"int32", "int64"})
# Ops whose output is their input's value: identities, and an Enter (the same value in each iteration of its frame)
_PASSING_OPS = IDENTITY_OPS | ENTER_OPS


def complete_shapes(graph: GraphIR, shapes: Mapping[TensorRef, tf.TensorShape], *,
                    refined: Iterable[TensorRef] = (), fed: Collection[TensorRef] = ()) -> Shapes:
    """Return ``shapes`` with the partial ones refined where TensorFlow can say more (see the module doc).

    Parameters
    ----------
    graph : the graph, with TensorFlow's import's specs
    shapes : one entry per output of ``graph``'s nodes; the result has the same keys
    refined : tensors whose shape in ``shapes`` says more than the import's (e.g. Grappler's): what they feed
        is inferred again
    fed : tensors fed at run time: their shapes are as given, their values never static

    Nothing is ever made less specific than ``shapes``, and an op TensorFlow's shape function rejects is left as
    it was. Inside v1 loops a loop-carried tensor first takes its ``Enter``'s shape, then the join of that and
    each ``NextIteration``'s as they are computed, until nothing changes: a shape the body keeps comes out whole,
    one it changes (a tensor that grows each iteration) as general as the iterations' disagree.
    """
    out: Shapes = dict(shapes)
    kernel_known = _kernel_shapes(graph, out)
    out.update(kernel_known)
    refined = [*refined, *kernel_known]
    regions = find_regions(graph)
    # where the import may have lost a handle's shape (through a While), what Grappler knew better, the lists
    # TensorFlow cannot follow, and the loops, whose carried shapes its import leaves partial
    seeds = [n.name for n in graph.nodes if n.op == "VariableShape" or n.op in LIST_SOURCES
             or n.op in (VARIABLE_READ_OPS | WHILE_OPS) and any(_partial(n, i, out) for i in range(len(n.outputs)))]
    seeds += (c for t in refined for c in graph.consumers.get(t, ()))
    # and shape arithmetic the import left partial whose values are known (a BroadcastGradientArgs of folded
    # shapes in a traced attention step, tests/test_function.py::test_attention_gradients_get_their_shapes);
    # not every partial op: one nothing can complete would cost a scratch graph (tests/test_ir.py)
    values = _Values(graph, out, frozenset(fed))
    seeds += (n.name for n in graph.nodes if n.op in SHAPE_ARITHMETIC_OPS
              and any(_partial(n, i, out) for i in range(len(n.outputs)))
              and all(values.value(TensorRef(n.name, i)) is not None for i in range(len(n.outputs))))
    if any(_partial(graph[name], i, out) or s.dtype == "variant" for name in regions
           for i, s in enumerate(graph[name].outputs)):
        seeds += regions
    if not seeds:
        return out
    _Walk(graph, out, frozenset(fed), regions).run(seeds)
    return out


def _complete_body(graph: GraphIR, shapes: Shapes, lists: dict[TensorRef, ListInfo]
                   ) -> tuple[Shapes, dict[TensorRef, ListInfo]]:
    """``complete_shapes`` for a ``While`` body whose arguments hold the lists ``lists``: shapes and lists."""
    out: Shapes = dict(shapes)
    walk = _Walk(graph, out, frozenset(), find_regions(graph))
    walk.lists.update(lists)
    walk.run([n.name for n in graph.nodes if n.op in LIST_SOURCES or n.op in WHILE_OPS or n.name in walk.regions
              or any(_partial(n, i, out) for i in range(len(n.outputs)))
              or any(t in lists for t in n.inputs)])
    return out, walk.lists


# A loop's shapes settle in a few rounds (each can only make a shape more general); past this many visits an op
# keeps the shape TensorFlow gave it.
MAX_VISITS = 32


class _Walk:
    """``complete_shapes``' worklist: ops in topological order, an op again when an input it read has changed."""

    def __init__(self, graph: GraphIR, out: Shapes, fed: frozenset[TensorRef], regions: Mapping[str, str]) -> None:
        self.graph, self.out, self.regions = graph, out, regions
        self.base = dict(out)
        self.lists: dict[TensorRef, ListInfo] = {}
        self.values = _Values(graph, out, fed, self.lists)
        self.functions = {f.signature.name for f in graph.library.function}
        self.order = topological_order(graph)
        self.position = {name: i for i, name in enumerate(self.order)}
        self.pending: set[str] = set()   # a frame's ops not visited yet: a loop's Merge reads no back edge from one
        self.visits: dict[str, int] = {}

    def run(self, seeds: Iterable[str]) -> None:
        queue: list[int] = []
        queued: set[str] = set()

        def visit(names: Iterable[str]) -> None:
            for name in names:
                if name not in queued:
                    queued.add(name)
                    heapq.heappush(queue, self.position[name])

        seeds = list(seeds)
        self.pending = {name for name in seeds if name in self.regions}
        visit(seeds)
        while queue:  # in topological order: a node comes after every node it reads that could still change
            node = self.graph[self.order[heapq.heappop(queue)]]
            queued.discard(node.name)
            if node.op in FUNCTIONAL_OPS and node.op not in WHILE_OPS or node.op in self.functions:
                continue
            first = node.name in self.pending
            self.pending.discard(node.name)
            self.visits[node.name] = self.visits.get(node.name, 0) + 1
            news = self._update(node)
            if first:   # a loop's Merge now reads this op's outputs too
                news = [TensorRef(node.name, i) for i in range(len(node.outputs))]
            news += (TensorRef(node.name, i) for i in range(len(node.outputs))
                     if self.values.value(TensorRef(node.name, i)) is not None)
            for ref in news:
                visit(self.graph.consumers.get(ref, ()))

    def _update(self, node: OpNode) -> list[TensorRef]:
        """Infer ``node``'s outputs again from its inputs as they stand; return those that changed."""
        refs = [TensorRef(node.name, i) for i in range(len(node.outputs))]
        if self.visits[node.name] > MAX_VISITS:
            shapes, infos = [self.base[r] for r in refs], list[ListInfo | None]([None] * len(refs))
        else:
            shapes, infos = self._outputs(node, refs)
        changed = []
        for ref, shape, info in zip(refs, shapes, infos, strict=True):
            known = self.base[ref]
            shape = known.merge_with(shape) if shape.is_compatible_with(known) else known
            if not _same(shape, self.out[ref]) or info != self.lists.get(ref):
                changed.append(ref)
                self.out[ref] = shape
                if info is None:
                    self.lists.pop(ref, None)
                else:
                    self.lists[ref] = info
        if changed and self.visits[node.name] > 1:   # values read from this op's earlier shapes are stale
            self.values.known.clear()
        return changed

    def _outputs(self, node: OpNode, refs: list[TensorRef]) -> tuple[list[tf.TensorShape], list[ListInfo | None]]:
        args = _Args(self)
        if node.op in MERGE_OPS:  # the join of the inputs computed so far (a loop's back edge: once visited)
            ready = [t for t in node.inputs if t.node not in self.pending]
            if not ready:
                return [self.base[r] for r in refs], [None] * len(refs)
            shape, info = self.out[ready[0]], self.lists.get(ready[0])
            for t in ready[1:]:
                shape = shape.most_specific_compatible_shape(self.out[t])
                other = self.lists.get(t)
                info = None if info is None or other is None else info.join(other)
            return [shape, self.base[refs[1]]], [info, None]
        if node.op in WHILE_OPS:
            state = while_outputs(node, self.graph.library, loop_inputs(node, self.out, self.lists), _complete_body)
            return state if state is not None else ([self.base[r] for r in refs], [None] * len(refs))
        infos = list_outputs(node, args) or []
        infos += [None] * (len(refs) - len(infos))
        if not any(_partial(node, i, self.base) for i in range(len(refs))):
            return [self.base[r] for r in refs], infos
        if node.op in _FORWARDING_OPS:
            return [self.out[node.inputs[0]]] * len(refs), infos
        read = read_shapes(node, args)
        if read is not None:
            return read, infos
        return _infer(node, self.out, self.values) or [self.base[r] for r in refs], infos


# v1 control flow that hands its input on as it is (a Switch to both outputs)
_FORWARDING_OPS = ENTER_OPS | EXIT_OPS | NEXT_ITERATION_OPS | SWITCH_OPS


class _Args:
    """What ``tfmem.ir.tensor_lists``' rules read: shapes, static values and lists as the walk has them."""

    def __init__(self, walk: _Walk) -> None:
        self.walk = walk

    def shape(self, t: TensorRef) -> tf.TensorShape:
        return self.walk.out.get(t, tf.TensorShape(None))

    def value(self, t: TensorRef) -> np.ndarray | None:
        return self.walk.values.value(t)

    def info(self, t: TensorRef) -> ListInfo | None:
        return self.walk.lists.get(t)


def _same(a: tf.TensorShape, b: tf.TensorShape) -> bool:
    return a.rank == b.rank and (a.rank is None or a.as_list() == b.as_list())


def _kernel_shapes(graph: GraphIR, shapes: Shapes) -> Shapes:
    """``KERNEL_OUTPUT_SHAPES`` for the outputs of ``graph`` that ``shapes`` leaves partial."""
    out: Shapes = {}
    for node in graph.nodes:
        for index, dims in KERNEL_OUTPUT_SHAPES.get(node.op, {}).items():
            ref = TensorRef(node.name, index)
            if index < len(node.outputs) and _partial(node, index, shapes) and shapes[ref].is_compatible_with(dims):
                out[ref] = tf.TensorShape(dims)
    return out


def _more_specific(shape: tf.TensorShape, than: tf.TensorShape) -> bool:
    return shape.rank is not None and (than.rank is None or any(
        a is not None and b is None for a, b in zip(shape.as_list(), than.as_list(), strict=True)))


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
    # without a producer version TensorFlow reads a placeholder's scalar shape as unknown (graphs before v22)
    gd.versions.producer = tf.version.GRAPH_DEF_VERSION
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
    """Integer tensors whose values are known without running the graph, computed on demand and kept.

    ``shapes`` is read as it stands when a value is first asked for: ``complete_shapes`` asks in topological
    order, once every shape upstream is final.
    """

    def __init__(self, graph: GraphIR, shapes: Shapes, fed: frozenset[TensorRef] = frozenset(),
                 lists: Mapping[TensorRef, ListInfo] | None = None) -> None:
        self.graph = graph
        self.shapes = shapes
        self.fed = fed
        self.lists = lists if lists is not None else {}
        self.known: dict[TensorRef, np.ndarray | None] = {}

    def dtype(self, t: TensorRef) -> tf.DType:
        return tf.as_dtype(self.graph.spec(t).dtype)

    def shape(self, t: TensorRef) -> tf.TensorShape:
        return self.shapes.get(t, tf.TensorShape(None))

    def info(self, t: TensorRef) -> ListInfo | None:
        return self.lists.get(t)

    def value(self, t: TensorRef) -> np.ndarray | None:
        """The value of ``t``, or None. The tensors it is computed from come first (a depth-first post-order, a
        topological order of what it reads), without recursion: a chain of shape arithmetic may be thousands of
        ops long."""
        stack = [(t, False)]
        expanded: set[TensorRef] = set()
        while stack:
            ref, sources_done = stack.pop()
            if ref in self.known:
                continue
            if sources_done:
                self.known[ref] = self._compute(ref)
            elif ref not in expanded:   # (one already expanded, and not known, is on a cycle: no value through it)
                expanded.add(ref)
                stack.append((ref, True))
                stack += ((s, False) for s in self._sources(ref) if s not in self.known)
        return self.known[t]

    def _sources(self, t: TensorRef) -> Sequence[TensorRef]:
        """The tensors whose values ``_compute(t)`` reads."""
        node = self.graph[t.node]
        if t in self.fed or self.graph.spec(t).dtype not in _INTEGER_DTYPES:
            return ()
        if node.op in _PASSING_OPS:
            return node.inputs[:1]
        if node.op in SHAPE_ARITHMETIC_OPS and all(self.graph.spec(s).dtype in _INTEGER_DTYPES for s in node.inputs):
            return node.inputs
        return ()

    def _compute(self, t: TensorRef) -> np.ndarray | None:
        node = self.graph[t.node]
        if t in self.fed or self.graph.spec(t).dtype not in _INTEGER_DTYPES:
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
        if node.op in _PASSING_OPS:
            return self.known.get(node.inputs[0]) if node.inputs else None
        if node.op in ("TensorListLength", "TensorListElementShape"):
            return list_value(node, self, self.dtype(t).as_numpy_dtype)
        return self._evaluated(node, t)

    def _evaluated(self, node: OpNode, t: TensorRef) -> np.ndarray | None:
        sources = self._sources(t)
        inputs = [v for v in (self.known.get(s) for s in sources) if v is not None]
        if not sources or len(inputs) < len(sources) or sum(v.size for v in inputs) > MAX_VALUE_ELEMENTS:
            return None
        try:
            value: np.ndarray | None = shape_arithmetic.evaluate(node.op, node.attrs, inputs, t.index)
        except shape_arithmetic.Unsupported:
            value = self._run(node, t, inputs)
        except Exception:  # inputs TensorFlow refuses too: no value
            return None
        if value is None or value.size > MAX_VALUE_ELEMENTS:
            return None
        return value.astype(self.dtype(t).as_numpy_dtype, copy=False)

    def _run(self, node: OpNode, t: TensorRef, inputs: Sequence[np.ndarray]) -> np.ndarray | None:
        """``node`` run by TensorFlow on the CPU, for the forms ``shape_arithmetic`` has no rule for."""
        graph = _scratch_graph(node, [(self.dtype(s), tf.TensorShape(v.shape), v)
                                      for s, v in zip(node.inputs, inputs, strict=True)])
        if graph is None:
            return None
        try:
            with tf.compat.v1.Session(graph=graph) as sess:
                value = sess.run(graph.get_operation_by_name(node.name).outputs[t.index])
        except Exception:
            return None
        return value if isinstance(value, np.ndarray) else None

    def handle_shape(self, t: TensorRef) -> tuple[int, ...] | None:
        """The full shape of the variable whose handle ``t`` is, following the ops that pass handles on."""
        seen = set()
        while t not in seen:
            seen.add(t)
            node = self.graph[t.node]
            if node.op == "VarHandleOp":
                shape = tf.TensorShape(node.attrs["shape"].shape) if "shape" in node.attrs else tf.TensorShape(None)
                return tuple(shape.as_list()) if shape.is_fully_defined() else None
            if node.op in _PASSING_OPS and node.inputs:
                t = node.inputs[0]
            elif node.op in WHILE_OPS and _loop_invariant(self.graph, node, t.index):
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
