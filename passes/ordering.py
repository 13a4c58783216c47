"""Memory-aware topological orders of a graph's units, for the partition pass to choose among.

Three strategies, each a pure function of an ``OrderingProblem``:

* ``tf_natural`` -- the order TensorFlow's executor would use with one thread (``tfmem.sim.schedule``);
* ``depth_first`` -- a post-order walk from the fetches that finishes the heavier input first;
* ``greedy_memory`` -- list scheduling that prefers the ready op freeing the most bytes net of what it
  allocates, looking one step ahead at what that op makes ready.

Every order keeps stateful and random ops in their original relative order (they are chained).
``refine`` then improves the best of them by local search around its peak.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property

from tensorflow.python.framework import op_def_registry

from tfmem.ir.execution import ExecutionGraph
from tfmem.ir.graph import TensorRef
from tfmem.ir.ops import ALIAS_OPS, PERSISTENT_OUTPUT_OPS
from tfmem.sim import costmodel
from tfmem.sim.analysis import FootprintModel, OrderFootprint, expensive_of, unit_time_s
from tfmem.sim.schedule import emulate


def is_stateful(op: str) -> bool:
    """Whether TF declares ``op`` stateful (random ops, variable reads and updates, queues...)."""
    op_def = op_def_registry.get(op)
    return bool(op_def is not None and op_def.is_stateful)


@dataclass(frozen=True)
class OrderingProblem:
    """The unit DAG of one step, plus the chain that pins stateful ops' relative order."""

    eg: ExecutionGraph
    model: FootprintModel | None = field(default=None, compare=False)  # shared with the simulator's analysis

    @cached_property
    def preds(self) -> dict[str, tuple[str, ...]]:
        preds = {u: list(self.eg.unit_preds[u]) for u in self.eg.units}
        previous = None
        # GraphDef order is TF's construction order for stateful ops; a frame's unit may come before an input
        for u in self.eg.topological_units:  # it waits for, so the chain follows the nearest topological order
            if any(is_stateful(self.eg.graph[n].op) for n in self.eg.members[u]):
                if previous is not None and previous not in preds[u]:
                    preds[u].append(previous)
                previous = u
        return {u: tuple(p) for u, p in preds.items()}

    @cached_property
    def succs(self) -> dict[str, tuple[str, ...]]:
        succs: dict[str, list[str]] = {u: [] for u in self.eg.units}
        for u in self.eg.units:
            for p in self.preds[u]:
                succs[p].append(u)
        return {u: tuple(s) for u, s in succs.items()}

    @cached_property
    def out_bytes(self) -> dict[str, int]:
        return {u: sum(self.tensor_bytes(t) for t in self.eg.outputs_of(u)) for u in self.eg.units}

    @property
    def inputs(self) -> Mapping[str, tuple[TensorRef, ...]]:
        return self.eg.unit_inputs

    def tensor_bytes(self, t: TensorRef) -> int:
        """Bytes a tensor adds to the device: 0 for aliases, constants and variable reads."""
        node = self.eg.graph[t.node]
        if node.op in ALIAS_OPS or node.op in PERSISTENT_OUTPUT_OPS or node.op == "ReadVariableOp":
            return 0
        return self.eg.graph.spec(t).nbytes or 0

    @cached_property
    def footprints(self) -> FootprintModel:
        """Scores orders: ``problem.footprints.footprint(order).peak_bytes``."""
        return self.model or FootprintModel(self.eg)

    @cached_property
    def index(self) -> dict[str, int]:
        return {u: i for i, u in enumerate(self.eg.units)}


def tf_natural(problem: OrderingProblem) -> list[str]:
    eg, device = problem.eg, costmodel.DEFAULT_DEVICE
    time = {u: unit_time_s(eg, u, device) for u in eg.units}
    expensive = expensive_of(eg, eg.graph, device, gpu=False)
    return list(emulate(eg.units, problem.preds, problem.succs, time.__getitem__, expensive.__getitem__).order)


