"""Choose a memory-aware order and cut it into partitions (groups of ops that may run together).

Each strategy in ``passes.ordering`` proposes a topological order; the simulator scores each (one thread,
that exact order) and the lowest peak wins. The winning order is cut into at most ``max_partitions`` partitions of
about equal estimated work, each cut placed where the fewest bytes are live, and every executed node is tagged with ``_tfmem_partition`` and
``_tfmem_order`` attrs. The graph's behaviour does not change: ``limit_parallelism`` reads the tags and
decides how many partitions may run at once. v1 control-flow frames are single units and never cut.

Requires: an annotated graph. Ensures: same ops, same edges, only attrs added.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

from tensorflow.core.framework import attr_value_pb2

from passes.ordering import STRATEGIES, OrderingProblem
from tfmem import costmodel
from tfmem.execution import ExecutionGraph
from tfmem.ir import GraphIR, OpNode
from tfmem.pipeline import PassContext, PassReport, PassResult
from tfmem.units import format_bytes

PARTITION_ATTR = "_tfmem_partition"
ORDER_ATTR = "_tfmem_order"


@dataclass(frozen=True)
class Partition:
    """Tag every executed op with a partition index along the best memory-aware order."""

    name: ClassVar[str] = "partition"
    max_partitions: int = 64
    min_partition_units: int = 2

    def run(self, graph: GraphIR, ctx: PassContext) -> PassResult:
        eg = ExecutionGraph.build(graph, ctx.fetches, ctx.feed_shapes)
        problem = OrderingProblem(eg)
        scored = []
        for strategy, make_order in STRATEGIES.items():
            order = make_order(problem)
            profile = ctx.simulate(graph, order=order, grappler=False)
            scored.append((profile.peak_bytes, strategy, order, profile))
        scored.sort(key=lambda s: (s[0], s[1] != "tf_natural"))
        peak, winner, order, profile = scored[0]
        weight = {u: sum(costmodel.op_time_s(graph[n], graph) - costmodel.DEFAULT_DEVICE.launch_overhead_s
                         for n in eg.members[u]) for u in eg.units}
        cuts = self._cuts(order, profile.timeline, {u: max(w, 0.0) for u, w in weight.items()})
        part_of = _partition_indices(order, cuts)
        new = _tag(graph, eg, order, part_of)
        natural = next(s[0] for s in scored if s[1] == "tf_natural")
        notes = (
            "orders scored (simulated peak, one thread): "
            + ", ".join(f"{s[1]} {format_bytes(s[0])}" for s in scored),
            f"{winner} wins" + (f", {natural / max(peak, 1):.2f}x below TF's own order" if natural > peak else ""),
            f"{len(cuts) + 1} partitions over {len(order)} units",
        )
        details = {"winner": winner, "peaks": {s[1]: s[0] for s in scored}, "partitions": len(cuts) + 1}
        return PassResult(new, True, PassReport(self.name, changed=True, notes=notes, details=details))

    def _cuts(self, order: list[str], profile_timeline: tuple[tuple[float, int, int, str], ...],
              weight: dict[str, float]) -> list[int]:
        """Cut positions: partitions of about equal estimated work, each cut where the fewest bytes are live."""
        live_after: dict[str, int] = {}
        for _, device_bytes, _, unit in profile_timeline:  # a unit's last event is its end
            live_after[unit] = device_bytes
        working = sum(1 for u in order if weight[u] > 0)
        count = max(1, min(self.max_partitions, working // max(self.min_partition_units, 1)))
        total = sum(weight[u] for u in order) or 1.0
        prefix, acc = [], 0.0
        for u in order:
            acc += weight[u]
            prefix.append(acc)
        cuts: list[int] = []
        for j in range(1, count):
            low, high = total * (j - 0.5) / count, total * (j + 0.5) / count
            window = [i for i in range(len(order) - 1)
                      if low <= prefix[i] <= high and (not cuts or i > cuts[-1])]
            if window:
                cuts.append(min(window, key=lambda i: (live_after.get(order[i], 0), abs(prefix[i] - total * j / count))))
        return cuts


def _partition_indices(order: list[str], cuts: list[int]) -> dict[str, int]:
    part_of, part, cut_set = {}, 0, set(cuts)
    for i, unit in enumerate(order):
        part_of[unit] = part
        if i in cut_set:
            part += 1
    return part_of


def _tag(graph: GraphIR, eg: ExecutionGraph, order: list[str], part_of: dict[str, int]) -> GraphIR:
    position = {u: i for i, u in enumerate(order)}
    nodes = []
    for node in graph.nodes:
        unit = eg.unit_of.get(node.name)
        if unit is None:
            nodes.append(node)
            continue
        attrs = dict(node.attrs)
        attrs[PARTITION_ATTR] = attr_value_pb2.AttrValue(i=part_of[unit])
        attrs[ORDER_ATTR] = attr_value_pb2.AttrValue(i=position[unit])
        nodes.append(OpNode(node.name, node.op, node.inputs, node.control_inputs, node.device, node.outputs,
                            MappingProxyType(attrs), node.proto))
    return graph.replace_nodes(tuple(nodes))
