"""Turn large ``AddN`` ops into chains of binary adds that round exactly as the ``AddN`` kernel does.

An ``AddN`` starts only when all of its N inputs exist, so all N stay on the device together. Gradient graphs
are full of them: a weight used T times (an unrolled RNN's recurrent matrix, tied embeddings) gets its T
partial gradients summed by one ``AddN`` of T inputs, and that working set (T copies of the weight) is the
whole graph's lower bound (an unrolled DeepSpeech at 90 steps: 91 MiB of its 128 MiB budget). A chain of
adds can consume each input as soon as the partial sum before it exists, and free it.

Floating-point addition is not associative, so the chain must add in the kernel's exact order. Checked on
TensorFlow 2.21 (tests/test_split_addn.py re-checks it): Grappler's arithmetic optimizer first sorts the
``AddN``'s inputs by name (it is commutative), then the CPU kernel (``aggregate_ops``) computes, per element,
``out = s0 + s1 + ... + s(r-1)`` left to right for the first ``r`` inputs (``r = N mod 8``, or 8 + that when
it is 0 or 1), then for each next group of eight ``out += (g0 + g1 + ... + g7)``, the group summed left to
right first. Binary ``AddV2`` ops arranged the same way give bit-identical results, whatever order Grappler
then puts their two inputs in (``a + b == b + a`` exactly). The order Grappler gives is read from Grappler's
own output for this graph, never guessed; an ``AddN`` whose runtime form cannot be matched is left alone.

Only float32/float64 sums of at least ``MIN_INPUTS`` tensors of at least ``MIN_BYTES`` each are rewritten,
outside v1 control-flow frames. The last add keeps the ``AddN``'s name, so consumers and fetches are unchanged.

Requires: an annotated graph. Ensures: the same values, bit for bit; each new op carries
``_grappler_do_not_remove`` so Grappler does not fold the chain back into one ``AddN``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

from tensorflow.core.framework import attr_value_pb2, types_pb2

from tfmem.devices import DEFAULT_DEVICE, with_default_device
from tfmem.editor import DO_NOT_REMOVE
from tfmem.frames import find_regions
from tfmem.grappler import runtime_graph_def
from tfmem.ir import GraphIR, OpNode, TensorRef
from tfmem.pipeline import PassContext, PassReport, PassResult
from tfmem.units import format_bytes

MIN_INPUTS = 4               # below this the chain frees at most one input early: not worth an op
MIN_BYTES = 64 * 2**10       # per input; smaller sums never decide a peak
KERNEL_GROUP = 8             # aggregate_ops adds inputs eight at a time after the first group
EXACT_DTYPES = frozenset({types_pb2.DT_FLOAT, types_pb2.DT_DOUBLE})
# Ops that pass their input through unchanged; Grappler bypasses them, so an AddN input named after one of these
# may reach the runtime graph under the name of the tensor it forwards.
FORWARDING_OPS = frozenset({"Identity", "Snapshot", "StopGradient", "PreventGradient"})


@dataclass(frozen=True)
class SplitAddN:
    """Rewrite each large ``AddN`` into the kernel's own summation order as a chain of binary adds.

    Examples
    --------
    >>> import tensorflow as tf
    >>> from tfmem.pipeline import PassContext
    >>> from tfmem.shapes import annotate
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

    def run(self, graph: GraphIR, ctx: PassContext) -> PassResult:
        candidates = _candidates(graph)
        if not candidates:
            return PassResult(graph, False, PassReport.empty(self.name, "no AddN large enough to split"))
        orders = _runtime_orders(graph, ctx, candidates)
        replaced: dict[str, list[OpNode]] = {}
        skipped = []
        for node in candidates:
            order = orders.get(node.name)
            if order is None:
                skipped.append(node.name)
                continue
            replaced[node.name] = _chain(node, order)
        if not replaced:
            return PassResult(graph, False, PassReport.empty(
                self.name, f"{len(skipped)} AddN op(s) left whole: Grappler rewrites them beyond a known order"))
        nodes: list[OpNode] = []
        for node in graph.nodes:
            nodes.extend(replaced.get(node.name, (node,)))
        new = graph.replace_nodes(tuple(nodes))
        added = sum(len(chain) - 1 for chain in replaced.values())
        largest = max(replaced, key=lambda n: len(graph[n].inputs) * (graph[n].outputs[0].nbytes or 0))
        notes = [f"split {len(replaced)} AddN op(s) into chains of adds in the kernel's order; largest: {largest} "
                 f"({len(graph[largest].inputs)} inputs of {format_bytes(graph[largest].outputs[0].nbytes or 0)})"]
        if skipped:
            notes.append(f"left {len(skipped)} whole (runtime form not matched): {', '.join(skipped[:3])}")
        details = {"split": {n: len(graph[n].inputs) for n in replaced}, "skipped": skipped}
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


def _candidates(graph: GraphIR) -> list[OpNode]:
    in_frames = find_regions(graph)
    out = []
    for node in graph.nodes:
        if node.op != "AddN" or len(node.inputs) < MIN_INPUTS or node.name in in_frames:
            continue
        dtype = node.attrs.get("T")
        spec = node.outputs[0] if node.outputs else None
        if dtype is None or dtype.type not in EXACT_DTYPES or spec is None or (spec.nbytes or 0) < MIN_BYTES:
            continue
        if any(graph.spec(t).shape != spec.shape for t in node.inputs):
            continue  # the kernel needs equal shapes anyway; an unknown one could hide a broadcast
        out.append(node)
    return out


def _runtime_orders(graph: GraphIR, ctx: PassContext, candidates: Sequence[OpNode]) -> dict[str, list[TensorRef]]:
    """For each candidate, its inputs in the order the session's AddN kernel receives them (after Grappler)."""
    placed = with_default_device(graph.to_graph_def(), ctx.device or DEFAULT_DEVICE)
    runtime = {n.name: n for n in runtime_graph_def(placed, list(ctx.fetches)).node}
    orders = {}
    for node in candidates:
        seen = runtime.get(node.name)
        if seen is None or seen.op != "AddN":
            continue
        inputs = [s for s in seen.input if not s.startswith("^")]
        order = _match(graph, node, inputs)
        if order is not None:
            orders[node.name] = order
    return orders


def _match(graph: GraphIR, node: OpNode, runtime_inputs: Sequence[str]) -> list[TensorRef] | None:
    """Map the runtime AddN's inputs back to the original ones (through forwarding ops Grappler bypassed)."""
    if len(runtime_inputs) != len(node.inputs):
        return None
    aliases: dict[TensorRef, list[int]] = {}
    for i, t in enumerate(node.inputs):
        for alias in _forwarded(graph, t):
            aliases.setdefault(alias, []).append(i)
    order, used = [], set()
    for s in runtime_inputs:
        ref = TensorRef.parse(s)
        free = [i for i in aliases.get(ref, []) if i not in used]
        if not free:
            return None
        # Two inputs that forward the same tensor hold equal values, so either assignment sums the same.
        used.add(free[0])
        order.append(node.inputs[free[0]])
    return order


def _forwarded(graph: GraphIR, t: TensorRef) -> list[TensorRef]:
    chain = [t]
    while graph[t.node].op in FORWARDING_OPS and graph[t.node].inputs:
        t = graph[t.node].inputs[0]
        chain.append(t)
    return chain


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