def depth_first(problem: OrderingProblem) -> list[str]:
    """Post-order from the sinks; among a unit's inputs, the one with the largest output goes first."""
    order: list[str] = []
    done: set[str] = set()
    sinks = [u for u in problem.eg.units if not problem.succs[u]]
    for root in sinks:
        stack: list[tuple[str, bool]] = [(root, False)]
        while stack:
            unit, expanded = stack.pop()
            if unit in done:
                continue
            if expanded:
                done.add(unit)
                order.append(unit)
                continue
            stack.append((unit, True))
            preds = sorted((p for p in problem.preds[unit] if p not in done),
                           key=lambda p: (problem.out_bytes[p], -problem.index[p]))
            stack.extend((p, False) for p in preds)  # the largest is pushed last, so it runs first
    return order


def greedy_memory(problem: OrderingProblem) -> list[str]:
    """List scheduling by net bytes freed (freed - allocated), with one step of lookahead."""
    remaining = {t: 0 for u in problem.eg.units for t in problem.inputs[u]}
    for u in problem.eg.units:
        for t in problem.inputs[u]:
            remaining[t] += 1
    pending = {u: len(problem.preds[u]) for u in problem.eg.units}

    def gain(u: str) -> int:
        freed = sum(problem.tensor_bytes(t) for t in problem.inputs[u] if remaining[t] == 1)
        return freed - problem.out_bytes[u]

    def score(u: str) -> tuple[int, int]:
        ahead = max((gain(s) for s in problem.succs[u] if pending[s] == 1), default=0)
        return (-(gain(u) + max(ahead, 0)), problem.index[u])

    heap = [(score(u), u) for u in problem.eg.units if pending[u] == 0]
    heapq.heapify(heap)
    order: list[str] = []
    while heap:
        key, unit = heapq.heappop(heap)
        fresh = score(unit)
        if fresh != key:  # scores drift as other readers run: re-queue with the current one
            heapq.heappush(heap, (fresh, unit))
            continue
        order.append(unit)
        for t in problem.inputs[unit]:
            remaining[t] -= 1
        for s in problem.succs[unit]:
            pending[s] -= 1
            if pending[s] == 0:
                heapq.heappush(heap, (score(s), s))
    return order


STRATEGIES: dict[str, Callable[[OrderingProblem], list[str]]] = {
    "tf_natural": tf_natural,
    "depth_first": depth_first,
    "greedy_memory": greedy_memory,
}


def refine(problem: OrderingProblem, order: list[str], max_evals: int = 200) -> tuple[list[str], OrderFootprint]:
    """Peak-directed local search: move one unit at a time around the estimated peak while the peak falls.

    The moves: the unit at the peak goes to where the least is live within its window (between its last
    predecessor and first successor); a unit just before the peak that allocates runs after it instead; a
    unit just after it (one that may free what is live there) runs before it. Each candidate is scored with
    ``tfmem.sim.analysis.FootprintModel``, at most ``max_evals`` times; the first improvement is kept.
    """
    best, best_fp = list(order), problem.footprints.footprint(order)
    evals = 1
    while evals < max_evals:
        improved = False
        for src, dst in _moves(problem, best, best_fp):
            candidate = best[:src] + best[src + 1:]
            candidate.insert(dst, best[src])
            fp = problem.footprints.footprint(candidate)
            evals += 1
            if fp.peak_bytes < best_fp.peak_bytes:
                best, best_fp, improved = candidate, fp, True
                break
            if evals >= max_evals:
                break
        if not improved:
            break
    return best, best_fp


def _moves(problem: OrderingProblem, order: list[str], fp: OrderFootprint, width: int = 16) -> Iterator[tuple[int, int]]:
    """(from, to) positions of single-unit moves that keep ``order`` topological, most promising first."""
    n, pos = len(order), {u: i for i, u in enumerate(order)}
    peak = max(range(n), key=lambda i: fp.carried[i] + fp.alloc[i])

    def window(i: int) -> tuple[int, int]:
        u = order[i]
        return (max((pos[q] for q in problem.preds[u]), default=-1) + 1,
                min((pos[s] for s in problem.succs[u]), default=n) - 1)

    lo, hi = window(peak)
    yield from ((peak, t) for t in sorted((t for t in range(lo, hi + 1) if t != peak), key=fp.carried.__getitem__)[:4])
    for i in range(peak - 1, max(peak - width, 0) - 1, -1):  # a producer before the peak: after it instead
        if fp.alloc[i] > 0 and window(i)[1] >= peak:
            yield i, peak
    for i in range(peak + 1, min(peak + width, n - 1) + 1):  # a reader after the peak: before it instead
        if window(i)[0] <= peak:
            yield i, peak
