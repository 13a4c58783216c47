"""Peak descent: lower a plan's simulated peak by local moves on what is live at it, re-simulating each.

The planner's covering model and the greedy passes free tensors over whole idle gaps, bring copies back early
enough to hide their transfer, and bring each swapped tensor back once for all its late readers. Near a
graph's floor that leaves bytes on the device at the peak that need not be there: on ResNet-20 planned for
41 MiB, an 8 MiB copy read by the convolution gradient that runs beside the peak's 23.75 MiB-scratch one, and
2 MiB activations idle for a thousand ops; on a WGAN-GP, 1 MiB copies of host-placed weights prefetched up to
ten ops ahead of their readers. Each move takes one tensor live at the peak off the device while the peak's
op runs:

- a copy from the host (a swap-in, or a host-placed variable's prefetch) whose readers after the peak get a
  fresh copy of the same host tensor, started when the peak's op ends (if every reader is later, the copy
  itself waits for that op);
- an activation idle across the peak, swapped out after its last earlier reader and brought back just before
  its next one (``SwapActivations`` with ``just_in_time``);
- a tensor whose remaining readers could all run before the peak's op: that op waits for them, so the tensor
  is freed first.

The planner runs this only with ``Planner(peak_descent=True)``: with it, a held-out ResNet-20 plan that the
allocator-layout replay accepted ran out of memory (experiments/results/planner_heldout_descent.md).

Moves are tried largest tensor first; the first that lowers the peak is kept, and the search starts again at
the new peak, until the budget is met, no move lowers the peak, or the trial or time limit is reached. Every
trial is judged as ``judge`` makes it (the planner fences copies to the host, as ``optimize`` runs them). The
moves add host ``Identity`` ops and control edges only, so the values computed do not change; an edge is added
only where no path runs the other way, so no cycle is made.

Examples
--------
>>> from tfmem.examples import mlp
>>> from tfmem.ir.loading import load
>>> from tfmem.pipeline import PassContext
>>> built = mlp(batch=2048, dims=(256, 512, 512, 512, 10))
>>> ir = load(built.graph)
>>> device, host = "/job:worker/task:0/device:CPU:0", "/job:host/task:0/device:CPU:0"
>>> ctx = PassContext(tuple(built.fetches), None, device, host, inter_op_threads=1)
>>> peak = ctx.simulate(ir).peak_bytes
>>> ctx = PassContext(tuple(built.fetches), int(peak * 0.8), device, host, inter_op_threads=1)
>>> result = descend(ir, ctx, ctx.simulate(ir))
>>> result.moves > 0 and result.profile.peak_bytes < peak
True
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import networkx as nx

from passes.place_persistent import PREFETCH_TAG
from passes.swap_activations import SwapActivations, apply_swaps, peak_split
from passes.timeline import StepTimeline
from passes.transfer import Prefetch, add_prefetches, readers_through_aliases, trigger_candidates
from tfmem.ir.editor import GraphEditor
from tfmem.ir.graph import GraphIR, TensorRef
from tfmem.ir.verify import SWAP_IN_ATTR
from tfmem.pipeline import PassContext
from tfmem.sim import costmodel
from tfmem.sim.memsim import MemoryProfile

COPY_TAGS = (SWAP_IN_ATTR, PREFETCH_TAG)   # host Identity ops whose output a device op reads: copies to the device


@dataclass(frozen=True)
class Descent:
    """What ``descend`` reached: the graph, its simulation, and how many moves and trials it took."""

    graph: GraphIR
    profile: MemoryProfile
    moves: int
    trials: int


def descend(graph: GraphIR, ctx: PassContext, profile: MemoryProfile,
            judge: Callable[[GraphIR], GraphIR] | None = None, link: costmodel.DeviceSpec = costmodel.DEFAULT_DEVICE,
            max_trials: int = 48, time_limit_s: float = 20.0) -> Descent:
    """Move tensors live at ``profile``'s peak off the device until ``ctx.device_budget_bytes`` is met (see the
    module docstring); ``judge`` maps a trial graph to the graph to simulate (the planner fences it) and is
    what is returned. ``profile`` is ``graph``'s simulation.
    """
    judge = judge or (lambda g: g)
    budget = ctx.device_budget_bytes or 0
    deadline = time.perf_counter() + time_limit_s
    moves = trials = 0
    while profile.peak_bytes > budget and trials < max_trials and time.perf_counter() < deadline:
        improved = False
        for move in _moves(graph, ctx, profile, link):
            if trials >= max_trials or time.perf_counter() >= deadline:
                break
            trials += 1
            trial = judge(move())
            trial_profile = ctx.simulate(trial)
            if trial_profile.peak_bytes < profile.peak_bytes:
                graph, profile, improved = trial, trial_profile, True
                moves += 1
                break
        if not improved:
            break
    return Descent(graph, profile, moves, trials)


def _moves(graph: GraphIR, ctx: PassContext, profile: MemoryProfile, link: costmodel.DeviceSpec,
           ) -> list[Callable[[], GraphIR]]:
    """The moves at ``profile``'s peak, largest tensor first, each a thunk that makes the moved graph."""
    timeline = StepTimeline.build(graph, ctx.fetches, profile, ctx.feed_shapes)
    split = peak_split(timeline, profile)
    peak_unit = timeline.order[split.at_peak] if timeline.order else ""
    usable = trigger_candidates(graph, timeline)
    sized: list[tuple[int, int, Callable[[], GraphIR]]] = []
    copies = {TensorRef.parse(x.tensor): x.nbytes for x in profile.live_at_peak if x.kind == "copy"}
    if usable.get(peak_unit) and ctx.host is not None:
        for tensor, nbytes in copies.items():
            move = _later_copy(graph, timeline, tensor, peak_unit, ctx.host)
            if move is not None:
                sized.append((nbytes, len(sized), move))
    if usable.get(peak_unit):
        for x in profile.live_at_peak:
            if x.kind in ("transient", "copy"):
                move = _finish_first(graph, timeline, TensorRef.parse(x.tensor), peak_unit)
                if move is not None:
                    sized.append((x.nbytes, len(sized), move))
    if ctx.host is not None:
        swapper = SwapActivations(link=link)
        live = {TensorRef.parse(x.tensor) for x in profile.live_at_peak if x.kind != "scratch"}
        by_tensor = {}
        for c in swapper.candidates_at(graph, ctx, timeline, split, just_in_time=True):
            if c.tensor in live:
                by_tensor[c.tensor] = c   # the just-in-time variant comes last
        for c in by_tensor.values():
            sized.append((c.nbytes, len(sized), lambda c=c: apply_swaps(graph, [c], ctx.host)))
    sized.sort(key=lambda s: (-s[0], s[1]))
    return [move for _, _, move in sized]


