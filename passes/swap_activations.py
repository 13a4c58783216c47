"""Swap activations to host memory while they wait for their next use, and prefetch them back in time.

A training step keeps most forward activations alive until the backward pass reads them. This pass finds
the tensors that are resident but idle at the simulated device peak and, largest ``bytes x idle time`` first,
sends each to ``host`` right after its last use before the peak (a host ``Identity``, the *swap-out*) and
brings it back before its next use (a host ``Identity`` of the swap-out, the *swap-in*, delayed by a
control edge from a device op that ends one transfer-time earlier; see ``passes.transfer``). It stops as soon
as the simulated peak meets the budget, so nothing moves that need not.

Requires: a budget and a ``host`` device in the context (without either it changes nothing).
A late reader that reads the tensor through a reshape (``passes.transfer.VIEW_OPS``) reads the same reshape
of the swapped-in copy, made on the device: the reshape is a view, so otherwise it would hold the buffer.

Ensures: the same values are computed (only ``Identity`` ops, reshapes of copies and control edges are
added); every added op carries ``_grappler_do_not_remove``; control edges point forward in a topological
order, so no cycle.

Examples
--------
>>> from tfmem.examples import mlp
>>> from tfmem.ir.loading import load
>>> from tfmem.pipeline import PassContext
>>> built = mlp(batch=2048, dims=(256, 512, 512, 512, 10))   # activations outweigh the weights
>>> ir = load(built.graph)
>>> device, host = "/job:worker/task:0/device:CPU:0", "/job:host/task:0/device:CPU:0"
>>> ctx = PassContext(tuple(built.fetches), None, device, host, inter_op_threads=1)
>>> peak = ctx.simulate(ir).peak_bytes
>>> ctx = PassContext(tuple(built.fetches), int(peak * 0.9), device, host, inter_op_threads=1)
>>> result = SwapActivations().run(ir, ctx)
>>> result.changed, ctx.simulate(result.graph).peak_bytes <= peak * 0.9
(True, True)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from passes.greedy import descend, take_batch
from passes.timeline import StepTimeline
from passes.transfer import (
    Prefetch,
    activation_bytes,
    add_prefetches,
    frame_readers,
    group_consumers,
    held_list,
    identity_attrs,
    movable,
    plan_prefetches,
    readers_through_aliases,
    trigger_candidates,
)
from tfmem.ir.devices import Placement
from tfmem.ir.editor import GraphEditor
from tfmem.ir.frames import find_regions
from tfmem.ir.graph import GraphIR, TensorRef
from tfmem.ir.ops import ALIAS_OPS, PERSISTENT_OUTPUT_OPS, RESOURCE_VARIABLE_OPS, VARIABLE_READ_OPS
from tfmem.ir.verify import SWAP_IN_ATTR, SWAP_OUT_ATTR
from tfmem.pipeline import PassContext, PassReport, PassResult
from tfmem.sim import costmodel
from tfmem.sim.opmemory import viewed_input
from tfmem.sim.profile import MemoryProfile
from tfmem.sim.tensor_list_memory import ListHoldings, list_holdings
from tfmem.units import format_bytes


@dataclass(frozen=True)
class SwapCandidate:
    tensor: TensorRef
    nbytes: int
    idle_s: float                      # from the last early use to the first late one (simulated)
    prefetches: tuple[Prefetch, ...]
    idle_from_s: float = 0.0           # when the last early use ends
    reads: Mapping[str, TensorRef] = field(default_factory=dict)   # reader -> identity or view of the tensor it names

    @property
    def score(self) -> float:
        return self.nbytes * self.idle_s


def buffer_root(graph: GraphIR, tensor: TensorRef) -> TensorRef:
    """The tensor whose buffer ``tensor`` occupies: itself, or the source of the alias or view it is.

    Views are the kernels' (``tfmem.sim.opmemory.VIEW_RULES``): a dim-0 slice of a fed batch shares the batch's buffer.

    >>> import tensorflow as tf
    >>> from tfmem.ir.loading import load
    >>> g = tf.Graph()
    >>> with g.as_default():
    ...     x = tf.compat.v1.placeholder(tf.float32, (4, 64), name="x")
    ...     row = tf.identity(x[1], name="row")
    >>> str(buffer_root(load(g), TensorRef("row", 0)))
    'x:0'
    """
    while True:
        node = graph[tensor.node]
        if node.op in ALIAS_OPS and node.inputs and tensor.index == 0:
            tensor = node.inputs[0]
            continue
        viewed = viewed_input(node, graph, tensor.index)
        if viewed is None:
            return tensor
        tensor = node.inputs[viewed]


def shares_persistent_buffer(graph: GraphIR, tensor: TensorRef) -> bool:
    """Whether ``tensor`` is a view of a variable or constant (moving it would free nothing)."""
    node = graph[buffer_root(graph, tensor).node]
    return node.op in VARIABLE_READ_OPS or node.op in PERSISTENT_OUTPUT_OPS or node.op in RESOURCE_VARIABLE_OPS


@dataclass(frozen=True)
class SwapActivations:
    """Swap idle activations to ``ctx.host`` until the simulated device peak meets ``ctx.target_bytes``."""

    name: ClassVar[str] = "swap_activations"
    budget_independent: ClassVar[bool] = False
    peak_non_increasing: ClassVar[bool] = True
    min_bytes: int = 64 * 1024          # below this a transfer's latency costs more than the bytes are worth
    max_rounds: int = 12                # simulations of batches (``passes.greedy.descend``)
    overshoot: float = 1.25             # swap this many times the excess per round (the peak moves)
    link: costmodel.DeviceSpec = field(default=costmodel.DEFAULT_DEVICE)

    def run(self, graph: GraphIR, ctx: PassContext) -> PassResult:
        if ctx.host is None:
            return PassResult(graph, False, PassReport.empty(self.name, "no host device given (host=...)"))
        target_bytes = ctx.target_bytes
        if target_bytes is None:
            return PassResult(graph, False, PassReport.empty(
                self.name, "no budget: swapping costs transfer time, so it runs only to meet a budget"))
        profile = ctx.simulate(graph)
        if profile.peak_bytes <= target_bytes:
            return PassResult(graph, False, PassReport.empty(self.name, "already within the budget"))
        start_peak = profile.peak_bytes
        host = ctx.host
        current, profile, done = descend(
            graph, profile, target_bytes,
            pick=lambda g, prof, excess, tried: self._pick(g, ctx, prof, excess, tried),  # type: ignore[arg-type]
            apply=lambda g, batch: apply_swaps(g, batch, host), simulate=ctx.simulate,
            max_simulations=self.max_rounds)
        if not done:
            return PassResult(graph, False, PassReport.empty(
                self.name, f"no idle activation at the peak could be swapped (peak {format_bytes(start_peak)})"))
        return PassResult(current, True, _report(self.name, done, start_peak, profile, target_bytes))

    def _pick(self, graph: GraphIR, ctx: PassContext, profile: MemoryProfile, excess: int,
              exclude: set[TensorRef]) -> list[SwapCandidate]:
        timeline = StepTimeline.build(graph, ctx.fetches, profile, ctx.feed_shapes)
        candidates = sorted(self._candidates(graph, ctx, timeline, profile, exclude), key=lambda c: -c.score)
        return take_batch(candidates, excess, self.overshoot)

    def _candidates(self, graph: GraphIR, ctx: PassContext, timeline: StepTimeline,
                    profile: MemoryProfile, exclude: set[TensorRef]) -> list[SwapCandidate]:
        """Tensors resident but idle at the peak: early readers before it, late ones after."""
        return self.candidates_at(graph, ctx, timeline, peak_split(timeline, profile), exclude=exclude)

    def candidates_at(self, graph: GraphIR, ctx: PassContext, timeline: StepTimeline, split: PeakSplit,
                      exclude: Collection[TensorRef] = (), just_in_time: bool = False) -> list[SwapCandidate]:
        """Activations made up to ``split``'s unit and read after it (not by it), each swapped over that unit;
        with ``just_in_time``, each also with its copies back started just before their readers."""
        return self._split_candidates(graph, ctx, timeline, timeline.order[:split.at_peak + 1], set(exclude),
                                      [split], just_in_time)

    def candidates_over_gaps(self, graph: GraphIR, ctx: PassContext, timeline: StepTimeline,
                             gaps: int = 1, just_in_time: bool = False) -> list[SwapCandidate]:
        """Every swappable activation, split at each of its ``gaps`` longest idle gaps (what the planner chooses
        among, at most one per tensor); with ``just_in_time``, each also with its copies back started by the
        unit just before their readers, where that differs from the trigger that hides the transfer."""
        splits = [GapSplit(timeline, nth) for nth in range(gaps)]
        return self._split_candidates(graph, ctx, timeline, timeline.order, set(), splits, just_in_time)

    def _split_candidates(self, graph: GraphIR, ctx: PassContext, timeline: StepTimeline, producers: Sequence[str],
                          exclude: set[TensorRef], splits: Sequence[Split],
                          just_in_time: bool = False) -> list[SwapCandidate]:
        """Candidates whose readers a split puts early (before the swap) and late (after it): one per tensor and
        split in ``splits`` that sends some readers late (two with ``just_in_time``, see ``candidates_over_gaps``).
        """
        usable = trigger_candidates(graph, timeline)
        lists = list_holdings(timeline.eg)
        out = []
        for t, split in itertools.product(device_activations(graph, ctx, timeline, producers, self.min_bytes,
                                                             exclude, lists), splits):
            readers = split_readers(graph, timeline, t, split)
            if readers is None:
                continue
            nbytes = activation_bytes(graph, t, lists)
            idle_from = max([timeline.end_s[timeline.eg.unit_of[t.node]]] + [timeline.end_s[c] for c in readers.early])
            groups = group_consumers(readers.late, timeline, split_gap_s=2 * self.link.transfer_s(nbytes))
            prefetches = plan_prefetches(groups, nbytes, timeline, self.link, usable, readers.floor)
            if any(p.trigger is None for p in prefetches):
                continue
            idle = timeline.start_s[readers.late[0]] - idle_from
            out.append(SwapCandidate(t, nbytes, max(idle, 0.0), tuple(prefetches), idle_from, readers.aliased))
            if just_in_time:
                # A copy that lands while a large op runs adds to that op's peak; started after it instead, the
                # copy's transfer is exposed, but the tensor stays away for all of its gap.
                late = plan_prefetches(groups, nbytes, timeline, self.link, usable, readers.floor, lead_s=0.0)
                if late != prefetches and all(p.trigger is not None for p in late):
                    out.append(SwapCandidate(t, nbytes, max(idle, 0.0), tuple(late), idle_from, readers.aliased))
        return out


def device_activations(graph: GraphIR, ctx: PassContext, timeline: StepTimeline, producers: Sequence[str],
                       min_bytes: int, exclude: Collection[TensorRef] = (),
                       lists: ListHoldings | None = None) -> list[TensorRef]:
    """Transient device tensors of ``producers`` that only device ops read: what swap and recompute may free.

    With ``lists`` (``tfmem.sim.tensor_list_memory``), ``TensorList`` handles that hold items count too, also
    where a v1 loop hands one to another (an RNN's forward loop to its gradient loop): TensorFlow copies a list
    between devices item by item, so a swap frees its items (``tests/test_swap_lists.py``).
    """
    eg = timeline.eg
    placement = Placement(ctx.device, ctx.host)
    regions = find_regions(graph) if lists is not None else {}

    def on_device(unit: str, tensor: TensorRef | None = None) -> bool:
        if not eg.is_region(unit):
            return placement.domain(graph[unit].device) == "device"
        if lists is None or tensor is None:   # a frame reads it whole, on whichever devices its ops are
            return False
        nodes = [tensor.node] if eg.unit_of.get(tensor.node) == unit else frame_readers(graph, regions, unit, tensor)
        return bool(nodes) and all(placement.domain(graph[n].device) == "device" for n in nodes)

    out = []
    for u in producers:
        if eg.is_region(u):   # a frame's outputs: only the lists it hands on (an RNN's activations)
            outputs = [t for t in eg.outputs_of(u) if held_list(t, lists) and on_device(u, t)]
        elif not on_device(u) or graph[u].attr_bool(SWAP_IN_ATTR) or graph[u].op in ALIAS_OPS:
            continue  # an alias op's output is a view: its source is the candidate
        else:
            outputs = [TensorRef(u, i) for i in range(len(graph[u].outputs))]
        for t in outputs:
            # A view (a slice of a fed batch, say) frees nothing when it leaves: its source holds the buffer.
            # (A frame's list is charged to its Exit, which buffer_root would follow into the loop.)
            if (activation_bytes(graph, t, lists) < min_bytes or t in eg.fetched or t in eg.fed
                    or not (movable(graph, t) or held_list(t, lists)) or t in exclude
                    or (not eg.is_region(u) and (buffer_root(graph, t) != t or shares_persistent_buffer(graph, t)))):
                continue
            readers = readers_through_aliases(graph, eg, t)
            # Other devices' readers: leave it. A frame may read it only when it is a list (what was tested).
            if (readers and all(on_device(c, readers[c]) for c in readers)
                    and (held_list(t, lists) or not any(eg.is_region(c) for c in readers))):
                out.append(t)
    return out


# Given a tensor's producer and its readers (in rank order), the rank of the last reader that uses it before it
# leaves the device; None when it should stay.
Split = Callable[[str, list[str]], int | None]


@dataclass(frozen=True)
class ReaderSplit:
    """A tensor's readers before it leaves the device and after it comes back."""

    early: list[str]
    late: list[str]                     # in rank order
    floor: int                          # a trigger for the late readers must rank above this
    aliased: dict[str, TensorRef]       # late or early readers that name an identity or a view of the tensor


def split_readers(graph: GraphIR, timeline: StepTimeline, tensor: TensorRef, split: Split) -> ReaderSplit | None:
    """Readers of ``tensor`` (through identities and views) split by ``split``; None when none would read it late."""
    reads = readers_through_aliases(graph, timeline.eg, tensor)
    readers = sorted(reads, key=timeline.rank.__getitem__)
    last_early = split(timeline.eg.unit_of[tensor.node], readers)
    if last_early is None:
        return None
    early = [c for c in readers if timeline.rank[c] <= last_early]
    late = [c for c in readers if timeline.rank[c] > last_early]
    if not late:
        return None
    floor = max([last_early] + [timeline.rank[c] for c in early])
    return ReaderSplit(early, late, floor, {r: read for r, read in reads.items() if read != tensor})


@dataclass(frozen=True)
class PeakSplit:
    """Early = ranked up to the unit running at the simulated peak (a tensor that peak reads stays)."""

    at_peak: int
    peak_unit: str

    def __call__(self, producer: str, readers: list[str]) -> int | None:
        return None if self.peak_unit in readers else self.at_peak


def peak_split(timeline: StepTimeline, profile: MemoryProfile) -> PeakSplit:
    return PeakSplit(peak_rank(timeline, profile), profile.peak_unit)


@dataclass(frozen=True)
class GapSplit:
    """Early = before the ``nth`` longest wait between two uses (0: the longest; see ``gap_splits``)."""

    timeline: StepTimeline
    nth: int = 0

    def __call__(self, producer: str, readers: list[str]) -> int | None:
        ranks = gap_splits(self.timeline, producer, readers)
        return ranks[self.nth] if self.nth < len(ranks) else None


def gap_splits(timeline: StepTimeline, producer: str, readers: list[str]) -> list[int]:
    """The ranks after which ``readers`` (sorted by rank) wait for the next one, the longest wait first.

    The producer counts as the first use: a tensor made long before its first reader splits right there.
    """
    gaps = []
    previous, busy_until = producer, timeline.end_s[producer]
    for c in readers:
        gap = timeline.start_s[c] - busy_until
        if gap > 0.0:
            gaps.append((-gap, timeline.rank[previous]))
        previous, busy_until = c, max(busy_until, timeline.end_s[c])
    return [rank for _, rank in sorted(gaps)]


def peak_rank(timeline: StepTimeline, profile: MemoryProfile) -> int:
    """Rank of the unit running at the simulated peak (the latest started by then, if the runtime renamed it)."""
    if profile.peak_unit in timeline.rank:
        return timeline.rank[profile.peak_unit]
    started = [timeline.rank[u] for u in timeline.order if timeline.start_s[u] <= profile.peak_time_s]
    return max(started, default=0)


def apply_swaps(graph: GraphIR, batch: Sequence[SwapCandidate], host: str) -> GraphIR:
    """Swap each candidate's tensor out to ``host`` and back in for its late readers (one swap-in per group)."""
    editor = GraphEditor(graph)
    for c in batch:
        out_name = editor.unique_name(f"{c.tensor.node}/tfmem_swap_out_{c.tensor.index}")
        editor.add_op(out_name, "Identity", [c.tensor], [graph.spec(c.tensor)], device=host,
                      attrs=identity_attrs(graph, c.tensor, SWAP_OUT_ATTR))
        add_prefetches(editor, TensorRef(out_name, 0), c.tensor, c.prefetches, host,
                       f"{c.tensor.node}/tfmem_swap_in_{c.tensor.index}", SWAP_IN_ATTR, c.reads)
    return editor.finish()


def _report(name: str, done: list[SwapCandidate], start_peak: int, profile: MemoryProfile,
            target_bytes: int) -> PassReport:
    moved = sum(c.nbytes * (1 + len(c.prefetches)) for c in done)
    transfer = sum(p.transfer_s for c in done for p in c.prefetches)
    exposed = sum(p.exposed_s for c in done for p in c.prefetches)
    ins = sum(len(c.prefetches) for c in done)
    met = "meets" if profile.peak_bytes <= target_bytes else "still above"
    notes = (
        f"swapped {len(done)} tensors ({format_bytes(sum(c.nbytes for c in done))}) with {ins} swap-ins; "
        f"simulated peak {format_bytes(start_peak)} -> {format_bytes(profile.peak_bytes)}, {met} the budget",
        f"swap-in transfer {transfer * 1e3:.1f} ms per step (cost model), of which "
        f"{(transfer - exposed) * 1e3:.1f} ms hidden behind compute and {exposed * 1e3:.1f} ms exposed",
    )
    details: dict[str, object] = {
        # per tensor: name, bytes, swap-ins, their transfer seconds and the exposed part (cost model)
        "swapped": [(str(c.tensor), c.nbytes, len(c.prefetches), sum(p.transfer_s for p in c.prefetches),
                     sum(p.exposed_s for p in c.prefetches)) for c in done],
        "transfer_s": transfer, "exposed_s": exposed,
    }
    return PassReport(name, True, nodes_added=len(done) + ins, control_edges_added=ins, bytes_moved=moved,
                      notes=notes, details=details)
