"""Keep persistent tensors (variables, optimizer slots, large constants) in host memory; visit the device per use.

Weights idle most of the step: an MoE layer's experts wait for their turn, a deep net's first layers wait
through the whole middle of the step. This pass places a variable, every op that touches its storage (reads,
optimizer updates, initialisers: TensorFlow colocates them) and large constants on ``host``. Each group of
device ops that read the value close together in time gets its own prefetch: a host ``Identity`` delayed by
a control edge from the device op that ends one transfer-time earlier (``passes.transfer``), so a copy
reaches the device just before it is used and is freed after. Gradients travel to the host, where the update
runs beside its variable.

Variables are moved largest first, in batches, re-simulating after each, and the pass stops as soon as the
simulated peak meets the budget.

Requires: a budget and a ``host`` device in the context (without either it changes nothing).
Ensures: the same values are computed. Resource variables copy on write when a reader still holds the old
value, so a delayed prefetch reads what the original read did; for reference variables (``VariableV2``),
every update of the variable also waits for that variable's prefetches.

Examples
--------
>>> from tfmem.examples import moe_layer
>>> from tfmem.ir.loading import load
>>> from tfmem.pipeline import PassContext
>>> built = moe_layer(experts=8)
>>> ir = load(built.graph)
>>> device, host = "/job:worker/task:0/device:CPU:0", "/job:host/task:0/device:CPU:0"
>>> ctx = PassContext(tuple(built.fetches), None, device, host, inter_op_threads=1)
>>> peak = ctx.simulate(ir).peak_bytes
>>> ctx = PassContext(tuple(built.fetches), int(peak * 0.8), device, host, inter_op_threads=1)
>>> result = PlacePersistent().run(ir, ctx)
>>> result.changed, ctx.simulate(result.graph).peak_bytes <= peak * 0.8
(True, True)
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import ClassVar

from tensorflow.core.framework import attr_value_pb2

from passes.timeline import StepTimeline
from passes.transfer import (
    Prefetch,
    add_prefetches,
    group_consumers,
    identity_attrs,
    movable,
    plan_prefetches,
    ready_at_start,
    trigger_candidates,
)
from tfmem.ir.colocation import colocated_with
from tfmem.ir.devices import Placement
from tfmem.ir.editor import DO_NOT_REMOVE, GraphEditor, claim_name
from tfmem.ir.execution import ExecutionGraph
from tfmem.ir.frames import may_be_dead, maybe_dead, whole_frame_preds
from tfmem.ir.graph import GraphIR, OpNode, TensorRef
from tfmem.ir.ops import IDENTITY_OPS, PERSISTENT_OUTPUT_OPS, REF_READ_OPS, REF_VARIABLE_OPS, VARIABLE_OPS
from tfmem.ir.tags import PINNED_TAG
from tfmem.pipeline import PassContext, PassReport, PassResult
from tfmem.sim import costmodel
from tfmem.sim.profile import MemoryProfile, variable_bytes
from tfmem.units import format_bytes

PREFETCH_TAG = "_tfmem_prefetch"
TO_HOST_TAG = "_tfmem_to_host"
# Host-resident tensors' copies on the device (prefetched weights, gradients on their way to the host) that
# may be there at once, whatever order the executor takes (chain_to_host).
TO_HOST_IN_FLIGHT = 4


@dataclass(frozen=True)
class PersistentGroup:
    """Variables that must live together (one op updates them all, e.g. Adam's var and slots) or one constant."""

    roots: tuple[str, ...]             # the variable (or Const) nodes
    members: tuple[str, ...]           # every node that moves to the host with them
    nbytes: int
    reads: tuple[TensorRef, ...]       # tensors made on the host that device ops read
    ref: bool                          # reference variables: updates must wait for prefetches
    resident: bool = False             # created on the host (moving it costs nothing: only its reads are timed)


@dataclass(frozen=True)
class PlacePersistent:
    """Move variables and large constants to ``ctx.host`` until the simulated device peak meets the budget."""

    name: ClassVar[str] = "place_persistent"
    budget_independent: ClassVar[bool] = False
    peak_non_increasing: ClassVar[bool] = True
    min_bytes: int = 64 * 1024
    overshoot: float = 1.25
    link: costmodel.DeviceSpec = field(default=costmodel.DEFAULT_DEVICE)

    def run(self, graph: GraphIR, ctx: PassContext) -> PassResult:
        if ctx.host is None:
            return PassResult(graph, False, PassReport.empty(self.name, "no host device given (host=...)"))
        target_bytes = ctx.target_bytes
        if target_bytes is None:
            return PassResult(graph, False, PassReport.empty(
                self.name, "no budget: host-resident weights cost transfers, so this runs only to meet a budget"))
        profile = ctx.simulate(graph)
        if profile.peak_bytes <= target_bytes:
            return PassResult(graph, False, PassReport.empty(self.name, "already within the budget"))
        timeline = StepTimeline.build(graph, ctx.fetches, profile, ctx.feed_shapes)
        found = persistent_groups(graph, timeline.eg, Placement(ctx.device, ctx.host), self.min_bytes)
        # Variables created on the host (a TF2 variable cannot move) cost no move: their reads get prefetches first.
        resident = sorted((g for g in found if g.resident), key=lambda g: g.roots)
        groups = sorted((g for g in found if not g.resident), key=lambda g: (-g.nbytes, g.roots))
        start_peak, moved, current, chosen = profile.peak_bytes, -1 if resident else 0, graph, []
        while moved < len(groups) and profile.peak_bytes > target_bytes:
            excess, take = (profile.peak_bytes - target_bytes) * self.overshoot, max(moved, 0)
            covered = 0
            while moved >= 0 and take < len(groups) and covered < excess:
                covered += groups[take].nbytes
                take += 1
            trying = resident + groups[:take]
            trial = chain_to_host(place_groups(graph, trying, timeline, ctx.host, self.link), trying, timeline,
                                  ctx.host)
            trial_profile = ctx.simulate(trial)
            moved = take
            if trial_profile.peak_bytes < profile.peak_bytes:
                current, profile, chosen = trial, trial_profile, trying
        if not chosen:
            return PassResult(graph, False, PassReport.empty(
                self.name, f"moving variables to the host did not lower the peak ({format_bytes(start_peak)})"))
        return PassResult(current, True, self._report(graph, current, chosen, start_peak, profile, target_bytes))

    def _report(self, before: GraphIR, after: GraphIR, chosen: list[PersistentGroup], start_peak: int,
                profile: MemoryProfile, target_bytes: int) -> PassReport:
        added = len(after) - len(before)
        moved = [g for g in chosen if not g.resident]
        resident = [g for g in chosen if g.resident]
        met = "meets" if profile.peak_bytes <= target_bytes else "still above"
        per_step = sum((after.spec(TensorRef(n.name, 0)).nbytes or 0) for n in after.nodes
                       if n.attr_bool(PREFETCH_TAG))
        where = [f"{len(moved)} variable groups / constants ({format_bytes(sum(g.nbytes for g in moved))}) now "
                 "live on the host"] if moved else []
        where += [f"{len(resident)} variable groups created on the host "
                  f"({format_bytes(sum(g.nbytes for g in resident))}) are read there"] if resident else []
        notes = (
            f"{'; '.join(where)}; {added} prefetches bring {format_bytes(per_step)} to the device per step",
            f"simulated peak {format_bytes(start_peak)} -> {format_bytes(profile.peak_bytes)}, {met} the budget",
        )
        details: dict[str, object] = {"moved": [r for g in moved for r in g.roots],
                                      "resident": [r for g in resident for r in g.roots], "prefetches": added,
                                      "groups": [(",".join(g.roots), g.nbytes) for g in chosen]}
        return PassReport(self.name, True, nodes_added=added, control_edges_added=added, bytes_moved=per_step,
                          notes=notes, details=details)


def place_groups(graph: GraphIR, groups: list[PersistentGroup], timeline: StepTimeline, host: str,
                 link: costmodel.DeviceSpec = costmodel.DEFAULT_DEVICE) -> GraphIR:
    """Put each group on ``host`` and give every device reader group its own delayed prefetch.

    Callers then apply ``chain_to_host`` to the finished graph (after any other rewrite that adds edges).
    """
    editor = GraphEditor(graph)
    usable = trigger_candidates(graph, timeline)
    for group in groups:
        for name in group.members:
            editor.set_device(name, host)
        reads, updates = plan_group_prefetches(graph, group, timeline, usable, link)
        prefetch_names: list[str] = []
        for t, prefetches in reads:
            prefetch_names += add_prefetches(editor, t, t, prefetches, host, f"{t.node}/tfmem_prefetch_{t.index}",
                                             PREFETCH_TAG)
        for update in updates:
            editor.add_control_inputs(update, prefetch_names)
    return editor.finish()


def chain_to_host(graph: GraphIR, groups: list[PersistentGroup], timeline: StepTimeline, host: str,
                  min_bytes: int = 64 * 1024, in_flight: int = TO_HOST_IN_FLIGHT) -> GraphIR:
    """Bound how many host-resident tensors have a copy on the device at once, whatever order TF's executor
    takes: at most ``in_flight`` prefetched copies and gradients on their way to the host together.

    Each large device tensor that ``groups``' host ops read (a gradient) goes through a host ``Identity``
    (its *receipt*, done once it left the device). The *items* -- each prefetch, and each device op making
    such a tensor -- are dealt, in a topological order, to ``in_flight`` slots, and each item starts only
    once the item before it in its slot is over (every reader of the prefetched copy ran; every receipt
    came). A slot holds one item at a time, so at most ``in_flight`` are on the device together, and a copy
    read at both ends of the step holds only its own slot, where a first-in-first-out window would let it
    hold every later item
    (``tests/test_swap_placement.py::test_one_long_lived_copy_holds_only_its_own_place_in_the_chain``).

    Why: prefetch triggers come from the simulated schedule, but with many independent experts the executor
    takes another order, and unchained the experts' gradients and prefetched weights pile up on the device
    (``tests/test_swap_placement.py::test_placed_experts_have_few_copies_on_the_device_whatever_the_executor_order``;
    ``experiments/results/moe_placement.md``: the device peak stays flat from 8 to 64 experts).

    The chain follows a topological order of ``graph`` (``_chain_order``), in which the receipts and the
    chain's edges are laid out, so they close no cycle; ``graph`` must hold every other edge the caller adds.
    A prefetch whose trigger would make the chain wait for itself gets an earlier trigger instead.
    """
    members = {m for g in groups for m in g.members if m in graph}
    # An item waiting for an op a TF1 cond skipped would never start: no receipt of a tensor the cond may skip
    # (a Switch's output, or below one), and no prefetch read by an op it may skip.
    dead = maybe_dead(graph)
    readers: dict[TensorRef, list[str]] = {}
    for m in sorted(members):
        for t in graph[m].inputs:
            if (t.node not in members and not may_be_dead(graph, t) and graph[t.node].device != host
                    and t.node in timeline.rank
                    and movable(graph, t) and (graph.spec(t).nbytes or 0) >= min_bytes):
                readers.setdefault(t, []).append(m)
    receipts: dict[TensorRef, str] = {}
    after: dict[str, list[OpNode]] = {}   # node -> the receipts laid out right after it
    names = set(graph.by_name)
    for t in sorted(readers, key=lambda t: (timeline.rank[t.node], t.index)):
        name = claim_name(names, f"{t.node}/tfmem_to_host_{t.index}")
        receipts[t] = name
        attrs = {DO_NOT_REMOVE: attr_value_pb2.AttrValue(b=True), **identity_attrs(graph, t, TO_HOST_TAG)}
        after.setdefault(t.node, []).append(OpNode(name, "Identity", (t,), (), host, (graph.spec(t),),
                                                   MappingProxyType(attrs)))
    # Each item holds device memory from its start until every node in ``pending`` ran; later items wait
    # for the nodes in ``done_by`` (a gradient: its receipts; a prefetched copy: the ops that read it).
    pending: dict[str, set[str]] = {}
    done_by: dict[str, list[str]] = {}
    for t, receipt in receipts.items():
        alloc = _allocating_op(graph, t)
        if alloc in timeline.rank:
            pending.setdefault(alloc, set()).add(t.node)
            done_by.setdefault(alloc, []).append(receipt)
    for node in graph.nodes:
        # A small copy (a scalar such as Adam's beta1, read by every update at the step's end) is not worth a
        # place in the chain, and would hold it: the chain waits for each item's readers in turn
        # (tests/test_swap_placement.py::test_a_small_copy_read_late_does_not_unchain_the_large_ones).
        if (node.attr_bool(PREFETCH_TAG) and graph.successors.get(node.name)
                and not any(s in dead for s in graph.successors[node.name])
                and (graph.spec(TensorRef(node.name, 0)).nbytes or 0) >= min_bytes):
            pending[node.name] = set(graph.successors[node.name])
            done_by[node.name] = list(graph.successors[node.name])
    if not pending:
        return graph
    plan = _chain_order(graph, timeline, pending, host, in_flight, dead)
    waits = {start: done_by[earlier] for start, earlier in plan.follows.items()}
    nodes: list[OpNode] = []
    for name in plan.order:
        node = graph[name]
        control = tuple(c for c in node.control_inputs if c not in plan.dropped.get(name, ()))
        control += tuple(dict.fromkeys(c for c in (*plan.added.get(name, ()), *waits.get(name, ()))
                                       if c not in control))
        inputs = tuple(TensorRef(receipts[t], 0) if name in readers.get(t, ()) else t for t in node.inputs)
        if control != node.control_inputs or inputs != node.inputs:
            node = dataclasses.replace(node, inputs=inputs, control_inputs=control)
        nodes.append(node)
        nodes += after.get(name, [])
    return graph.replace_nodes(tuple(nodes))


@dataclass(frozen=True)
class ChainPlan:
    """What ``_chain_order`` found: a topological order, the chain, and prefetch triggers it moved."""

    order: tuple[str, ...]
    chain: tuple[str, ...]                     # items (allocating ops, prefetches) in the order they start
    follows: Mapping[str, str]                 # item -> the earlier item in its slot, which it waits for
    dropped: Mapping[str, tuple[str, ...]]     # prefetch -> the triggers it stops waiting for
    added: Mapping[str, tuple[str, ...]]       # prefetch -> its new trigger


def _chain_order(graph: GraphIR, timeline: StepTimeline, items: Mapping[str, set[str]], host: str,
                 in_flight: int, dead: frozenset[str]) -> ChainPlan:
    """Kahn's algorithm over ``graph``'s nodes (each v1 frame as one op), in the simulation's order, where an
    item (a key of ``items``) may come only once one of ``in_flight`` slots is free: empty, or its last item
    is over (that item's set of nodes all came). The item takes that slot, and follows its last item.

    When only held items are left ready, a prefetch that waits for nothing but its trigger is released (its
    trigger becomes the device op laid out last: prefetch triggers only time a copy, the simulated order
    interleaves experts, and a chain cannot follow that); failing that, a held op stays out of the chain.
    A node in ``dead`` (``maybe_dead``), which a TF1 cond may skip, is never the new trigger.
    """
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    preds = whole_frame_preds(graph)
    succs: dict[str, list[str]] = {name: [] for name in preds}
    for name, ps in preds.items():
        for p in ps:
            succs[p].append(name)
    waiting = {name: len(ps) for name, ps in preds.items()}
    soft = {n.name: set(n.control_inputs) for n in graph.nodes if n.attr_bool(PREFETCH_TAG) and n.control_inputs}
    urgency = {p: min((timeline.rank.get(c, len(index)) for c in graph.successors.get(p, ())), default=len(index))
               for p in soft}
    # never a released prefetch's trigger: these may run as the step starts, those a TF1 cond may skip
    early = ready_at_start(graph) | dead
    position: dict[str, float] = {}   # the simulated rank; a node the simulation lacks runs once ready
    done: set[str] = set()

    def entry(name: str) -> tuple[float, int, str]:
        unit = timeline.eg.unit_of.get(name)
        rank = timeline.rank.get(unit) if unit is not None else None
        position[name] = float(rank) if rank is not None else max(
            (position[p] for p in preds[name] if p in done), default=-1.0)
        return position[name], index[name], name

    ready = [entry(name) for name, n in waiting.items() if n == 0]
    heapq.heapify(ready)
    pending = {a: set(nodes) for a, nodes in items.items()}   # nodes still to come, per item
    producers: dict[str, list[str]] = {}
    for a, nodes in items.items():
        for n in nodes:
            producers.setdefault(n, []).append(a)
    order: list[str] = []
    chain: list[str] = []
    slots: list[str | None] = [None] * in_flight   # the item each slot took last
    follows: dict[str, str] = {}
    held: list[tuple[float, int, str]] = []
    dropped: dict[str, tuple[str, ...]] = {}
    added: dict[str, tuple[str, ...]] = {}
    last_device: str | None = None
    while ready or held:
        if not ready:
            stuck = [p for p in soft if p not in done and p not in dropped
                     and 0 < waiting[p] == len(soft[p] - done) and all(q in done for q in preds[p] if q not in soft[p])]
            if stuck:
                p = min(stuck, key=lambda p: (urgency[p], index[p]))
                dropped[p] = tuple(soft[p] - done)
                added[p] = (last_device,) if last_device is not None and last_device not in soft[p] else ()
                waiting[p] = 0
                heapq.heappush(ready, entry(p))
                continue
            item = heapq.heappop(held)
        else:
            item = heapq.heappop(ready)
            if item[2] in items:
                free = next((i for i, last in enumerate(slots) if last is None or not pending[last]), None)
                if free is None:
                    heapq.heappush(held, item)
                    continue
                last = slots[free]
                if last is not None:
                    follows[item[2]] = last
                slots[free] = item[2]
                chain.append(item[2])
        u = item[2]
        order.append(u)
        done.add(u)
        node = graph[u]
        if node.device != host and u in timeline.rank and u not in early:
            last_device = u
        for a in producers.get(u, ()):
            pending[a].discard(u)
            if not pending[a]:
                for h in held:
                    heapq.heappush(ready, h)
                held = []
        for s in succs[u]:
            if s in dropped and u in dropped[s]:
                continue
            waiting[s] -= 1
            if waiting[s] == 0:
                heapq.heappush(ready, entry(s))
    if len(order) != len(graph.nodes):
        raise ValueError("chain_to_host: the graph has a cycle outside v1 loop frames")
    return ChainPlan(tuple(order), tuple(chain), follows, dropped, added)


def _allocating_op(graph: GraphIR, tensor: TensorRef) -> str:
    """The op whose output buffer ``tensor`` is: walk back through identities (they pass the buffer on)."""
    node = graph[tensor.node]
    while node.op in IDENTITY_OPS and len(node.inputs) == 1:
        node = graph[node.inputs[0].node]
    return node.name


def plan_group_prefetches(graph: GraphIR, group: PersistentGroup, timeline: StepTimeline,
                          usable: Mapping[str, bool], link: costmodel.DeviceSpec,
                          ) -> tuple[list[tuple[TensorRef, list[Prefetch]]], list[str]]:
    """The prefetches of each tensor ``group`` hands to device ops, and the in-place updates that must wait."""
    updates = _ref_updates(graph, group, timeline) if group.ref else []
    if updates:  # a prefetch must come before the in-place updates, so its trigger must too
        first_update = min(timeline.rank[u] for u in updates)
        usable = {u: ok and timeline.rank[u] < first_update for u, ok in usable.items()}
    reads = []
    for t in group.reads:
        consumers = [c for c in timeline.eg.consumers(t) if c not in group.members and c in timeline.rank]
        if consumers:
            nbytes = graph.spec(t).nbytes or 0
            in_time = group_consumers(consumers, timeline, 2 * link.transfer_s(nbytes))
            reads.append((t, plan_prefetches(in_time, nbytes, timeline, link, usable, -1)))
    return reads, updates


def persistent_groups(graph: GraphIR, eg: ExecutionGraph, placement: Placement, min_bytes: int) -> list[PersistentGroup]:
    """Variables (with their readers, updaters and colocated ops) and large constants on the device."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(a: str, b: str) -> None:
        parent.setdefault(a, a)
        parent.setdefault(b, b)
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[rb] = ra

    # On the device and free to move, or already on the host (where device ops read it through copies)
    variables = [n.name for n in graph.nodes if n.op in VARIABLE_OPS and n.name in eg.unit_of
                 and ((placement.domain(n.device) == "device" and not n.attr_bool(PINNED_TAG))
                      or placement.domain(n.device) == "host")]
    for v in variables:
        parent.setdefault(v, v)
    var_set = set(variables)
    touching: dict[str, set[str]] = {}   # variable -> ops that read its handle or ref, or are colocated with it
    for node in graph.nodes:
        touched = {t.node for t in node.inputs if t.node in var_set and t.index == 0}
        touched |= {loc for loc in colocated_with(node) if loc in var_set}
        for v in touched:
            touching.setdefault(v, set()).add(node.name)
            for w in touched:
                union(v, w)
    # The elementwise arithmetic between a variable's reads and its writes (Keras 3's optimizers update in plain
    # ops, not one fused kernel) runs beside the variable: only the gradient then travels to the host, instead of
    # the variable and its slots to the device and their new values back. Groups it joins move together.
    owner = {m: v for v in variables for m in (v, *touching.get(v, ()))}
    for op, sources in host_update_ops(graph, eg, placement, set(owner)).items():
        writes = {c for i in range(len(graph[op].outputs)) for c in graph.consumers.get(TensorRef(op, i), ())}
        linked = sorted({owner[m] for m in sources | writes if m in owner})
        for r in linked[1:]:
            union(linked[0], r)
        touching.setdefault(linked[0], set()).add(op)
    clusters: dict[str, list[str]] = {}
    for v in variables:
        clusters.setdefault(find(v), []).append(v)
    groups = []
    for roots in clusters.values():
        members = set(roots).union(*(touching.get(v, set()) for v in roots))
        if any(eg.is_region(eg.unit_of.get(m, m)) for m in members):
            continue  # a frame's ops cannot be split across devices here
        nbytes = sum(variable_bytes(graph[v]) if graph[v].op == "VarHandleOp" else graph[v].outputs[0].nbytes or 0
                     for v in roots)
        reads = tuple(
            TensorRef(m, i) for m in sorted(members) if m in eg.unit_of and m not in roots
            for i in range(len(graph[m].outputs))
            if movable(graph, TensorRef(m, i)) and any(c not in members for c in eg.consumers(TensorRef(m, i)))
        )
        if any(eg.is_region(c) for t in reads for c in eg.consumers(t)) or any(may_be_dead(graph, t) for t in reads):
            continue  # a frame reads it whole, or a TF1 cond may skip it: no prefetch of it
        resident = all(placement.domain(graph[v].device) == "host" for v in roots)
        if nbytes >= min_bytes and (reads or not resident):
            ref = any(graph[v].op in REF_VARIABLE_OPS for v in roots)
            groups.append(PersistentGroup(tuple(sorted(roots)), tuple(sorted(members)), nbytes, reads, ref,
                                          resident))
    for node in graph.nodes:
        if (node.op in PERSISTENT_OUTPUT_OPS and node.op not in VARIABLE_OPS and node.name in eg.unit_of
                and placement.domain(node.device) == "device" and (node.outputs[0].nbytes or 0) >= min_bytes
                and movable(graph, TensorRef(node.name, 0)) and node.name not in parent
                and not any(eg.is_region(c) for c in eg.consumers(TensorRef(node.name, 0)))):
            groups.append(PersistentGroup((node.name,), (node.name,), node.outputs[0].nbytes or 0,
                                          (TensorRef(node.name, 0),), False))
    return groups


# Elementwise ops whose result is the correctly rounded IEEE value on any device (or exact), so running one on
# the host instead of the device keeps its value bit for bit.
EXACT_ELEMENTWISE_OPS = frozenset({"Add", "AddV2", "Sub", "Mul", "RealDiv", "Sqrt", "Square", "Neg", "Maximum",
                                   "Minimum", "Identity"})


def exact_on_any_device(node: OpNode) -> bool:
    """``EXACT_ELEMENTWISE_OPS``, and an ``AddN`` of at most two terms (one correctly rounded sum). TF-Slim's
    gradient of a regularised weight is ``AddN(backprop, decay * weight)``: three weight-sized tensors on the device
    at once (VGG-16's fc6: 1.15 GiB, every budget's lower bound) unless the sum runs on the host beside the update."""
    return node.op in EXACT_ELEMENTWISE_OPS or (node.op == "AddN" and len(node.inputs) <= 2)


def host_capable_ops(graph: GraphIR, eg: ExecutionGraph, placement: Placement,
                     min_bytes: int = PlacePersistent.min_bytes) -> frozenset[str]:
    """The ops some placement of variables on ``placement.host`` runs there (every ``persistent_groups``
    member); none without a host. The lower bounds leave them out: on the device they need nothing of their own."""
    if placement.host is None:
        return frozenset()
    return frozenset(m for g in persistent_groups(graph, eg, placement, min_bytes) for m in g.members)


def host_update_ops(graph: GraphIR, eg: ExecutionGraph, placement: Placement, on_host: set[str]) -> dict[str, set[str]]:
    """Device ops that give the same bits on any device (``exact_on_any_device``), that read, through other such
    ops, what ``on_host`` ops make, and whose results only ``on_host`` ops (or other such ops) read: an update's
    arithmetic between a variable's reads and its writes. Each maps to the ``on_host`` ops it reads from,
    directly or through the others.

    Examples: Keras 3's Adam computes ``m += (g - m) * (1 - beta1)`` as Sub, Mul and AssignAddVariableOp; the
    Sub and the Mul are returned (the gradient ``g`` comes from the device, ``m`` from the host).
    """
    sources: dict[str, set[str]] = {}
    for node in graph.nodes:   # a topological layout: a reader comes after what it reads
        if (not exact_on_any_device(node) or node.name in on_host or node.name not in eg.unit_of
                or eg.is_region(eg.unit_of[node.name]) or placement.domain(node.device) != "device"):
            continue
        read = {t.node for t in node.inputs if t.node in on_host}
        read.update(*(sources[t.node] for t in node.inputs if t.node in sources))
        if read:
            sources[node.name] = read
    changed = True
    while changed:   # keep only those whose every reader is on the host or kept
        changed = False
        for name in list(sources):
            readers = {c for i in range(len(graph[name].outputs)) for c in graph.consumers.get(TensorRef(name, i), ())}
            if not readers or any(c not in on_host and c not in sources for c in readers):
                del sources[name]
                changed = True
    return sources


def _ref_updates(graph: GraphIR, group: PersistentGroup, timeline: StepTimeline) -> list[str]:
    """Ops of this step that write a reference variable of ``group`` in place (everything but its reads)."""
    roots = set(group.roots)
    return [m for m in group.members if m in timeline.rank and m not in roots
            and any(t.node in roots for t in graph[m].inputs) and graph[m].op not in REF_READ_OPS]
