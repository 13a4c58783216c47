"""Recompute activations instead of keeping them: free a tensor after its early uses, rebuild it for the late ones.

For a tensor idle at the simulated device peak, the pass clones the few ops that produce it from tensors
that stay on the device anyway (variables, feeds, constants, or activations that a later op still reads),
and makes its later readers use the clone. The clones wait for a control edge from the op that runs just
before their first reader, so they run late, and the original tensor dies after its early uses. Candidates
are ranked by bytes freed per second of recomputation (cost model); the pass stops as soon as the
simulated peak meets the budget.

Never cloned: stateful ops (random number generators, variable reads and updates, queues), ops inside v1
control-flow frames, and ops with reference inputs, so every clone computes bit-identical values.

Requires: a budget. Ensures: the same values are computed; clones carry ``_grappler_do_not_remove`` and a
control input (which also keeps Grappler's duplicate elimination from merging them with the originals).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.framework import op_def_registry

from passes.greedy import descend, take_batch
from passes.swap_activations import (
    GapSplit,
    Split,
    buffer_root,
    device_activations,
    peak_split,
    shares_persistent_buffer,
    split_readers,
)
from passes.timeline import StepTimeline
from passes.transfer import group_consumers, same_view, trigger_candidates
from tfmem.ir.editor import GraphEditor
from tfmem.ir.graph import GraphIR, TensorRef
from tfmem.ir.ops import NEVER_CLONED, PERSISTENT_OUTPUT_OPS, PLACEHOLDER_OPS
from tfmem.pipeline import PassContext, PassReport, PassResult
from tfmem.sim import costmodel
from tfmem.sim.profile import MemoryProfile
from tfmem.units import format_bytes

RECOMPUTE_TAG = "_tfmem_recompute"


@dataclass(frozen=True)
class RecomputePlan:
    tensor: TensorRef
    nbytes: int
    chain: tuple[str, ...]            # ops to clone, producers first
    groups: tuple[tuple[tuple[str, ...], str], ...]   # (late readers, trigger) per clone set
    compute_s: float                  # cost-model time of one clone set
    early_readers: tuple[str, ...] = ()
    reads: Mapping[str, TensorRef] = field(default_factory=dict)   # reader -> identity or view of the tensor it names

    @property
    def total_s(self) -> float:
        """Recomputation time per step: one clone set per group of late readers."""
        return self.compute_s * len(self.groups)

    @property
    def score(self) -> float:
        return self.nbytes / max(self.total_s, 1e-9)


def is_recomputable(graph: GraphIR, name: str) -> bool:
    """Whether ``name`` can run a second time with the same result (stateless, no refs, not a source).

    ``name`` is a node of ``graph`` or a unit of its ``ExecutionGraph``: False for a v1 frame's unit
    (``frame:<name>``, which no node name can be, having a colon), as a loop is never cloned.

    Raises
    ------
    KeyError
        For any other name that is not a node of ``graph``: a caller asking about another graph's node.
    """
    if name.startswith("frame:") and name not in graph:
        return False
    node = graph[name]
    if node.op in NEVER_CLONED or node.op in PERSISTENT_OUTPUT_OPS or node.op in PLACEHOLDER_OPS:
        return False
    op_def = op_def_registry.get(node.op)
    if op_def is None or op_def.is_stateful:
        return False
    return not any(graph.spec(t).dtype.endswith("_ref") or graph.spec(t).dtype == "resource" for t in node.inputs)


@dataclass(frozen=True)
class Recompute:
    """Recompute idle activations until the simulated device peak meets ``ctx.target_bytes``."""

    name: ClassVar[str] = "recompute"
    budget_independent: ClassVar[bool] = False
    peak_non_increasing: ClassVar[bool] = True
    min_bytes: int = 64 * 1024
    max_chain: int = 4                 # at most this many ops cloned per tensor
    max_rounds: int = 12               # simulations of batches (``passes.greedy.descend``)
    overshoot: float = 1.25
    cost_device: costmodel.DeviceSpec = field(default=costmodel.DEFAULT_DEVICE)
    # Only tensors that cost at most this many seconds of recomputation per byte freed (None: any); the planner
    # sets it to what copying a byte out and back costs, to recompute only where that is cheaper than swapping.
    max_s_per_byte: float | None = None

    def run(self, graph: GraphIR, ctx: PassContext) -> PassResult:
        target_bytes = ctx.target_bytes
        if target_bytes is None:
            return PassResult(graph, False, PassReport.empty(
                self.name, "no budget: recomputation costs compute time, so it runs only to meet a budget"))
        profile = ctx.simulate(graph)
        if profile.peak_bytes <= target_bytes:
            return PassResult(graph, False, PassReport.empty(self.name, "already within the budget"))
        start_peak = profile.peak_bytes
        current, profile, done = descend(
            graph, profile, target_bytes,
            pick=lambda g, prof, excess, tried: self._pick(g, ctx, prof, excess, tried),  # type: ignore[arg-type]
            apply=apply_recompute, simulate=ctx.simulate, max_simulations=self.max_rounds)
        if not done:
            return PassResult(graph, False, PassReport.empty(
                self.name, f"no idle activation at the peak is cheap to recompute (peak {format_bytes(start_peak)})"))
        cost = sum(p.total_s for p in done)
        met = "meets" if profile.peak_bytes <= target_bytes else "still above"
        notes = (f"recomputes {len(done)} tensors ({format_bytes(sum(p.nbytes for p in done))}) with "
                 f"{sum(len(p.chain) * len(p.groups) for p in done)} cloned ops, {cost * 1e3:.1f} ms of compute "
                 f"per step (cost model); simulated peak {format_bytes(start_peak)} -> "
                 f"{format_bytes(profile.peak_bytes)}, {met} the budget",)
        details: dict[str, object] = {"recomputed": [(str(p.tensor), p.nbytes, list(p.chain),
                                                      p.total_s) for p in done],
                                      "compute_s": cost}
        added = len(current) - len(graph)
        return PassResult(current, True, PassReport(self.name, True, nodes_added=added,
                                                    control_edges_added=sum(len(p.groups) for p in done),
                                                    notes=notes, details=details))

    def _pick(self, graph: GraphIR, ctx: PassContext, profile: MemoryProfile, excess: int,
              exclude: set[TensorRef]) -> list[RecomputePlan]:
        """The best-scoring plans, not in ``exclude``, that cover ``excess`` (``overshoot`` times)."""
        timeline = StepTimeline.build(graph, ctx.fetches, profile, ctx.feed_shapes)
        plans = sorted(self.candidates(graph, ctx, timeline, profile, exclude), key=lambda p: -p.score)
        if self.max_s_per_byte is not None:
            plans = [p for p in plans if p.total_s <= self.max_s_per_byte * p.nbytes]
        return take_batch(plans, excess, self.overshoot)

    def candidates(self, graph: GraphIR, ctx: PassContext, timeline: StepTimeline, profile: MemoryProfile,
                   exclude: set[TensorRef]) -> list[RecomputePlan]:
        """Tensors idle at the peak that a short chain of stateless ops can rebuild for their late readers."""
        split = peak_split(timeline, profile)
        return self._plans(graph, ctx, timeline, timeline.order[:split.at_peak + 1], exclude, [split])

    def candidates_over_gaps(self, graph: GraphIR, ctx: PassContext, timeline: StepTimeline,
                             gaps: int = 1) -> list[RecomputePlan]:
        """Every recomputable activation, split at each of its ``gaps`` longest idle gaps (what the planner
        chooses among, at most one per tensor)."""
        return self._plans(graph, ctx, timeline, timeline.order, set(),
                           [GapSplit(timeline, nth) for nth in range(gaps)])

    def _plans(self, graph: GraphIR, ctx: PassContext, timeline: StepTimeline, producers: Sequence[str],
               exclude: set[TensorRef], splits: Sequence[Split]) -> list[RecomputePlan]:
        usable = trigger_candidates(graph, timeline)
        recomputable = [u for u in producers if is_recomputable(graph, u)]
        out = []
        for t, split in itertools.product(device_activations(graph, ctx, timeline, recomputable, self.min_bytes,
                                                             exclude), splits):
            readers = split_readers(graph, timeline, t, split)
            if readers is None:
                continue
            chain = self._chain(graph, timeline, t.node, timeline.rank[readers.late[0]])
            if chain is None:
                continue
            floor, groups = readers.floor, []
            for group in group_consumers(readers.late, timeline, split_gap_s=0.0):
                first = min(group, key=lambda c: timeline.rank[c])
                trigger = timeline.trigger_for(first, 0.0, floor, usable)
                if trigger is None:
                    break
                groups.append((group, trigger))
                floor = max(timeline.rank[c] for c in group)
            else:
                compute = sum(costmodel.op_time_s(graph[n], graph, self.cost_device) for n in chain)
                out.append(RecomputePlan(t, graph.spec(t).nbytes or 0, chain, tuple(groups), compute,
                                         tuple(readers.early), readers.aliased))
        return out

    def _chain(self, graph: GraphIR, timeline: StepTimeline, producer: str, first_late: int) -> tuple[str, ...] | None:
        """Ops to clone so ``producer`` can run again at rank ``first_late`` without keeping new tensors alive."""
        eg = timeline.eg
        chain: list[str] = []

        def available(s: TensorRef) -> bool:
            if buffer_root(graph, s) in eg.fed or shares_persistent_buffer(graph, s) or s.node not in eg.unit_of:
                return True
            return any(timeline.rank[c] >= first_late for c in eg.consumers(s) if c not in chain)

        def visit(name: str, depth: int) -> bool:
            if name in chain:
                return True
            if (depth >= self.max_chain or len(chain) >= self.max_chain or not is_recomputable(graph, name)
                    or eg.is_region(eg.unit_of[name])):
                return False
            for s in graph[name].inputs:
                if not available(s) and not visit(s.node, depth + 1):
                    return False
            chain.append(name)
            return True

        return tuple(chain) if visit(producer, 0) else None


def apply_recompute(graph: GraphIR, plans: Sequence[RecomputePlan]) -> GraphIR:
    """Clone each plan's chain once per reader group and point those readers at the clone."""
    editor = GraphEditor(graph)
    for plan in plans:
        for k, (readers, trigger) in enumerate(plan.groups):
            clones: dict[str, str] = {}
            for name in plan.chain:
                node = graph[name]
                clone = editor.unique_name(f"{name}/tfmem_recompute_{k}")
                inputs = [TensorRef(clones[t.node], t.index) if t.node in clones else t for t in node.inputs]
                attrs = dict(node.attrs)
                attrs[RECOMPUTE_TAG] = attr_value_pb2.AttrValue(b=True)
                attrs.pop("_class", None)
                editor.add_op(clone, node.op, inputs, node.outputs, control_inputs=[trigger], device=node.device,
                              attrs=attrs)
                clones[name] = clone
            made: dict[TensorRef, TensorRef] = {}
            for reader in readers:  # a reader of an identity or a view of the tensor reads the same of the clone
                read = plan.reads.get(reader, plan.tensor)
                editor.rewire(reader, read, same_view(editor, TensorRef(clones[plan.tensor.node], plan.tensor.index),
                                                      read, plan.tensor, made))
    return editor.finish()
