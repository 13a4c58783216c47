"""Write the order in which Grappler multiplies and adds chains of tensors into the graph, and freeze it there.

Grappler's arithmetic optimizer re-associates chains of binary ``Mul`` (or ``Add``/``AddV2``) ops
(``MinimizeBroadcasts``): it collects a chain's leaves, sorts them by size and rebuilds the chain in place, under
the same node names, so that broadcasts happen last. Floating-point products are not associative, so the order
decides the last bit. Which ops join a chain depends on the graph's structure: an inner op joins only while it
has one consumer, no control edge and no preserve mark, on the root's device. Passes add consumers (swap-outs),
control edges and clones, so after them the same chain is built differently and rounds differently. Measured:
a 32-expert MoE Transformer planned with recomputation differed from vanilla in its second step's loss by
4.8e-7, because the attention's ``(dsub * softmax) * scale`` was rebuilt as ``dsub * (scale * softmax)`` instead
of vanilla's ``(scale * dsub) * softmax`` (the scale, 1/sqrt(32), is no power of two).

This pass reads Grappler's rewrite of the graph, gives every op of each re-associated chain the inputs Grappler
gave it, and marks every float ``Mul``/``Add``/``AddV2`` whose runtime form it knows with
``_grappler_do_not_remove``: a marked op never joins a chain again, so no later rewrite changes an order.
An op Grappler rewrote in any other way (constant folding, a fusion) is left unmarked, as is a chain whose
rewrite cannot be matched to this graph's tensors (reported): Grappler then treats them as it did.

Requires: an annotated graph, after ``pin_fusions`` and ``split_addn``. Ensures: the same values, bit for bit,
whatever later passes add around these ops.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

from tensorflow.core.framework import attr_value_pb2, node_def_pb2, types_pb2

from tfmem.editor import DO_NOT_REMOVE
from tfmem.frames import find_regions
from tfmem.grappler import runtime_nodes
from tfmem.ir import GraphIR, OpNode, TensorRef
from tfmem.pipeline import PassContext, PassReport, PassResult

CHAIN_OPS = frozenset({"Mul", "Add", "AddV2"})   # what MinimizeBroadcasts re-associates
INEXACT_DTYPES = frozenset({types_pb2.DT_FLOAT, types_pb2.DT_DOUBLE, types_pb2.DT_HALF, types_pb2.DT_BFLOAT16})
FORWARDING_OPS = frozenset({"Identity"})        # read the same value as their input (Grappler bypasses them)


@dataclass(frozen=True)
class PinReassociation:
    """Give each chain of products or sums the association the session gives it, and keep it from changing.

    Examples
    --------
    >>> import tensorflow as tf
    >>> from tfmem.pipeline import PassContext
    >>> from tfmem.shapes import annotate
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

    def run(self, graph: GraphIR, ctx: PassContext) -> PassResult:
        candidates = {n.name for n in graph.nodes if _is_inexact_chain_op(n)}
        if not candidates:
            return PassResult(graph, False, PassReport.empty(self.name, "no float Mul, Add or AddV2 ops"))
        runtime = {n.name: n for n in runtime_nodes(graph, ctx.fetches, ctx.device, ctx.session_config)}
        in_frames = find_regions(graph)
        fetched = {TensorRef.parse(f).node if ":" in f else f for f in ctx.fetches}
        readers: dict[str, set[str]] = {}   # at runtime, by the name of the node read
        for rt in runtime.values():
            for t in _data_inputs(rt):
                readers.setdefault(t.node, set()).add(rt.name)
        pinned: dict[str, tuple[TensorRef, ...]] = {}
        unmatched: list[frozenset[str]] = []
        for chain in _reassociated_chains(graph, runtime, candidates):
            inputs = None if chain & in_frames.keys() else _pinned_inputs(graph, runtime, chain, fetched, readers)
            if inputs is None:
                unmatched.append(chain)
            else:
                pinned.update(inputs)
        left = set().union(*unmatched)
        frozen = {name for name in candidates - left - in_frames.keys()
                  if name in pinned or _runs_as_written(graph, runtime, name)}
        if not frozen:
            return PassResult(graph, False, PassReport.empty(
                self.name, "no float Mul or Add runs as written or as a matched chain"))
        nodes = tuple(_frozen(n, pinned.get(n.name, n.inputs)) if n.name in frozen else n for n in graph.nodes)
        rewired = sorted(name for name, ins in pinned.items() if ins != graph[name].inputs)
        notes = [f"{len(rewired)} op(s) given Grappler's association of their chain; {len(frozen)} float Mul/Add "
                 "op(s) frozen against re-association"]
        if unmatched:
            names = sorted(left)
            notes.append(f"left {len(unmatched)} re-associated chain(s) to Grappler (their rewrite did not match "
                         f"this graph's tensors): {', '.join(names[:3])}")
        details = {"rewired": rewired, "unmatched": sorted(left), "frozen": len(frozen)}
        return PassResult(graph.replace_nodes(nodes), True, PassReport(self.name, changed=True, notes=tuple(notes),
                                                                       details=details))


def _is_inexact_chain_op(node: OpNode) -> bool:
    dtype = node.attrs.get("T")
    return node.op in CHAIN_OPS and dtype is not None and dtype.type in INEXACT_DTYPES


