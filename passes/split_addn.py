"""Turn sums of three or more tensors into chains of binary adds that round exactly as the session would.

Two reasons, one rewrite:

* Memory. An ``AddN`` starts only when all of its N inputs exist, so all N stay on the device together.
  Gradient graphs are full of them: a weight used T times (an unrolled RNN's recurrent matrix, tied embeddings)
  gets its T partial gradients summed by one ``AddN``, and that working set (T copies of the weight) can be
  the whole graph's lower bound. A chain of adds consumes each input as soon as the partial sum before it
  exists, and frees it (``tests/test_split_addn.py::test_a_training_step_is_bit_identical_and_needs_less``).
* Same results. Floating-point addition is not associative, and Grappler decides the order of every sum from
  the graph's structure: it sorts an ``AddN``'s inputs by name, and folds trees of adds into one ``AddN``
  (``AddOpsRewrite``) only where no node of the tree has other consumers, control edges or a preserve mark.
  Passes rename inputs (swap-ins) and add control edges, so the same sum would round differently after them
  (``tests/test_split_addn.py::test_moving_passes_keep_the_sums_grappler_folds_bit_identical``). Binary adds
  in the order the session would have used for the user's graph are immune to both: ``a + b == b + a``
  exactly, and a marked chain is never folded.

The order is read from Grappler's own rewrite of the user's graph, never guessed. Checked on TensorFlow 2.21
(tests/test_split_addn.py re-checks it): the CPU kernel (``aggregate_ops``) computes, per element,
``out = s0 + s1 + ... + s(r-1)`` left to right for the first ``r`` inputs (``r = N mod 8``, or 8 + that when it
is 0 or 1), then for each next group of eight ``out += (g0 + g1 + ... + g7)``, the group summed left to right
first. Binary ``AddV2`` ops arranged the same way give bit-identical results. A sum whose runtime form cannot
be matched (other shapes, Grappler-made terms, v1 loops) is left as it is and reported.

Only float32/float64 sums are rewritten, and kept ``AddN`` ops only from ``MIN_BYTES`` per term. The last
add keeps the sum's name, so consumers and fetches are unchanged.

Requires: an annotated graph. Ensures: the same values, bit for bit; each new op carries
``_grappler_do_not_remove`` so Grappler does not fold the chain back into one ``AddN``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar, TypeAlias

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, node_def_pb2, types_pb2

from tfmem.ir.editor import DO_NOT_REMOVE
from tfmem.ir.frames import find_regions
from tfmem.ir.graph import GraphIR, OpNode, TensorRef
from tfmem.ir.ops import SUM_OPS
from tfmem.ir.shapes import spec_of
from tfmem.pipeline import PassContext, PassReport, PassResult
from tfmem.sim.grappler import runtime_nodes
from tfmem.units import format_bytes

MIN_INPUTS = 3               # a sum of two is the same in either order
# Per-term size from which a kept AddN is chained: smaller sums never decide a peak, and passes rename (reorder)
# only large tensors. Add trees Grappler folds are chained at any size: a control edge stops the folding.
MIN_BYTES = 64 * 2**10
KERNEL_GROUP = 8             # aggregate_ops adds inputs eight at a time after the first group
EXACT_DTYPES = frozenset({types_pb2.DT_FLOAT, types_pb2.DT_DOUBLE})
# Grappler's arithmetic optimizer folds a tree of adds rooted at <scope>/<root> into one AddN named so.
ADD_TREE_SCOPE = "ArithmeticOptimizer"
ADD_TREE_PREFIX = "AddOpsRewrite_"
# A sum as the session computes it: a tensor of the graph, or ("AddN" | "AddV2", its terms in the runtime's order).
Sum: TypeAlias = "TensorRef | tuple[str, tuple[Sum, ...]]"


@dataclass(frozen=True)
class SplitAddN:
    """Rewrite each sum of 3+ float tensors into the session's own summation order as a chain of binary adds.

    Examples
    --------
    >>> import tensorflow as tf
    >>> from tfmem.pipeline import PassContext
    >>> from tfmem.ir.shapes import annotate
    >>> g = tf.Graph()
    >>> with g.as_default():
    ...     xs = [tf.compat.v1.placeholder(tf.float32, (256, 256), name=f"x{i}") for i in range(5)]
    ...     _ = tf.math.add_n(xs, name="total")
    >>> result = SplitAddN().run(annotate(g.as_graph_def()), PassContext(("total:0",)))
    >>> [n.op for n in result.graph.nodes if n.name.startswith("total")]
    ['AddV2', 'AddV2', 'AddV2', 'AddV2']
    """

    name: ClassVar[str] = "split_addn"
    # It does not depend on the budget: optimize runs it once, before planning and before the lower bound.
    budget_independent: ClassVar[bool] = True
    peak_non_increasing: ClassVar[bool] = False

    def run(self, graph: GraphIR, ctx: PassContext) -> PassResult:
        if not any(node.op in SUM_OPS for node in graph.nodes):
            return PassResult(graph, False, PassReport.empty(self.name, "no sums of three or more tensors"))
        sums, skipped = runtime_sums(graph, ctx)
        if not sums:
            return PassResult(graph, False, PassReport.empty(
                self.name, "no sums of three or more float tensors whose runtime order is known"
                + (f" ({len(skipped)} left as they are: {', '.join(skipped[:3])})" if skipped else "")))
        replaced = {root: _chain(graph, graph[root], tree) for root, tree in sums.items()}
        nodes: list[OpNode] = []
        for node in graph.nodes:
            nodes.extend(replaced.get(node.name, (node,)))
        new = graph.replace_nodes(tuple(nodes))
        added = sum(len(chain) - 1 for chain in replaced.values())
        terms = {root: len(_terms(tree)) for root, tree in sums.items()}
        largest = max(sums, key=lambda n: terms[n] * (graph[n].outputs[0].nbytes or 0))
        notes = [f"{len(sums)} sum(s) of 3+ tensors as chains of adds in the kernel's order; largest: {largest} "
                 f"({terms[largest]} inputs of {format_bytes(graph[largest].outputs[0].nbytes or 0)})"]
        if skipped:
            notes.append(f"left {len(skipped)} as they are (runtime form not matched): {', '.join(skipped[:3])}")
        details: dict[str, object] = {"split": terms, "skipped": skipped}
        return PassResult(new, True, PassReport(self.name, changed=True, nodes_added=added,
                                                notes=tuple(notes), details=details))


def kernel_order_groups(n: int) -> list[range]:
    """How ``AddN``'s CPU kernel groups ``n`` (sorted) inputs: a first group summed alone, then groups of 8.

    Examples
    --------
    >>> [list(g) for g in kernel_order_groups(11)]
    [[0, 1, 2], [3, 4, 5, 6, 7, 8, 9, 10]]
    >>> [len(g) for g in kernel_order_groups(17)]
    [9, 8]
    """
    first = n % KERNEL_GROUP
    if first < 2:
        first += KERNEL_GROUP
    first = min(first, n)
    return [range(0, first)] + [range(i, min(i + KERNEL_GROUP, n)) for i in range(first, n, KERNEL_GROUP)]


def runtime_sums(graph: GraphIR, ctx: PassContext) -> tuple[dict[str, Sum], list[str]]:
    """Every float sum of 3+ tensors the session will run, as {node of ``graph``: the sum as it runs}.

    Read from Grappler's rewrite of ``graph``: an ``AddN`` it kept (inputs sorted by name), or what its
    arithmetic optimizer built from a tree of adds (``ArithmeticOptimizer/AddOpsRewrite_<root>``, which
    replaces the tree's root): an ``AddN`` of the tree's leaves when they have one shape, else per shape an
    ``AddN`` of that shape's leaves (``AddOpsRewrite_Leaf_<i>_<root>``), added up smallest broadcast last (a
    layer norm's ``x * scale + (beta - mean * scale)`` runs as ``(x * scale + -mean * scale) + beta``). Terms are
    named as Grappler left them (forwarding ``Identity`` ops bypassed), which read the same values. Sums whose
    terms are not all tensors of ``graph`` of static shapes that broadcast to the root's, or that sit in v1
    control-flow frames, are listed as skipped.
    """
    in_frames = find_regions(graph)
    runtime = {n.name: n for n in runtime_nodes(graph, ctx.fetches, ctx.device, ctx.session_config)}
    sums: dict[str, Sum] = {}
    skipped = []
    for node in runtime.values():
        root = _root_of(node.name)
        rewritten = root != node.name
        if node.op not in SUM_OPS or (not rewritten and node.op != "AddN"):
            continue
        if root not in graph or root in in_frames or graph[root].op not in SUM_OPS:
            continue
        dtype, spec = graph[root].attrs.get("T"), graph[root].outputs[0] if graph[root].outputs else None
        if dtype is None or dtype.type not in EXACT_DTYPES or spec is None or spec.shape is None:
            continue
        if not rewritten and (spec.nbytes or 0) < MIN_BYTES:   # a kept AddN, small: see MIN_BYTES
            continue
        tree = _runtime_sum(graph, runtime, node, root)
        if tree is not None and len(_terms(tree)) < MIN_INPUTS:
            continue   # a sum of two: the same in either order
        if tree is not None and _shape(graph, tree) == tuple(spec.shape):
            sums[root] = tree
        else:
            skipped.append(root)
    return sums, skipped


def _runtime_sum(graph: GraphIR, runtime: Mapping[str, node_def_pb2.NodeDef], node: node_def_pb2.NodeDef,
                 root: str) -> Sum | None:
    """``node`` (a runtime sum) over tensors of ``graph``, through the partial sums Grappler made for the tree
    rooted at ``root``; None where a term is something else."""
    terms: list[Sum] = []
    for name in (s for s in node.input if not s.startswith("^")):
        ref = TensorRef.parse(name)
        made = runtime.get(ref.node)
        if ref.node in graph:
            if ref.index >= len(graph[ref.node].outputs) or _static(graph, ref) is None:
                return None
            terms.append(ref)
        elif made is not None and made.op in SUM_OPS and _is_partial_sum_of(ref.node, root):
            term = _runtime_sum(graph, runtime, made, root)
            if term is None:
                return None
            terms.append(term)
        else:
            return None
    return ("AddN" if node.op == "AddN" else "AddV2", tuple(terms))


def _is_partial_sum_of(runtime_name: str, root: str) -> bool:
    """Whether Grappler named ``runtime_name`` as a partial sum of the add tree rooted at ``root``
    (``<scope>/ArithmeticOptimizer/AddOpsRewrite_Leaf_<i>_<root's last name>``)."""
    scope, _, base = root.rpartition("/")
    prefix = f"{scope}/{ADD_TREE_SCOPE}/{ADD_TREE_PREFIX}Leaf_" if scope else f"{ADD_TREE_SCOPE}/{ADD_TREE_PREFIX}Leaf_"
    if not runtime_name.startswith(prefix):
        return False
    index, _, rest = runtime_name[len(prefix):].partition("_")
    return index.isdigit() and rest == base


def _terms(tree: Sum) -> list[TensorRef]:
    if isinstance(tree, TensorRef):
        return [tree]
    return [t for part in tree[1] for t in _terms(part)]


def _static(graph: GraphIR, t: TensorRef) -> tuple[int, ...] | None:
    shape = graph.spec(t).shape
    return None if shape is None or None in shape else tuple(int(d) for d in shape if d is not None)


def _shape(graph: GraphIR, tree: Sum) -> tuple[int, ...]:
    """The shape of a sum whose terms all have static shapes (``_runtime_sum`` checks)."""
    if isinstance(tree, TensorRef):
        return _static(graph, tree) or ()
    return tuple(np.broadcast_shapes(*(_shape(graph, part) for part in tree[1])))


def _root_of(runtime_name: str) -> str:
    """The node of the user's graph a runtime AddN computes (itself, or the root of an add tree Grappler folded)."""
    scope, _, base = runtime_name.rpartition("/")
    if base.startswith(ADD_TREE_PREFIX) and (scope == ADD_TREE_SCOPE or scope.endswith("/" + ADD_TREE_SCOPE)):
        outer = scope[: -len(ADD_TREE_SCOPE)]
        return outer + base[len(ADD_TREE_PREFIX):]
    return runtime_name


def _chain(graph: GraphIR, node: OpNode, tree: Sum) -> list[OpNode]:
    """The binary adds that reproduce the runtime's ``tree`` (each ``AddN`` in its kernel's order, each add of
    two in either order: ``a + b == b + a`` exactly); the last one takes ``node``'s name."""
    attrs: Mapping[str, attr_value_pb2.AttrValue] = MappingProxyType({
        "T": node.attrs["T"], DO_NOT_REMOVE: attr_value_pb2.AttrValue(b=True)})
    dtype = tf.as_dtype(node.outputs[0].dtype)
    ops: list[OpNode] = []
    shapes: dict[TensorRef, tuple[int, ...]] = {}

    def add(a: TensorRef, b: TensorRef) -> TensorRef:
        shape = tuple(np.broadcast_shapes(*(shapes[t] if t in shapes else _static(graph, t) or () for t in (a, b))))
        new = OpNode(f"{node.name}/tfmem_sum_{len(ops)}", "AddV2", (a, b), node.control_inputs, node.device,
                     (spec_of(dtype, tf.TensorShape(shape)),), attrs)
        ops.append(new)
        shapes[new.output()] = shape
        return new.output()

    def total_of(part: Sum) -> TensorRef:
        if isinstance(part, TensorRef):
            return part
        order = [total_of(p) for p in part[1]]
        groups = kernel_order_groups(len(order)) if part[0] == "AddN" else [range(len(order))]
        total = order[0]
        for i in groups[0][1:]:
            total = add(total, order[i])
        for group in groups[1:]:
            partial = order[group[0]]
            for i in group[1:]:
                partial = add(partial, order[i])
            total = add(total, partial)
        return total

    total_of(tree)
    last = ops[-1]
    ops[-1] = OpNode(node.name, last.op, last.inputs, last.control_inputs, last.device, last.outputs, last.attrs)
    return ops
