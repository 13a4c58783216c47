"""Write the order in which Grappler multiplies and adds chains of tensors into the graph, and freeze it there.

Grappler re-associates chains of binary ``Mul`` (or ``Add``/``AddV2``) ops in place, under the same node names:
its arithmetic optimizer collects a chain's leaves and rebuilds the chain so that broadcasts happen last
(``MinimizeBroadcasts``), and constant folding moves constants down a chain to fold them together
(``ConstantPushDown``: ``c1 * (x * c2)`` runs as ``x * (c1 * c2)``, the product of constants folded into the
inner op). Floating-point products are not associative, so the order decides the last bit. Which ops join a
chain depends on the graph's structure: an inner op joins only while it has one consumer, no control edge and
no preserve mark, on the root's device. Passes add consumers (swap-outs), control edges, host copies and clones,
so after them the same chain is built differently and rounds differently: an attention's
``(dsub * softmax) * scale`` runs as ``(scale * dsub) * softmax`` on the user's graph but may run as
``dsub * (scale * softmax)`` after a pass (the scale, 1/sqrt(32), is no power of two;
``tests/test_pin_reassociation.py::test_a_swapped_inner_product_rounds_as_in_the_users_graph``).

This pass reads Grappler's rewrite of the graph and gives every op of each rewritten chain its runtime form (the
inputs Grappler gave it; an inner op Grappler folded becomes the constant it folded to). Then it marks every
float ``Mul``/``Add``/``AddV2`` whose runtime form it knows with ``_grappler_do_not_remove``: a marked op never
joins a chain again, so no later rewrite changes an order. A chain is taken only where its rewrite matches this
graph: each op read outside the chain at runtime (or fetched) multiplies the same non-constant tensors before and
after, and every other tensor it reads runs as written. Ops Grappler rewrote in any other way (a fusion, another
op type) and chains that do not match are left unmarked and reported: Grappler then treats them as it did.

Requires: an annotated graph, after ``pin_fusions`` and ``split_addn``. Ensures: the same values, bit for bit,
whatever later passes add around these ops.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

import networkx as nx
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, node_def_pb2, types_pb2

from tfmem.ir.editor import DO_NOT_REMOVE
from tfmem.ir.frames import find_regions
from tfmem.ir.graph import GraphIR, OpNode, TensorRef
from tfmem.ir.ops import CHAIN_OPS, GRAPPLER_BYPASSED_OPS
from tfmem.ir.shapes import spec_of
from tfmem.pipeline import PassContext, PassReport, PassResult
from tfmem.sim.grappler import runtime_nodes

INEXACT_DTYPES = frozenset({types_pb2.DT_FLOAT, types_pb2.DT_DOUBLE, types_pb2.DT_HALF, types_pb2.DT_BFLOAT16})

# One op's definition in a chain: its data inputs, or None for a constant (an op Grappler folded).
Definition = tuple[TensorRef, ...] | None


@dataclass(frozen=True)
class PinReassociation:
    """Give each chain of products or sums the association the session gives it, and keep it from changing.

    Examples
    --------
    >>> import tensorflow as tf
    >>> from tfmem.pipeline import PassContext
    >>> from tfmem.ir.shapes import annotate
    >>> g = tf.Graph()
    >>> with g.as_default():
    ...     a = tf.compat.v1.placeholder(tf.float32, (64, 32), name="a")
    ...     b = tf.compat.v1.placeholder(tf.float32, (64, 32), name="b")
    ...     _ = tf.multiply(tf.multiply(a, b, name="ab"), 0.3, name="y")   # Grappler: a * (b * 0.3)
    >>> result = PinReassociation().run(annotate(g.as_graph_def()), PassContext(("y:0",)))
    >>> [str(t) for t in result.graph["ab"].inputs]
    ['b:0', 'y/y:0']
    """

    name: ClassVar[str] = "pin_reassociation"
    # It does not depend on the budget: optimize runs it once, before planning and before the lower bound.
    budget_independent: ClassVar[bool] = True
    peak_non_increasing: ClassVar[bool] = False

    def run(self, graph: GraphIR, ctx: PassContext) -> PassResult:
        in_frames = find_regions(graph)
        candidates = {n.name for n in graph.nodes if _is_inexact_chain_op(n) and n.name not in in_frames}
        if not candidates:
            return PassResult(graph, False, PassReport.empty(self.name, "no float Mul, Add or AddV2 ops"))
        runtime = {n.name: n for n in runtime_nodes(graph, ctx.fetches, ctx.device, ctx.session_config)}
        observed = {TensorRef.parse(f).node if ":" in f else f for f in ctx.fetches}
        readers: dict[str, set[str]] = {}   # at runtime, by the name of the node read
        for rt in runtime.values():
            for t in _data_inputs(rt):
                readers.setdefault(t.node, set()).add(rt.name)
        adopted: dict[str, OpNode] = {}
        unmatched: list[frozenset[str]] = []
        for chain in _rewritten_chains(graph, runtime, candidates):
            forms = _runtime_forms(graph, runtime, chain, observed, readers)
            if forms is None:
                unmatched.append(chain)
            else:
                adopted.update(forms)
        left: set[str] = set().union(*unmatched)
        frozen = {name for name in candidates - left if name in adopted or _runs_as_written(graph, runtime, name)}
        if not frozen:
            return PassResult(graph, False, PassReport.empty(
                self.name, "no float Mul or Add runs as written or as a matched chain"))
        nodes = tuple(_marked(adopted.get(n.name, n)) if n.name in frozen else n for n in graph.nodes)
        rewired = sorted(name for name, node in adopted.items() if node != graph[name])
        notes = [f"{len(rewired)} op(s) given the association Grappler gives their chain; {len(frozen)} float "
                 "Mul/Add op(s) frozen against re-association"]
        if unmatched:
            notes.append(f"left {len(unmatched)} rewritten chain(s) to Grappler (the rewrite did not match this "
                         f"graph): {', '.join(sorted(left)[:3])}")
        details: dict[str, object] = {"rewired": rewired, "unmatched": sorted(left), "frozen": len(frozen)}
        return PassResult(graph.replace_nodes(nodes), True, PassReport(self.name, changed=True, notes=tuple(notes),
                                                                       details=details))


def _is_inexact_chain_op(node: OpNode) -> bool:
    dtype = node.attrs.get("T")
    return node.op in CHAIN_OPS and dtype is not None and dtype.type in INEXACT_DTYPES


def _rewritten_chains(graph: GraphIR, runtime: Mapping[str, node_def_pb2.NodeDef],
                      candidates: set[str]) -> list[frozenset[str]]:
    """The ops Grappler gave other operands (Identity ops seen through, order aside), with the ops of the same
    type it folded into constants beside them, grouped into chains joined by data edges, here or at runtime.

    An op of a rewritten chain whose operands stayed is a leaf of the chain's other ops both here and at
    runtime, so it need not be in the chain. (Grappler tags the ops it re-associates, but the tags do not
    always survive into the graph it returns.)"""
    changed = {name for name in candidates if name in runtime and runtime[name].op == graph[name].op
               and not _same_operands(graph, _data_inputs(runtime[name]), graph[name].inputs)}
    folded = {name for name in candidates if name in runtime and runtime[name].op == "Const"}
    joined = nx.Graph()
    joined.add_nodes_from(changed)
    for name in changed:
        neighbours = [_source(graph, t).node for t in graph[name].inputs] + [t.node for t in _data_inputs(runtime[name])]
        joined.add_edges_from((name, other) for other in neighbours
                              if (other in changed or other in folded) and graph[other].op == graph[name].op)
    return [frozenset(c) for c in nx.connected_components(joined)]


def _runtime_forms(graph: GraphIR, runtime: Mapping[str, node_def_pb2.NodeDef], chain: frozenset[str],
                   observed: set[str], readers: Mapping[str, set[str]]) -> dict[str, OpNode] | None:
    """Each op of ``chain`` as the session runs it, or None where the rewrite does not match this graph."""
    runtime_defs: dict[str, Definition] = {}
    for name in chain:
        rt = runtime[name]
        if rt.op == "Const":
            runtime_defs[name] = None
            continue
        refs = tuple(_data_inputs(rt))
        if len(refs) != len(graph[name].inputs) or not all(_exists(graph, t) for t in refs):
            return None
        for t in refs:
            source = _source(graph, t)
            if source.node not in chain and not _runs_as_written_leaf(graph, runtime, source):
                return None   # a tensor Grappler rewrote: its value here may not be its value there
        runtime_defs[name] = refs
    written_defs: dict[str, Definition] = {name: graph[name].inputs for name in chain}
    for name in chain:
        before = _variable_leaves(graph, written_defs, chain, name)
        after = _variable_leaves(graph, runtime_defs, chain, name)
        if before is None or after is None:
            return None
        same_type = {m for m in chain if graph[m].op == graph[name].op}
        if before != after and (name in observed or not readers.get(name, set()) <= same_type):
            # Read outside the chain when the session runs: its own value must not change. (Readers here that
            # the session does not run, such as a gradient's branch for a constant, do not count.)
            return None
    return {name: _runtime_form(graph[name], runtime[name], runtime_defs[name]) for name in chain}


def _variable_leaves(graph: GraphIR, defs: Mapping[str, Definition], chain: frozenset[str],
                     name: str) -> Counter[TensorRef] | None:
    """The non-constant tensors the chain's op ``name`` multiplies (or adds) together under ``defs``, through
    the chain's other ops of its type, with forwarding Identity ops seen through; None on a cycle. Constants
    are left out: Grappler folds and merges them, and a folded product of constants is taken as it computed
    it."""
    leaves: Counter[TensorRef] = Counter()
    stack, seen = [name], set()
    while stack:
        op = stack.pop()
        if op in seen:
            return None
        seen.add(op)
        for t in defs[op] or ():
            source = _source(graph, t)
            if source.node in chain and defs[source.node] is None:
                continue                      # folded into a constant
            if source.node in chain and source.index == 0 and graph[source.node].op == graph[name].op:
                stack.append(source.node)
            elif graph[source.node].op != "Const":
                leaves[source] += 1
    return leaves


def _runtime_form(node: OpNode, rt: node_def_pb2.NodeDef, definition: Definition) -> OpNode:
    """``node`` with Grappler's inputs, or, where Grappler folded it, the constant it folded it to."""
    if definition is not None:
        return dataclasses.replace(node, inputs=definition)
    value = rt.attr["value"].tensor
    spec = spec_of(tf.dtypes.as_dtype(value.dtype), tf.TensorShape(tf.make_ndarray(value).shape))
    attrs = {key: attr_value_pb2.AttrValue() for key in ("dtype", "value")}
    for key, attr in attrs.items():
        attr.CopyFrom(rt.attr[key])
    return OpNode(node.name, "Const", (), node.control_inputs, node.device, (spec,), MappingProxyType(attrs))


