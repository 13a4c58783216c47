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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

from tensorflow.core.framework import attr_value_pb2, types_pb2

from tfmem.ir.editor import DO_NOT_REMOVE
from tfmem.ir.frames import find_regions
from tfmem.ir.graph import GraphIR, OpNode, TensorRef
from tfmem.ir.ops import SUM_OPS
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
        replaced = {root: _chain(graph[root], leaves) for root, leaves in sums.items()}
        nodes: list[OpNode] = []
        for node in graph.nodes:
            nodes.extend(replaced.get(node.name, (node,)))
        new = graph.replace_nodes(tuple(nodes))
        added = sum(len(chain) - 1 for chain in replaced.values())
        largest = max(sums, key=lambda n: len(sums[n]) * (graph[n].outputs[0].nbytes or 0))
        notes = [f"{len(sums)} sum(s) of 3+ tensors as chains of adds in the kernel's order; largest: {largest} "
                 f"({len(sums[largest])} inputs of {format_bytes(graph[largest].outputs[0].nbytes or 0)})"]
        if skipped:
            notes.append(f"left {len(skipped)} as they are (runtime form not matched): {', '.join(skipped[:3])}")
        details: dict[str, object] = {"split": {n: len(v) for n, v in sums.items()}, "skipped": skipped}
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


def runtime_sums(graph: GraphIR, ctx: PassContext) -> tuple[dict[str, list[TensorRef]], list[str]]:
    """Every float sum of 3+ tensors the session will run, as {node of ``graph``: its terms in kernel order}.

    Read from Grappler's rewrite of ``graph``: an ``AddN`` it kept (inputs sorted by name), or one its
    arithmetic optimizer built from a tree of adds (``ArithmeticOptimizer/AddOpsRewrite_<root>``, which
    replaces the tree's root). Terms are named as Grappler left them (forwarding ``Identity`` ops bypassed),
    which read the same values. Sums whose terms are not all tensors of ``graph`` of the root's shape, or
    that sit in v1 control-flow frames, are listed as skipped.
    """
    in_frames = find_regions(graph)
    sums, skipped = {}, []
    for node in runtime_nodes(graph, ctx.fetches, ctx.device, ctx.session_config):
        terms = [s for s in node.input if not s.startswith("^")]
        if node.op != "AddN" or len(terms) < MIN_INPUTS:
            continue
        root = _root_of(node.name)
        if root not in graph or root in in_frames or graph[root].op not in SUM_OPS:
            continue
        dtype, spec = graph[root].attrs.get("T"), graph[root].outputs[0] if graph[root].outputs else None
        if dtype is None or dtype.type not in EXACT_DTYPES or spec is None or spec.shape is None:
            continue
        if root == node.name and (spec.nbytes or 0) < MIN_BYTES:   # a kept AddN, small: see MIN_BYTES
            continue
        refs = [TensorRef.parse(t) for t in terms]
        if all(r.node in graph and r.index < len(graph[r.node].outputs) and graph.spec(r).shape == spec.shape
               for r in refs):
            sums[root] = refs
        else:
            skipped.append(root)
    return sums, skipped


def _root_of(runtime_name: str) -> str:
    """The node of the user's graph a runtime AddN computes (itself, or the root of an add tree Grappler folded)."""
    scope, _, base = runtime_name.rpartition("/")
    if base.startswith(ADD_TREE_PREFIX) and (scope == ADD_TREE_SCOPE or scope.endswith("/" + ADD_TREE_SCOPE)):
        outer = scope[: -len(ADD_TREE_SCOPE)]
        return outer + base[len(ADD_TREE_PREFIX):]
    return runtime_name


def _chain(node: OpNode, order: Sequence[TensorRef]) -> list[OpNode]:
    """The binary adds that reproduce the kernel's sum of ``order``; the last one takes ``node``'s name."""
    attrs: Mapping[str, attr_value_pb2.AttrValue] = MappingProxyType({
        "T": node.attrs["T"], DO_NOT_REMOVE: attr_value_pb2.AttrValue(b=True)})
    spec = node.outputs[0]
    ops: list[OpNode] = []

    def add(a: TensorRef, b: TensorRef) -> TensorRef:
        new = OpNode(f"{node.name}/tfmem_sum_{len(ops)}", "AddV2", (a, b), node.control_inputs, node.device,
                     (spec,), attrs)
        ops.append(new)
        return new.output()

    groups = kernel_order_groups(len(order))
    total = order[0]
    for i in groups[0][1:]:
        total = add(total, order[i])
    for group in groups[1:]:
        partial = order[group[0]]
        for i in group[1:]:
            partial = add(partial, order[i])
        total = add(total, partial)
    last = ops[-1]
    ops[-1] = OpNode(node.name, last.op, last.inputs, last.control_inputs, last.device, last.outputs, last.attrs)
    return ops
