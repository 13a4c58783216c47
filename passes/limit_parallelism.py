"""Enforce the partition order with control edges so that at most ``k`` partitions run at once.

Partition ``i + k`` may not start until partition ``i`` has finished: a ``NoOp`` barrier waits for the last
ops of partition ``i`` and the first ops of partition ``i + k`` that allocate memory wait for the barrier.
Edges already implied by the graph are skipped, and edges only ever point forward along the partition
order, which is topological, so no cycle can appear. ``k="auto"`` simulates the candidates with the
executor's thread count: with a budget it takes the largest ``k`` that fits (the least speed lost);
without one, the lowest peak whose estimated step time stays within 10% of the original's.

Requires: ``_tfmem_partition``/``_tfmem_order`` tags (runs ``partition`` itself when they are missing).
Ensures: the same values are computed; only control edges and ``NoOp`` barriers are added; tags are removed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from passes.partition import ORDER_ATTR, PARTITION_ATTR, Partition
from tfmem.editor import GraphEditor
from tfmem.errors import BadInputError
from tfmem.execution import ExecutionGraph
from tfmem.ir import GraphIR
from tfmem.memsim import MemoryProfile
from tfmem.pipeline import PassContext, PassReport, PassResult
from tfmem.tags import strip_tags
from tfmem.units import format_bytes

BARRIER_PREFIX = "tfmem/limit_parallelism/after_partition_"
SLOWDOWN_ALLOWED = 1.10
# Without a budget, change the graph only for a clear simulated gain: the multi-thread emulation is less exact
# than the one-thread one, and a marginal "gain" can be a loss when measured.
MIN_GAIN = 0.10


@dataclass(frozen=True)
class LimitParallelism:
    """Allow at most ``k`` partitions in flight (``k="auto"`` chooses from simulation)."""

    name: ClassVar[str] = "limit_parallelism"
    k: int | str = "auto"

    def __post_init__(self) -> None:
        if self.k != "auto" and not (isinstance(self.k, int) and not isinstance(self.k, bool) and self.k >= 1):
            raise BadInputError(f"limit_parallelism: k must be a positive int or 'auto', got {self.k!r}")

    def run(self, graph: GraphIR, ctx: PassContext) -> PassResult:
        if not any(PARTITION_ATTR in n.attrs for n in graph.nodes):
            graph = Partition().run(graph, ctx).graph
        eg = ExecutionGraph.build(graph, ctx.fetches, ctx.feed_shapes)
        parts = _partitions(graph, eg)
        untagged = strip_tags(graph)
        if len(parts) < 2:
            return PassResult(untagged, False, PassReport.empty(self.name, "one partition: nothing to limit"))
        threads = ctx.threads
        base = ctx.simulate(untagged, grappler=False, inter_op_threads=threads)
        ks = [self.k] if isinstance(self.k, int) else _candidates(len(parts), threads)
        trials = [(k, *self._limited(untagged, eg, parts, k, ctx, threads)) for k in ks]
        # An explicit k is the user's decision; "auto" applies the budget / step-time rules.
        k, new, edges, prof = trials[0] if self.k != "auto" else self._choose(trials, base, ctx)
        if new is None:
            note = f"no k beats the unlimited graph (peak {format_bytes(base.peak_bytes)}, {threads} threads)"
            return PassResult(untagged, False, PassReport.empty(self.name, note))
        notes = (
            f"k={k} of {len(parts)} partitions in flight ({threads} inter-op threads)",
            f"simulated peak {format_bytes(base.peak_bytes)} -> {format_bytes(prof.peak_bytes)}, "
            f"estimated step {base.estimated_step_s * 1e3:.2f} -> {prof.estimated_step_s * 1e3:.2f} ms",
            "tried: " + ", ".join(f"k={t[0]} {format_bytes(t[3].peak_bytes)}" for t in trials),
        )
        report = PassReport(self.name, changed=True, nodes_added=len(new) - len(untagged),
                            control_edges_added=edges, notes=notes,
                            details={"k": k, "peak_before": base.peak_bytes, "peak_after": prof.peak_bytes})
        return PassResult(new, True, report)

    def _limited(self, graph: GraphIR, eg: ExecutionGraph, parts: list[list[str]], k: int, ctx: PassContext,
                 threads: int) -> tuple[GraphIR, int, MemoryProfile]:
        editor = GraphEditor(graph)
        reach = _Reachability(eg, {u: i for i, u in enumerate(u for part in parts for u in part)})
        for i in range(len(parts) - k):
            exits = _exits(eg, parts[i])
            entries = [u for u in _entries(eg, parts[i + k]) if not reach.implied(exits, u)]
            if not exits or not entries:
                continue
            barrier = editor.add_noop(f"{BARRIER_PREFIX}{i}", control_inputs=[_node(eg, u, last=True) for u in exits])
            for u in entries:
                editor.add_control_inputs(_node(eg, u, last=False), [barrier.name])
                reach.add_edge(exits, u)
        new = editor.finish()
        return new, editor.control_edges_added, ctx.simulate(new, grappler=False, inter_op_threads=threads)

    def _choose(self, trials: list[tuple[int, GraphIR, int, MemoryProfile]], base: MemoryProfile,
                ctx: PassContext) -> tuple[int, GraphIR | None, int, MemoryProfile]:
        budget = ctx.device_budget_bytes
        useful = [t for t in trials if t[3].peak_bytes < base.peak_bytes]
        if budget is not None:
            if base.peak_bytes <= budget:  # unlimited parallelism already fits: give nothing up
                return 0, None, 0, base
            fitting = [t for t in useful if t[3].peak_bytes <= budget]
            if fitting:
                return max(fitting, key=lambda t: t[0])
            return min(useful, key=lambda t: (t[3].peak_bytes, -t[0]), default=(0, None, 0, base))
        fast = [t for t in useful if t[3].estimated_step_s <= SLOWDOWN_ALLOWED * base.estimated_step_s
                and t[3].peak_bytes <= (1 - MIN_GAIN) * base.peak_bytes]
        return min(fast, key=lambda t: (t[3].peak_bytes, -t[0]), default=(0, None, 0, base))


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


def _allocates(eg: ExecutionGraph, unit: str) -> bool:
    return not eg.is_region(unit) and any((s.nbytes or 0) > 0 for s in eg.graph[unit].outputs) \
        and eg.graph[unit].op not in _NO_GATE


_NO_GATE = frozenset({"Const", "VarHandleOp", "VariableV2", "Placeholder", "ReadVariableOp", "Identity", "NoOp"})


def _entries(eg: ExecutionGraph, part: list[str]) -> list[str]:
    members = set(part)
    return [u for u in part if _allocates(eg, u) and not any(p in members for p in eg.unit_preds[u])]


def _exits(eg: ExecutionGraph, part: list[str]) -> list[str]:
    members = set(part)
    return [u for u in part if not eg.is_region(u) and not any(s in members for s in eg.unit_succs[u])]


def _node(eg: ExecutionGraph, unit: str, last: bool) -> str:
    return eg.members[unit][-1 if last else 0]


class _Reachability:
    """Answers "does ``unit`` already wait for all of ``exits``?" over the graph plus the edges added."""

    def __init__(self, eg: ExecutionGraph, position: dict[str, int]) -> None:
        self.preds = {u: set(p) for u, p in eg.unit_preds.items()}
        self.position = position

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