def _runs_as_written(graph: GraphIR, runtime: Mapping[str, node_def_pb2.NodeDef], name: str) -> bool:
    """Whether Grappler left ``name`` as it is: same op, the same operands (Identity ops seen through)."""
    rt = runtime.get(name)
    return rt is not None and rt.op == graph[name].op and _same_operands(graph, _data_inputs(rt), graph[name].inputs)


def _runs_as_written_leaf(graph: GraphIR, runtime: Mapping[str, node_def_pb2.NodeDef], t: TensorRef) -> bool:
    """A tensor's value at runtime is its value here unless Grappler turned its op into another (a folded op
    keeps its name but may compute what constant folding pushed into it). An op computed from constants alone
    that Grappler folded holds its own value: a push-down needs a non-constant operand."""
    rt = runtime.get(t.node)
    return rt is None or rt.op == graph[t.node].op or (rt.op == "Const" and _of_constants(graph, t.node))


def _of_constants(graph: GraphIR, name: str) -> bool:
    """Whether ``name``'s value depends on ``Const`` ops alone: every op it reads, transitively, is one or has
    inputs that all are (no placeholder)."""
    stack, seen = [name], set()
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        node = graph[op]
        if node.op == "Const":
            continue
        if not node.inputs or node.op.startswith("Placeholder"):   # a PlaceholderWithDefault may be fed
            return False
        stack.extend(t.node for t in node.inputs)
    return True


def _same_operands(graph: GraphIR, runtime_inputs: list[TensorRef], inputs: tuple[TensorRef, ...]) -> bool:
    if not all(_exists(graph, t) for t in runtime_inputs):
        return False
    return Counter(_source(graph, t) for t in runtime_inputs) == Counter(_source(graph, t) for t in inputs)


def _source(graph: GraphIR, t: TensorRef) -> TensorRef:
    """The tensor ``t`` forwards: through Identity ops to the first tensor that is not one's output."""
    seen: set[str] = set()
    while graph[t.node].op in GRAPPLER_BYPASSED_OPS and graph[t.node].inputs and t.node not in seen:
        seen.add(t.node)
        t = graph[t.node].inputs[0]
    return t


def _exists(graph: GraphIR, t: TensorRef) -> bool:
    return t.node in graph and t.index < len(graph[t.node].outputs)


def _data_inputs(node: node_def_pb2.NodeDef) -> list[TensorRef]:
    return [TensorRef.parse(s) for s in node.input if not s.startswith("^")]


def _marked(node: OpNode) -> OpNode:
    return dataclasses.replace(node, attrs=MappingProxyType({**node.attrs,
                                                             DO_NOT_REMOVE: attr_value_pb2.AttrValue(b=True)}))
