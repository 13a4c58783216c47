"""Compute each constant value once: merge copies of the same computation on constants, as Grappler would.

Gradient graphs repeat small constant computations: each of an unrolled RNN's 24 per-step losses
``mean((y_t - target_t) ** 2)`` gets its own ``Reshape -> Tile -> RealDiv`` of constants, a 512 KiB tensor of
``1/n``. On the user's graph the session computes it once: Grappler merges identical computations
(``DedupComputations``). After a pass gates some of them with control edges (a partition barrier, a fence),
Grappler does not merge them, and the executor's own constant folding turns each gated copy into a
constant that the session holds for as long as it lives (``tfmem.sim.executor_folding``): persistent device
memory no plan can move, where the user's graph held one copy (``tests/test_share_constants.py``).

This pass merges them before any pass adds an edge: a *constant computation* is a ``Const``, or a stateless
op outside control-flow frames whose inputs are all constant computations; two of them are the same when they
run the same op with the same attributes, on the same device, on the same inputs (after merging) and after the
same control inputs. Readers of a copy read the first one instead (in graph order); the copies are left
without readers, so the session prunes them.

Requires: nothing. Ensures: the same values, bit for bit (the same deterministic kernel on the same inputs);
fetched and fed tensors are never merged away.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tensorflow.python.framework import op_def_registry

from tfmem.ir.execution import parse_fetches
from tfmem.ir.frames import find_regions, topological_order
from tfmem.ir.graph import GraphIR, OpNode, TensorRef
from tfmem.ir.ops import NEVER_FOLDED
from tfmem.pipeline import PassContext, PassReport, PassResult
from tfmem.units import format_bytes

# Attributes that name where a node sits or what it was grouped with, not what it computes.
_IGNORED_ATTRS = frozenset({"_class"})


@dataclass(frozen=True)
class ShareConstants:
    """Merge identical computations on constants, so each constant value is computed (and held) once.

    Examples
    --------
    >>> import tensorflow as tf
    >>> from tfmem.pipeline import PassContext
    >>> from tfmem.ir.shapes import annotate
    >>> g = tf.Graph()
    >>> with g.as_default():
    ...     x = tf.compat.v1.placeholder(tf.float32, (256, 256), name="x")
    ...     halves = [tf.fill((256, 256), 0.5, name=f"half{i}") for i in range(2)]
    ...     _ = tf.add(x * halves[0], halves[1], name="y")
    >>> result = ShareConstants().run(annotate(g.as_graph_def()), PassContext(("y:0",)))
    >>> [str(t) for t in result.graph["y"].inputs]
    ['mul:0', 'half0:0']
    """

    name: ClassVar[str] = "share_constants"
    # It does not depend on the budget: optimize runs it once, before planning and before the lower bound.
    budget_independent: ClassVar[bool] = True
    peak_non_increasing: ClassVar[bool] = False

    def run(self, graph: GraphIR, ctx: PassContext) -> PassResult:
        kept = frozenset(_kept_nodes(graph, ctx))
        same_as = shared_constants(graph, kept)
        if not same_as:
            return PassResult(graph, False, PassReport.empty(self.name, "no constant computed twice"))

        def shared(t: TensorRef) -> TensorRef:
            return TensorRef(same_as.get(t.node, t.node), t.index)

        nodes = []
        rewired = 0
        for node in graph.nodes:
            inputs = tuple(shared(t) for t in node.inputs)
            if inputs != node.inputs:
                rewired += 1
                node = OpNode(node.name, node.op, inputs, node.control_inputs, node.device, node.outputs,
                              node.attrs)
            nodes.append(node)
        new = graph.replace_nodes(tuple(nodes))
        freed = sum(sum(s.nbytes or 0 for s in graph[n].outputs) for n in same_as)
        note = (f"{len(same_as)} copies of constant computations merged into {len(set(same_as.values()))} "
                f"({format_bytes(freed)} of outputs computed once instead of again); {rewired} reader(s) rewired")
        return PassResult(new, True, PassReport(self.name, changed=True, notes=(note,),
                                                details={"merged": dict(sorted(same_as.items()))}))


def _kept_nodes(graph: GraphIR, ctx: PassContext) -> set[str]:
    """Nodes whose outputs the user names (fetched or fed), or a v1 loop waits for: never merged away.

    A loop's ops stay exactly as they are (tests/test_loops.py), so the nodes outside it that they read or have
    a control input from are kept (the frame's own nodes never compute constants here).
    """
    tensors, targets = parse_fetches(graph, ctx.fetches)
    fed = {TensorRef.parse(f).node for f in ctx.feed_shapes}
    in_frames = find_regions(graph)
    read_by_loops = {p for n in graph.nodes if n.name in in_frames for p in n.predecessors if p not in in_frames}
    return {t.node for t in tensors} | set(targets) | fed | read_by_loops


def shared_constants(graph: GraphIR, kept: frozenset[str] = frozenset()) -> dict[str, str]:
    """Each constant computation that repeats an earlier one, mapped to that earlier one (see the module doc).

    Examples
    --------
    >>> import tensorflow as tf
    >>> from tfmem.ir.shapes import annotate
    >>> g = tf.Graph()
    >>> with g.as_default():
    ...     a, b = tf.constant([1.0, 2.0], name="a"), tf.constant([1.0, 2.0], name="b")
    ...     _ = tf.add(a * 2.0, b * 2.0, name="y")
    >>> sorted(shared_constants(annotate(g.as_graph_def())).items())
    [('b', 'a'), ('mul_1', 'mul'), ('mul_1/y', 'mul/y')]
    """
    in_frames = find_regions(graph)
    first_with: dict[tuple[object, ...], str] = {}
    same_as: dict[str, str] = {}
    constant: set[str] = set()

    def first(n: str) -> str:
        return same_as.get(n, n)

    for name in topological_order(graph):
        node = graph[name]
        if not _computes_constant(node, constant, in_frames):
            continue
        constant.add(name)
        key = (node.op, node.device, tuple(f"{first(t.node)}:{t.index}" for t in node.inputs),
               tuple(sorted({first(c) for c in node.control_inputs})),
               tuple(sorted((k, v.SerializeToString(deterministic=True))
                            for k, v in node.attrs.items() if k not in _IGNORED_ATTRS)),
               tuple((s.dtype, s.shape) for s in node.outputs))
        if key in first_with and name not in kept:
            same_as[name] = first_with[key]
        else:
            first_with.setdefault(key, name)
    return same_as


def _computes_constant(node: OpNode, constant: set[str], in_frames: object) -> bool:
    """A ``Const`` (not a reference), or a stateless op outside frames whose inputs all compute constants."""
    if node.name in in_frames:  # type: ignore[operator]
        return False
    if node.op == "Const":
        return not any(s.dtype.endswith("_ref") for s in node.outputs)
    if not node.inputs or node.op in NEVER_FOLDED or any(t.node not in constant for t in node.inputs):
        return False
    op_def = op_def_registry.get(node.op)
    return op_def is not None and not op_def.is_stateful
