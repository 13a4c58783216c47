"""Run the kernels that need large scratch buffers one at a time, in the planned order.

Some CPU kernels allocate tens of MiB for themselves while they run: TensorFlow's convolution gradients
work through an im2col buffer sized to a ~30 MiB working set (``tfmem.sim.opmemory``). The simulator places
them by the emulated schedule, which takes op durations from the cost model; on the real executor two of
them can become ready together, run side by side and hold two such buffers at once (traced steps in
``experiments/results/simulator_order.md``: a convolution's two gradients at once). Chained by control edges
they cannot overlap whatever the timing; on a GPU, whose kernels run one after the other on a stream anyway,
the chain costs nothing.

Requires: nothing. Ensures: values are unchanged (control edges only, in a topological order, so no cycle).

Examples
--------
>>> from models import resnet
>>> from tfmem.ir.loading import load
>>> from tfmem.pipeline import PassContext
>>> built = resnet.build(depth=11, batch=32, image=32, width=8, classes=10)
>>> ir = load(built.graph, built.feed_shapes)
>>> result = SerializeScratch().run(ir, PassContext(tuple(built.fetches), None, None, None, built.feed_shapes))
>>> result.changed, result.report.control_edges_added > 0
(True, True)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from passes.timeline import StepTimeline
from tfmem.ir.devices import Placement
from tfmem.ir.editor import GraphEditor
from tfmem.ir.frames import maybe_dead
from tfmem.ir.graph import GraphIR
from tfmem.ir.ops import ALIAS_OPS, PERSISTENT_OUTPUT_OPS, VARIABLE_READ_OPS
from tfmem.pipeline import PassContext, PassReport, PassResult
from tfmem.sim.opmemory import allocated_bytes, scratch_bytes
from tfmem.units import format_bytes

# Ops that allocate nothing of their own (views, reads of variables): chaining them orders nothing useful.
UNCHAINED_OPS = ALIAS_OPS | VARIABLE_READ_OPS | PERSISTENT_OUTPUT_OPS
MIN_SCRATCH_BYTES = 1 << 20   # below this, two buffers side by side stay inside the plan's safety margin


@dataclass(frozen=True)
class SerializeScratch:
    """Chain the device ops whose kernels allocate ``MIN_SCRATCH_BYTES`` or more of scratch."""

    name: ClassVar[str] = "serialize_scratch"
    budget_independent: ClassVar[bool] = True
    peak_non_increasing: ClassVar[bool] = False

    def run(self, graph: GraphIR, ctx: PassContext) -> PassResult:
        placement = Placement(ctx.device, ctx.host)
        heavy = [n.name for n in graph.nodes if placement.domain(n.device) == "device"
                 and n.op not in UNCHAINED_OPS and scratch_bytes(graph, n.name) >= MIN_SCRATCH_BYTES]
        if len(heavy) < 2:
            return PassResult(graph, False, PassReport.empty(
                self.name, f"fewer than two ops need {format_bytes(MIN_SCRATCH_BYTES)} or more of scratch"))
        new = serialize_large_ops(graph, ctx, MIN_SCRATCH_BYTES, measure=scratch_bytes)
        added = sum(len(n.control_inputs) for n in new.nodes) - sum(len(n.control_inputs) for n in graph.nodes)
        if added == 0:
            return PassResult(graph, False, PassReport.empty(self.name, "the ops with large scratch are already ordered"))
        largest = max(scratch_bytes(graph, u) for u in heavy)
        note = (f"{len(heavy)} ops with {format_bytes(MIN_SCRATCH_BYTES)} or more of scratch (largest "
                f"{format_bytes(largest)}) run one at a time: {added} control edges")
        return PassResult(new, True, PassReport(self.name, True, control_edges_added=added, notes=(note,)))


def serialize_large_ops(graph: GraphIR, ctx: PassContext, min_bytes: int = 64 * 1024,
                        measure: Callable[[GraphIR, str], int] | None = None) -> GraphIR:
    """Chain the device ops that allocate ``min_bytes`` or more (outputs and scratch) in their one-thread order.

    Each waits for the previous one (a control edge, skipped where a data edge already orders them), so
    their working sets do not add up when the executor has threads to spare. The order is the one-thread
    schedule, which is topological, so the edges cannot close a cycle. ``measure`` says what an op allocates
    (default ``allocated_bytes``).
    """
    measure = measure or allocated_bytes
    profile = ctx.simulate(graph, inter_op_threads=1)
    timeline = StepTimeline.build(graph, ctx.fetches, profile, ctx.feed_shapes)
    placement = Placement(ctx.device, ctx.host)
    dead = maybe_dead(graph)  # an edge from an op a TF1 cond skips would stop the next one
    big = [u for u in timeline.order if not timeline.eg.is_region(u) and u not in dead
           and placement.domain(graph[u].device) == "device"
           and measure(graph, u) >= min_bytes
           and graph[u].op not in UNCHAINED_OPS]
    editor = GraphEditor(graph)
    for previous, current in zip(big, big[1:], strict=False):
        if previous not in graph[current].predecessors:
            editor.add_control_inputs(current, [previous])
    return editor.finish()
