"""Choose a memory-aware order and cut it into partitions (groups of ops that may run together).

Each strategy in ``passes.ordering`` proposes a topological order; a cheap one-thread liveness model
(``tfmem.sim.analysis.order_footprint``) scores each, the lowest estimated peak wins, and a local search around
its peak (``passes.ordering.refine``) improves it where it can. The resulting order is then
cut into partitions that are safe to run concurrently: a partition grows along the order while everything it
allocates, added to what is live when it starts, stays within ``1 + slack`` times the order's own one-thread
peak. So if ``limit_parallelism`` lets one partition run at a time, its ops may interleave in any way and the
peak still stays near that of the one-thread order. Every executed node is tagged with ``_tfmem_partition``
and ``_tfmem_order`` attrs; the graph's behaviour does not change. v1 control-flow frames are single units and
never cut.

Requires: an annotated graph. Ensures: same ops, same edges, only attrs added.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

from tensorflow.core.framework import attr_value_pb2

from passes.ordering import STRATEGIES, OrderingProblem, refine
from tfmem.ir.execution import ExecutionGraph
from tfmem.ir.graph import GraphIR, OpNode
from tfmem.pipeline import PassContext, PassReport, PassResult
from tfmem.sim import costmodel
from tfmem.sim.analysis import OrderFootprint, analyse
from tfmem.units import format_bytes

SEARCH_WORK = 100_000  # units x tries the local search may spend
PARTITION_ATTR = "_tfmem_partition"
ORDER_ATTR = "_tfmem_order"


@dataclass(frozen=True)
class Partition:
    """Tag every executed op with a partition index along the best memory-aware order."""

    name: ClassVar[str] = "partition"
    budget_independent: ClassVar[bool] = True
    peak_non_increasing: ClassVar[bool] = True
    slack: float = 0.0       # how far above the order's one-thread peak a partition's worst case may go
    search_evals: int = 200  # most orders the local search around the peak scores (fewer on large graphs)

    def run(self, graph: GraphIR, ctx: PassContext) -> PassResult:
        # The simulator's analysis of this graph (cached, and shared with copies that differ only in tags)
        # holds the footprint model that scores orders; limit_parallelism and optimize reuse it.
        analysis = analyse(graph, list(ctx.fetches), list(ctx.feed_shapes), costmodel.DEFAULT_DEVICE)
        eg = analysis.eg
        problem = OrderingProblem(eg, analysis.footprints)
        scored = []
        for strategy, make_order in STRATEGIES.items():
            footprint = problem.footprints.footprint(make_order(problem))
            scored.append((footprint.peak_bytes, strategy, footprint))
        scored.sort(key=lambda s: (s[0], s[1] != "tf_natural"))
        peak, winner, footprint = scored[0]
        # Local search costs one footprint (linear in the graph) per try: fewer tries on large graphs.
        evals = min(self.search_evals, max(2, SEARCH_WORK // max(len(eg.units), 1)))
        order, refined = refine(problem, list(footprint.order), evals)
        if refined.peak_bytes < peak:
            scored.insert(0, (refined.peak_bytes, f"{winner}+search", refined))
            peak, winner, footprint = scored[0]
        cuts = safe_cuts(footprint, int(peak * (1 + self.slack)))
        order = list(footprint.order)
        new = _tag(graph, eg, order, _partition_indices(order, cuts))
        natural = next(s[0] for s in scored if s[1] == "tf_natural")
        notes: tuple[str, ...] = (
            "orders scored (estimated transient peak, one thread): "
            + ", ".join(f"{s[1]} {format_bytes(s[0])}" for s in scored),
            f"{winner} wins" + (f", {natural / max(peak, 1):.2f}x below TF's own order" if natural > peak else ""),
            f"{len(cuts) + 1} partitions over {len(order)} units",
        )
        frames = sorted(u.removeprefix("frame:") for u in eg.units if eg.is_region(u))
        if frames:  # every pass leaves a frame's ops alone: say so where the plan is reported
            notes += (f"{len(frames)} v1 loop frame(s) kept whole, their ops left as they are: {', '.join(frames)}",)
        details = {"winner": winner, "peaks": {s[1]: s[0] for s in scored}, "partitions": len(cuts) + 1,
                   "frames": frames}
        return PassResult(new, True, PassReport(self.name, changed=True, notes=notes, details=details))


def safe_cuts(footprint: OrderFootprint, target_bytes: int) -> list[int]:
    """Positions after which to cut so that each partition's worst case stays within ``target_bytes``.

    A unit whose own worst case is above the target gets a partition of its own.

    Examples
    --------
    >>> fp = OrderFootprint(("a", "b", "c", "d"), alloc=(4, 1, 8, 1), carried=(0, 4, 1, 8))
    >>> safe_cuts(fp, 9)   # [a, b] (0 + 4 + 1), [c] (1 + 8), [d] (8 + 1)
    [1, 2]
    """
    cuts, start = [], 0
    for i in range(1, len(footprint.order)):
        if footprint.slice_bound(start, i + 1) > target_bytes:
            cuts.append(i - 1)
            start = i
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