def _later_copy(graph: GraphIR, timeline: StepTimeline, tensor: TensorRef, peak_unit: str, host: str,
                ) -> Callable[[], GraphIR] | None:
    """A move for a copy from the host live at the peak (a swap-in or a host-placed variable's prefetch): its
    readers after ``peak_unit`` read a copy started when ``peak_unit`` ends (the copy itself waits, when all its
    readers are later); None when it does not apply.

    Whatever waited for the copy waits for the new one too: a host variable's update waits for every prefetch
    of it (``passes.place_persistent``), or a late copy could read the updated value.
    """
    if tensor.node not in graph:
        return None
    node = graph[tensor.node]
    tag = next((t for t in COPY_TAGS if node.attr_bool(t)), None)
    if tag is None or not node.inputs:
        return None
    reads = readers_through_aliases(graph, timeline.eg, tensor)
    if not reads or peak_unit in reads or any(r not in timeline.rank for r in reads):
        return None
    at_peak = timeline.rank[peak_unit]
    late = sorted((r for r in reads if timeline.rank[r] > at_peak), key=timeline.rank.__getitem__)
    if not late:
        return None
    waiting = [n for n in graph.successors.get(tensor.node, ()) if tensor.node in graph[n].control_inputs]
    if len(late) == len(reads):
        if peak_unit in node.control_inputs or nx.has_path(graph.nx, tensor.node, peak_unit):
            return None

        def delay() -> GraphIR:
            editor = GraphEditor(graph)
            editor.add_control_inputs(tensor.node, [peak_unit])
            return editor.finish()
        return delay
    if any(nx.has_path(graph.nx, r, peak_unit) for r in (*late, *waiting)):
        return None

    def split_late() -> GraphIR:
        editor = GraphEditor(graph)
        prefetch = Prefetch(tuple(late), peak_unit, 0.0, 0.0)
        names = add_prefetches(editor, node.inputs[0], tensor, [prefetch], host, f"{tensor.node}/tfmem_again", tag,
                               {r: reads[r] for r in late})
        for n in waiting:
            editor.add_control_inputs(n, names)
        return editor.finish()
    return split_late


def _finish_first(graph: GraphIR, timeline: StepTimeline, tensor: TensorRef, peak_unit: str,
                  ) -> Callable[[], GraphIR] | None:
    """A move for a tensor live at the peak whose readers still to run could all run before ``peak_unit``:
    ``peak_unit`` waits for them, so the tensor is freed before it starts (two convolution gradients that
    read the same input: the one that needs the 8 MiB copy runs first, not beside the 23.75 MiB-scratch one).
    None when ``peak_unit`` reads the tensor or some reader cannot precede it."""
    if tensor.node not in graph or tensor.node not in timeline.rank:
        return None
    reads = readers_through_aliases(graph, timeline.eg, tensor)
    if (not reads or peak_unit in reads
            or any(r not in timeline.rank or r not in graph or timeline.eg.is_region(r) for r in reads)):
        return None
    starts = timeline.start_s[peak_unit]
    pending = sorted((r for r in reads if timeline.end_s[r] > starts and r not in graph[peak_unit].control_inputs),
                     key=timeline.rank.__getitem__)
    if not pending or any(nx.has_path(graph.nx, peak_unit, r) for r in pending):
        return None

    def wait() -> GraphIR:
        editor = GraphEditor(graph)
        editor.add_control_inputs(peak_unit, pending)
        return editor.finish()
    return wait
