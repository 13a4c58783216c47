"""Enforce the partition order with control edges so that at most ``k`` partitions run at once.

Partition ``i + k`` may not start until partitions ``0..i`` have finished: a ``NoOp`` barrier waits for the
last ops of partition ``i`` (and for barrier ``i - 1``), and every op of partition ``i + k`` that allocates
memory and does not already wait for another such op of its partition waits for the barrier. Edges already
implied by the graph are skipped, and edges only ever point forward along the partition order, which is
topological, so no cycle can appear.

While partitions ``i..i+k-1`` run, the live bytes are at most what was live when partition ``i`` started plus
everything the ``k`` partitions allocate (``OrderFootprint.slice_bound``), however TF's threads interleave
them. That bound counts the bytes tensors ask for; the simulator counts the allocator's chunks, which the BFC
hands out whole when a free chunk is less than twice the request, so the simulated peak can exceed it.
That is why a candidate is accepted on its simulation. ``k="auto"`` uses that bound and a critical-path
step-time estimate (each barrier on the path costs ``BARRIER_SYNC_S``) to rank the candidates, and the
simulator (with the executor's thread count) to accept one: with a budget, the largest ``k`` that fits (the
least speed lost); without one, the lowest bound whose estimated step time stays within 10% of the
original's, if both that bound and the simulated peak are at least ``MIN_GAIN`` below the original's simulated
peak (one simulation: a looser limit is not expected to simulate lower). No candidate whose simulated peak is above the input graph's is ever returned.

Requires: ``_tfmem_partition``/``_tfmem_order`` tags (runs ``partition`` itself when they are missing).
Ensures: the same values are computed; only control edges and ``NoOp`` barriers are added; tags are removed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from passes.partition import ORDER_ATTR, PARTITION_ATTR, Partition
from tfmem.errors import BadInputError
from tfmem.ir.devices import Placement
from tfmem.ir.editor import GraphEditor
from tfmem.ir.execution import ExecutionGraph
from tfmem.ir.frames import maybe_dead
from tfmem.ir.graph import GraphIR
from tfmem.ir.tags import strip_tags
from tfmem.pipeline import PassContext, PassReport, PassResult
from tfmem.sim import costmodel
from tfmem.sim.analysis import Analysis, OrderFootprint, analyse
from tfmem.sim.profile import MemoryProfile
from tfmem.units import format_bytes

BARRIER_PREFIX = "tfmem/limit_parallelism/after_partition_"
SLOWDOWN_ALLOWED = 1.10
# Without a budget, change the graph only for a clear simulated gain: the multi-thread emulation is less exact
# than the one-thread one, and a marginal "gain" can be a loss when measured.
MIN_GAIN = 0.10
# A gated op starts only after the executor sees a barrier's last input finish and wakes a thread, a hand-off no op's
# cost includes (hidden when k >= 2; limited steps measure slower: experiments/results/partition_parallelism.md).
BARRIER_SYNC_S = 100e-6


@dataclass(frozen=True)
class _Plan:
    k: int
    bound_bytes: int          # worst-case peak over any interleaving (footprint bound + resident bytes)
    step_s: float             # critical-path estimate with the barriers
    graph: GraphIR | None = None
    edges: int = 0
    profile: MemoryProfile | None = None


@dataclass(frozen=True)
class LimitParallelism:
    """Allow at most ``k`` partitions in flight (``k="auto"`` chooses from the bound and the simulator)."""

    name: ClassVar[str] = "limit_parallelism"
    budget_independent: ClassVar[bool] = False
    peak_non_increasing: ClassVar[bool] = True
    k: int | str = "auto"

    def __post_init__(self) -> None:
        if self.k != "auto" and not (isinstance(self.k, int) and not isinstance(self.k, bool) and self.k >= 1):
            raise BadInputError(f"limit_parallelism: k must be a positive int or 'auto', got {self.k!r}")

    def run(self, graph: GraphIR, ctx: PassContext) -> PassResult:
        placement = Placement(ctx.device, ctx.host)
        if any(n.name.startswith(BARRIER_PREFIX) and placement.domain(n.device) == "device" for n in graph.nodes):
            # Limited already: partitioning the limited graph again would stack a second set of barriers. (Another
            # device's barriers, of a plan across devices, gate only that device's ops.)
            return PassResult(strip_tags(graph), False, PassReport.empty(self.name, "limited already: nothing to do"))
        if not any(PARTITION_ATTR in n.attrs for n in graph.nodes):
            graph = Partition().run(graph, ctx).graph
        untagged = strip_tags(graph)
        analysis = analyse(untagged, list(ctx.fetches), list(ctx.feed_shapes), costmodel.DEFAULT_DEVICE)
        parts = _partitions(graph, analysis.eg)
        # On a graph over several devices, this device's plan gates none of the others' ops (tfmem.optimize's
        # devices=): they keep their order, and each device's own plan limits them.
        ours = {u for u in analysis.eg.units if placement.domain(analysis.eg.graph[analysis.eg.members[u][0]].device)
                != "other"}
        if len(parts) < 2:
            return PassResult(untagged, False, PassReport.empty(self.name, "one partition: nothing to limit"))
        threads = ctx.threads
        base = ctx.simulate(untagged, grappler=False, inter_op_threads=threads)
        shape = _Shape.of(analysis, parts, ours)
        resident = base.persistent_bytes + sum(untagged.spec(t).nbytes or 0 for t in analysis.eg.fed)
        base_step = shape.step_s(analysis, None)
        ks = [self.k] if isinstance(self.k, int) else _candidates(len(parts), threads)
        plans = [_Plan(k, resident + shape.bound(k), shape.step_s(analysis, k)) for k in ks]

        def realise(plan: _Plan) -> _Plan:
            new, edges = _limited(untagged, analysis.eg, parts, shape, plan.k, ctx.device or "")
            prof = ctx.simulate(new, grappler=False, inter_op_threads=threads)
            return _Plan(plan.k, plan.bound_bytes, plan.step_s, new, edges, prof)

        # An explicit k is the user's decision; "auto" applies the budget / step-time rules.
        tried, chosen = _choose(plans, base, base_step, ctx.target_bytes, realise) if self.k == "auto" \
            else ([realise(plans[0])], None)
        chosen = chosen if self.k == "auto" else tried[0]
        tried_note = "tried: " + ", ".join(
            f"k={p.k} bound {format_bytes(p.bound_bytes)}"
            + (f" simulated {format_bytes(p.profile.peak_bytes)}" if p.profile else "") for p in tried or plans)
        if chosen is None or chosen.graph is None or chosen.profile is None:
            note = f"no k beats the unlimited graph (peak {format_bytes(base.peak_bytes)}, {threads} threads)"
            return PassResult(untagged, False, PassReport(self.name, notes=(note, tried_note)))
        if self.k == "auto":
            # Candidates are judged as written (one Grappler run per k would dominate); the one kept must also
            # not raise the peak as the session runs it, after Grappler's rewrites (tests/test_pass_contract.py).
            session_peak = ctx.simulate(untagged, inter_op_threads=threads).peak_bytes
            limited_peak = ctx.simulate(chosen.graph, inter_op_threads=threads).peak_bytes
            if limited_peak > session_peak:
                note = (f"k={chosen.k} would raise the peak the session runs (after Grappler's rewrites) from "
                        f"{format_bytes(session_peak)} to {format_bytes(limited_peak)}: not limited")
                return PassResult(untagged, False, PassReport(self.name, notes=(note, tried_note)))
        notes = (
            f"k={chosen.k} of {len(parts)} partitions in flight ({threads} inter-op threads)",
            f"simulated peak {format_bytes(base.peak_bytes)} -> {format_bytes(chosen.profile.peak_bytes)} "
            f"(footprint model's worst interleaving {format_bytes(chosen.bound_bytes)}), "
            f"estimated step {base_step * 1e3:.2f} -> {chosen.step_s * 1e3:.2f} ms",
            tried_note,
        )
        report = PassReport(self.name, changed=True, nodes_added=len(chosen.graph) - len(untagged),
                            control_edges_added=chosen.edges, notes=notes,
                            details={"k": chosen.k, "peak_before": base.peak_bytes,
                                     "peak_after": chosen.profile.peak_bytes, "bound": chosen.bound_bytes})
        return PassResult(chosen.graph, True, report)


def _choose(plans: list[_Plan], base: MemoryProfile, base_step: float, target_bytes: int | None,
            realise: Callable[[_Plan], _Plan]) -> tuple[list[_Plan], _Plan | None]:
    """Simulate candidates lazily, best first; return those simulated and the one chosen (or None)."""
    tried: list[_Plan] = []

    def attempt(plan: _Plan) -> _Plan:
        done = next((t for t in tried if t.k == plan.k), None) or realise(plan)
        if done not in tried:
            tried.append(done)
        return done

    if target_bytes is not None:
        if base.peak_bytes <= target_bytes:  # unlimited parallelism already fits: give nothing up
            return tried, None
        for plan in sorted(plans, key=lambda p: -p.k):  # the largest k that surely fits and simulates within
            if plan.bound_bytes <= target_bytes and attempt(plan).profile.peak_bytes <= target_bytes:  # type: ignore[union-attr]
                return tried, tried[-1]
        safest = attempt(min(plans, key=lambda p: (p.bound_bytes, p.k)))  # best effort: the lowest bound
        return tried, safest if safest.profile.peak_bytes < base.peak_bytes else None  # type: ignore[union-attr]
    # Worth its edges only if even the worst interleaving is clearly below what the unlimited graph simulates.
    fast = [p for p in plans if p.step_s <= SLOWDOWN_ALLOWED * base_step
            and p.bound_bytes <= (1 - MIN_GAIN) * base.peak_bytes]
    if not fast:
        return tried, None
    # The tightest limit that keeps the speed; a looser one lets more run at once and is not expected to
    # simulate lower, so one simulation decides.
    done = attempt(min(fast, key=lambda p: (p.bound_bytes, p.k)))
    return tried, done if done.profile.peak_bytes <= (1 - MIN_GAIN) * base.peak_bytes else None  # type: ignore[union-attr]


def _candidates(partitions: int, threads: int) -> list[int]:
    """1, 2, 4, ... below the partition count; beyond the thread count a limit changes little."""
    ks, k = [], 1
    while k < partitions and k <= threads:
        ks.append(k)
        k *= 2
    return ks


def _partitions(graph: GraphIR, eg: ExecutionGraph) -> list[list[str]]:
    tagged: dict[int, list[tuple[int, str]]] = {}
    for unit in eg.units:
        node = graph[eg.members[unit][0]]
        if PARTITION_ATTR in node.attrs:
            tagged.setdefault(node.attrs[PARTITION_ATTR].i, []).append((node.attrs[ORDER_ATTR].i, unit))
    return [[u for _, u in sorted(tagged[p])] for p in sorted(tagged)]


@dataclass(frozen=True)
class _Shape:
    """Per partition: its gated ops (those that wait for the barrier) and its exits; and the footprint bound."""

    parts: list[list[str]]
    gates: list[list[str]]
    exits: list[list[str]]
    window: list[tuple[int, int]]   # (first, one past last) order position of each partition
    footprint: OrderFootprint

    @classmethod
    def of(cls, analysis: Analysis, parts: list[list[str]], ours: set[str]) -> _Shape:
        """The shape of ``parts``; only units in ``ours`` wait for a barrier or are waited for."""
        eg = analysis.eg
        order = [u for part in parts for u in part]
        fp = analysis.footprints.footprint(order)
        window, at = [], 0
        for part in parts:
            window.append((at, at + len(part)))
            at += len(part)
        dead = maybe_dead(analysis.ir)
        own = [[u for u in p if u in ours] for p in parts]
        return cls(parts, [_gates(eg, p) for p in own], [_exits(eg, p, dead) for p in own], window, fp)

    def bound(self, k: int) -> int:
        """Transient bytes live at most while any ``k`` consecutive partitions run together."""
        n = len(self.parts)
        return max(self.footprint.slice_bound(self.window[i][0], self.window[min(i + k, n) - 1][1]) for i in range(n))

    def step_s(self, analysis: Analysis, k: int | None) -> float:
        """Critical-path step estimate (``tfmem.sim.analysis.step_time_estimate``) with the barriers for ``k``."""
        eg, cores = analysis.eg, os.cpu_count() or 1
        finish: dict[str, float] = {}
        barrier: list[float] = []
        for i, part in enumerate(self.parts):
            gate_s = barrier[i - k] + BARRIER_SYNC_S if k is not None and i >= k else 0.0
            gated = set(self.gates[i]) if k is not None and i >= k else set()
            for u in part:  # the partition order is topological
                ready = max((finish[p] for p in eg.unit_preds[u]), default=0.0)
                own = analysis.durations[u] / cores if analysis.expensive[u] else analysis.durations[u]
                finish[u] = max(ready, gate_s if u in gated else 0.0) + own
            barrier.append(max([finish[u] for u in self.exits[i]] + barrier[-1:], default=0.0))
        return max(max(finish.values(), default=0.0), sum(analysis.durations.values()) / cores)


def _limited(graph: GraphIR, eg: ExecutionGraph, parts: list[list[str]], shape: _Shape, k: int,
             device: str) -> tuple[GraphIR, int]:
    editor = GraphEditor(graph)
    position = {u: i for i, u in enumerate(u for part in parts for u in part)}
    reach = _Reachability(eg, position)
    previous: str | None = None
    for i in range(len(parts) - k):
        exits = shape.exits[i]
        sources = exits + ([previous] if previous else [])
        gates = [u for u in shape.gates[i + k] if not reach.implied(sources, u)]
        if not exits or not gates:
            continue
        barrier = editor.add_noop(editor.unique_name(f"{BARRIER_PREFIX}{i}"), control_inputs=[_node(eg, u, last=True) for u in exits]
                                  + ([previous] if previous else []), device=device)
        reach.add_node(barrier.name, sources, position[parts[i][-1]] + 0.5)
        for u in gates:
            editor.add_control_inputs(_node(eg, u, last=False), [barrier.name])
            reach.add_edge([barrier.name], u)
        previous = barrier.name
    return editor.finish(), editor.control_edges_added


def _allocates(eg: ExecutionGraph, unit: str) -> bool:
    return not eg.is_region(unit) and any((s.nbytes or 0) > 0 for s in eg.graph[unit].outputs) \
        and eg.graph[unit].op not in _NO_GATE


_NO_GATE = frozenset({"Const", "VarHandleOp", "VariableV2", "Placeholder", "ReadVariableOp", "Identity", "NoOp"})


def _gates(eg: ExecutionGraph, part: list[str]) -> list[str]:
    """Ops of ``part`` that must wait for the barrier: those that allocate and wait for no other such op."""
    members, covered, gates = set(part), set(), []
    for u in part:  # along the order, which is topological
        if any(p in covered for p in eg.unit_preds[u] if p in members):
            covered.add(u)
        elif _allocates(eg, u):
            gates.append(u)
            covered.add(u)
    return gates


def _exits(eg: ExecutionGraph, part: list[str], dead: frozenset[str] = frozenset()) -> list[str]:
    """The ops a barrier after ``part`` waits for: its last ones, in ``part``'s order. One a TF1 cond may skip
    (``dead``) would stop the barrier, and every op it gates, with it (tests/test_loops.py): the barrier waits
    for its nearest predecessors in ``part`` that always run instead. v1 frames take no control edge out."""
    members = set(part)
    chosen: set[str] = set()
    seen: set[str] = set()
    stack = [u for u in part if not eg.is_region(u) and not any(s in members for s in eg.unit_succs[u])]
    while stack:
        u = stack.pop()
        if u in seen or eg.is_region(u):
            continue
        seen.add(u)
        if u in dead:
            stack += (p for p in eg.unit_preds[u] if p in members)
        else:
            chosen.add(u)
    return [u for u in part if u in chosen]


def _node(eg: ExecutionGraph, unit: str, last: bool) -> str:
    return eg.members[unit][-1 if last else 0]


class _Reachability:
    """Answers "does ``unit`` already wait for all of ``sources``?" over the graph plus the barriers added."""

    def __init__(self, eg: ExecutionGraph, position: dict[str, int]) -> None:
        self.preds: dict[str, set[str]] = {u: set(p) for u, p in eg.unit_preds.items()}
        self.position: dict[str, float] = dict(position)

    def add_node(self, name: str, sources: list[str], position: float) -> None:
        self.preds[name] = set(sources)
        self.position[name] = position

    def add_edge(self, sources: list[str], target: str) -> None:
        self.preds[target].update(sources)

    def implied(self, sources: list[str], target: str) -> bool:
        missing = set(sources)
        floor = min((self.position.get(s, 0) for s in sources), default=0)  # the order is topological:
        seen, stack = {target}, [target]                                    # nothing before it can lead
        while stack and missing:
            for p in self.preds[stack.pop()]:
                if p not in seen and self.position.get(p, floor) >= floor:
                    seen.add(p)
                    missing.discard(p)
                    stack.append(p)
        return not missing
