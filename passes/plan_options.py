"""The planner's options: every way to free device memory it may choose (swap an activation over one of its
idle gaps, recompute it, keep a variable group on the host), what each frees when and costs, and how a chosen
set is applied to the graph."""

from __future__ import annotations

from collections.abc import Sequence

from passes.place_persistent import (
    PlacePersistent,
    chain_to_host,
    persistent_groups,
    place_groups,
    plan_group_prefetches,
)
from passes.plan_cover import (
    Option,
    copy_share,
    savings_outside,
)
from passes.recompute import Recompute, apply_recompute
from passes.swap_activations import SwapActivations, apply_swaps, device_activations
from passes.timeline import StepTimeline
from passes.transfer import activation_bytes, readers_through_aliases, trigger_candidates
from tfmem.ir.devices import Placement
from tfmem.ir.graph import GraphIR
from tfmem.pipeline import PassContext
from tfmem.sim import costmodel
from tfmem.sim.profile import MemoryProfile
from tfmem.sim.tensor_list_memory import list_holdings


def build_options(graph: GraphIR, ctx: PassContext, timeline: StepTimeline, profile: MemoryProfile,
                  kinds: Sequence[str], gaps: int, just_in_time: bool, link: costmodel.DeviceSpec) -> list[Option]:
    """Every swap, recompute and placement of ``kinds`` the planner may choose, with its savings and cost.

    A tensor may leave at any of its ``gaps`` longest idle gaps (one option each), and with ``just_in_time`` a
    swapped one may also come back after the op before its reader, as well as early enough to hide the copy.
    """
    out: list[Option] = []
    makespan = max(timeline.end_s.values(), default=0.0)
    if "swap" in kinds and ctx.host is not None:
        swaps = SwapActivations(link=link).candidates_over_gaps(graph, ctx, timeline, gaps,
                                                                     just_in_time)
        for c in swaps:
            back = min(timeline.end_s[p.trigger] for p in c.prefetches if p.trigger)
            transfer = sum(p.transfer_s for p in c.prefetches) + link.transfer_s(c.nbytes)
            cost = sum(p.exposed_s for p in c.prefetches) + copy_share(link) * transfer
            out.append(Option("swap", str(c.tensor), c.nbytes, cost,
                              ((c.idle_from_s, back, c.nbytes),), c))
    if "recompute" in kinds:
        for p in Recompute().candidates_over_gaps(graph, ctx, timeline, gaps):
            start = max([timeline.end_s[p.tensor.node]] + [timeline.end_s[c] for c in p.early_readers])
            back = min(timeline.end_s[trigger] for _, trigger in p.groups)
            out.append(Option("recompute", str(p.tensor), p.nbytes, p.total_s,
                              ((start, back, p.nbytes),), p))
    if "place" in kinds and ctx.host is not None:
        usable = trigger_candidates(graph, timeline)
        placement = Placement(ctx.device, ctx.host)
        for g in persistent_groups(graph, timeline.eg, placement, PlacePersistent().min_bytes):
            reads, _ = plan_group_prefetches(graph, g, timeline, usable, link)
            windows = {t: sorted((timeline.end_s[p.trigger] if p.trigger else 0.0,
                                  max(timeline.end_s[c] for c in p.consumers), graph.spec(t).nbytes or 0)
                                 for p in prefetches) for t, prefetches in reads}
            exposed = sum(p.exposed_s for _, ps in reads for p in ps)
            if g.resident:
                # Created on the host: unplanned, each read's copy reaches the device as the step starts and
                # stays until its last reader. Timed prefetches save that outside their windows, and cost
                # only what they expose: the copies were made anyway.
                savings = tuple(s for t, w in windows.items() if w
                                for s in savings_outside(graph.spec(t).nbytes or 0, w, max(e for _, e, _ in w)))
                out.append(Option("place", ",".join(g.roots), g.nbytes, exposed, savings, g))
                continue
            savings = savings_outside(g.nbytes, sorted(x for w in windows.values() for x in w), makespan)
            transfer = sum(p.transfer_s for _, ps in reads for p in ps) + link.transfer_s(g.nbytes)
            cost = exposed + copy_share(link) * transfer
            out.append(Option("place", ",".join(g.roots), g.nbytes, cost, savings, g))
    return out


def idle_windows(graph: GraphIR, ctx: PassContext, timeline: StepTimeline, min_bytes: int,
                 ) -> list[tuple[str, tuple[tuple[float, float, int], ...]]]:
    """Per swappable activation, every stretch between two of its uses: where some swap could free it.

    The planner's swap options split each tensor at one of its few longest idle gaps, while ``swap_activations``
    (its fallback) may split it elsewhere and swap a swapped-in copy again; a lower bound must allow all of it.
    """
    out = []
    lists = list_holdings(timeline.eg)
    for t in device_activations(graph, ctx, timeline, timeline.order, min_bytes, lists=lists):
        readers = sorted(readers_through_aliases(graph, timeline.eg, t), key=timeline.rank.__getitem__)
        nbytes = activation_bytes(graph, t, lists)
        busy_until, gaps = timeline.end_s[timeline.eg.unit_of[t.node]], []
        for c in readers:
            if timeline.start_s[c] > busy_until:
                gaps.append((busy_until, timeline.start_s[c], nbytes))
            busy_until = max(busy_until, timeline.end_s[c])
        if gaps:
            out.append((str(t), tuple(gaps)))
    return out


def apply_options(graph: GraphIR, chosen: Sequence[Option], timeline: StepTimeline, host: str | None,
                  link: costmodel.DeviceSpec) -> GraphIR:
    """Apply host placements, then swaps, then recomputations (each on the previous result)."""
    groups = [o.payload for o in chosen if o.kind == "place"]
    swaps = [o.payload for o in chosen if o.kind == "swap"]
    recomputes = [o.payload for o in chosen if o.kind == "recompute"]
    if groups and host is not None:
        graph = place_groups(graph, groups, timeline, host, link)  # type: ignore[arg-type]
    if swaps and host is not None:
        graph = apply_swaps(graph, swaps, host)  # type: ignore[arg-type]
    if recomputes:
        graph = apply_recompute(graph, recomputes)  # type: ignore[arg-type]
    if groups and host is not None:  # last: its chain must respect every edge the others added
        graph = chain_to_host(graph, groups, timeline, host)  # type: ignore[arg-type]
    return graph