def _reassociated_chains(graph: GraphIR, runtime: Mapping[str, node_def_pb2.NodeDef],
                         candidates: set[str]) -> list[frozenset[str]]:
    """The ops Grappler gave other operands (Identity ops seen through, order aside), grouped into chains joined
    by data edges, here or at runtime, between two such ops of the same type.

    An op of a re-associated chain whose operands stayed is a leaf of the chain's other ops both here and at
    runtime, so it need not be in the chain. (Grappler tags the ops it re-associates, but the tags do not always
    survive into the graph it returns: a two-op chain came back untagged.)"""
    changed = {name for name in candidates if name in runtime and runtime[name].op == graph[name].op
               and all(_exists(graph, t) for t in _data_inputs(runtime[name]))
               and _operands(graph, _data_inputs(runtime[name])) != _operands(graph, graph[name].inputs)}
    changed |= {name for name in candidates if name in runtime and runtime[name].op == graph[name].op
                and not all(_exists(graph, t) for t in _data_inputs(runtime[name]))}
    parent = {name: name for name in changed}

    def root(name: str) -> str:
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    for name in changed:
        neighbours = [t.node for t in graph[name].inputs]
        neighbours += [TensorRef.parse(s).node for s in runtime[name].input if not s.startswith("^")]
        for other in neighbours:
            if other in changed and graph[other].op == graph[name].op:
                parent[root(other)] = root(name)
    chains: dict[str, set[str]] = {}
    for name in changed:
        chains.setdefault(root(name), set()).add(name)
    return [frozenset(c) for c in chains.values()]


def _pinned_inputs(graph: GraphIR, runtime: Mapping[str, node_def_pb2.NodeDef], chain: frozenset[str],
                   fetched: set[str], readers: Mapping[str, set[str]]) -> dict[str, tuple[TensorRef, ...]] | None:
    """Each op of ``chain`` with the inputs Grappler gave it, or None where that cannot be trusted: a runtime
    input this graph lacks, a leaf Grappler rewrote, or an op read outside the chain (or fetched) whose
    product changed."""
    inputs: dict[str, tuple[TensorRef, ...]] = {}
    for name in chain:
        refs = _data_inputs(runtime[name])
        if len(refs) != len(graph[name].inputs) or not all(_exists(graph, t) for t in refs):
            return None
        if not all(_source(graph, t).node in chain or _leaf_runs_as_written(graph, runtime, _source(graph, t))
                   for t in refs):
            return None
        inputs[name] = tuple(refs)
    as_written = {name: graph[name].inputs for name in chain}
    for name in chain:
        before = _leaves(graph, as_written, chain, name)
        after = _leaves(graph, inputs, chain, name)
        if before is None or after is None:
            return None
        if before != after and (name in fetched or not readers.get(name, set()) <= chain):
            # Read outside the chain when the session runs: its own value must not change. (Readers here that
            # the session does not run, such as a gradient's branch for a constant, do not count.)
            return None
    return inputs


def _leaves(graph: GraphIR, inputs: Mapping[str, Sequence[TensorRef]], chain: frozenset[str],
            name: str) -> Counter[object] | None:
    """The tensors the chain's op ``name`` multiplies (or adds) together, through the chain's other ops, with
    forwarding Identity ops seen through and constants compared by value; None on a cycle."""
    leaves: Counter[object] = Counter()
    stack, seen = [name], set()
    while stack:
        op = stack.pop()
        if op in seen:
            return None
        seen.add(op)
        for t in inputs[op]:
            source = _source(graph, t)
            if source.node in chain and source.index == 0 and graph[source.node].op == graph[name].op:
                stack.append(source.node)
            else:
                leaves[_value_key(graph, source)] += 1
    return leaves


def _value_key(graph: GraphIR, t: TensorRef) -> object:
    """``t``, or for a constant its dtype and value: Grappler merges equal constants into one of them."""
    node = graph[t.node]
    value = node.attrs.get("value")
    if node.op != "Const" or value is None:
        return t
    return ("Const", node.attrs["dtype"].type, value.tensor.SerializeToString(deterministic=True))


def _runs_as_written(graph: GraphIR, runtime: Mapping[str, node_def_pb2.NodeDef], name: str) -> bool:
    """Whether Grappler left ``name`` as it is: same op, the same operands (Identity ops seen through)."""
    rt = runtime.get(name)
    if rt is None or rt.op != graph[name].op:
        return False
    refs = _data_inputs(rt)
    return all(_exists(graph, t) for t in refs) and _operands(graph, refs) == _operands(graph, graph[name].inputs)


def _operands(graph: GraphIR, refs: Sequence[TensorRef]) -> Counter[TensorRef]:
    return Counter(_source(graph, t) for t in refs)


def _leaf_runs_as_written(graph: GraphIR, runtime: Mapping[str, node_def_pb2.NodeDef], t: TensorRef) -> bool:
    """A leaf's value at runtime is its value here unless Grappler turned its op into another (a folded one
    keeps its name but may compute what constant folding pushed into it)."""
    rt = runtime.get(t.node)
    return rt is None or rt.op == graph[t.node].op


def _source(graph: GraphIR, t: TensorRef) -> TensorRef:
    """The tensor ``t`` forwards: through Identity ops to the first tensor that is not one's output."""
    seen: set[str] = set()
    while graph[t.node].op in FORWARDING_OPS and graph[t.node].inputs and t.node not in seen:
        seen.add(t.node)
        t = graph[t.node].inputs[0]
    return t


def _exists(graph: GraphIR, t: TensorRef) -> bool:
    return t.node in graph and t.index < len(graph[t.node].outputs)


def _data_inputs(node: node_def_pb2.NodeDef) -> list[TensorRef]:
    return [TensorRef.parse(s) for s in node.input if not s.startswith("^")]


def _frozen(node: OpNode, inputs: tuple[TensorRef, ...]) -> OpNode:
    attrs = {**node.attrs, DO_NOT_REMOVE: attr_value_pb2.AttrValue(b=True)}
    return dataclasses.replace(node, inputs=inputs, attrs=MappingProxyType(attrs))
