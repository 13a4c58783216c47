"""When each op of *our* graph runs in a simulated step: the clock that swap and placement passes plan with.

The simulator replays the graph the session runs, after Grappler's rewrites, so its schedule names the ops of
that runtime graph. Most keep their names; some do not exist there (folded, fused, pruned). ``StepTimeline``
maps the schedule back onto the graph a pass edits:

* ``rank``: a topological order of our graph's units that follows the simulated start order. Control edges
  that only point forward in it can never close a cycle, whatever else a pass adds in the same order.
* ``start_s`` / ``end_s``: the simulated times; an op missing from the runtime graph inherits the latest end
  of its predecessors (it would have run there, for free).

Examples
--------
>>> import tensorflow as tf
>>> from tfmem.sim.memsim import simulate
>>> from tfmem.ir.shapes import annotate
>>> g = tf.Graph()
>>> with g.as_default():
...     x = tf.compat.v1.placeholder(tf.float32, (256, 256), name="x")
...     y = tf.matmul(x, x, name="y")
...     z = tf.matmul(y, y, name="z")
>>> ir = annotate(g.as_graph_def())
>>> tl = StepTimeline.build(ir, ["z:0"], simulate(ir, ["z:0"]))
>>> tl.rank["y"] < tl.rank["z"], tl.end_s["y"] <= tl.start_s["z"]
(True, True)
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tfmem.ir.execution import ExecutionGraph
from tfmem.ir.graph import GraphIR
from tfmem.sim.profile import MemoryProfile

# How far past the first unit that ends early enough a trigger search keeps looking for a later-ending one
# (ops that overlap in a multi-thread schedule end out of rank order, but only among near neighbours).
SCAN_PAST_EARLY = 64


@dataclass(frozen=True)
class StepTimeline:
    """Simulated start/end times and a consistent rank for every unit of ``eg`` (see the module doc)."""

    eg: ExecutionGraph
    order: tuple[str, ...]               # units of our graph, topological, following the simulated schedule
    rank: Mapping[str, int]
    start_s: Mapping[str, float]
    end_s: Mapping[str, float]
    peak_time_s: float

    @classmethod
    def build(cls, graph: GraphIR, fetches: Iterable[str], profile: MemoryProfile,
              feeds: Iterable[str] = ()) -> StepTimeline:
        eg = ExecutionGraph.build(graph, list(fetches), feeds)
        sched = profile.schedule
        if sched is None:
            raise ValueError("the profile has no schedule; simulate() always records one")
        sim_rank = {u: i for i, u in enumerate(sched.order)}
        sim_start = dict(zip(sched.order, sched.start_s, strict=True))
        sim_end = dict(zip(sched.order, sched.end_s, strict=True))
        # Kahn's algorithm, taking the ready unit the simulation started first; units the runtime graph lacks
        # take their predecessors' position, so they run as soon as they are ready.
        preds, succs = eg.unit_preds, eg.unit_succs
        waiting = {u: len(preds[u]) for u in eg.units}
        position = {u: float(sim_rank[u]) if u in sim_rank else -1.0 for u in eg.units}
        ready = [(position[u], i, u) for i, u in enumerate(eg.units) if waiting[u] == 0]
        heapq.heapify(ready)
        order: list[str] = []
        start: dict[str, float] = {}
        end: dict[str, float] = {}
        index = {u: i for i, u in enumerate(eg.units)}
        while ready:
            _, _, u = heapq.heappop(ready)
            order.append(u)
            ready_at = max((end[p] for p in preds[u]), default=0.0)
            start[u] = sim_start.get(u, ready_at)
            end[u] = sim_end.get(u, ready_at)
            for s in succs[u]:
                waiting[s] -= 1
                if waiting[s] == 0:
                    if s not in sim_rank:
                        position[s] = max(position[p] for p in preds[s])
                    heapq.heappush(ready, (position[s], index[s], s))
        if len(order) != len(eg.units):
            raise ValueError("the graph has a cycle outside v1 loop frames")
        return cls(eg, tuple(order), {u: i for i, u in enumerate(order)}, start, end, profile.peak_time_s)

    def trigger_for(self, consumer: str, lead_s: float, not_before: int, usable: Mapping[str, bool]) -> str | None:
        """The unit (ranked between ``not_before`` and ``consumer``) whose end best starts a prefetch.

        Best is the last to end at least ``lead_s`` before ``consumer`` starts, so a ``lead_s`` transfer is
        hidden. When that would hold the copy on the device for more than another ``lead_s`` (a long op
        runs in between), the first unit to end after that point wins instead: a little transfer time is
        exposed rather than memory held. ``usable`` filters out units that cannot carry a control edge.
        Returns None when no unit qualifies.
        """
        start = self.start_s[consumer]
        deadline = start - lead_s
        early: str | None = None   # ends by the deadline, as late as possible
        late: str | None = None    # ends after the deadline (but before the consumer), as early as possible
        for r in range(self.rank[consumer] - 1, not_before, -1):
            u = self.order[r]
            if early is not None and r < self.rank[early] - SCAN_PAST_EARLY:
                break  # ends only get earlier this far back (up to a few overlapping ops)
            if not usable.get(u, False):
                continue
            end = self.end_s[u]
            if end <= deadline:
                if early is None or end > self.end_s[early]:
                    early = u
            elif end <= start and (late is None or end < self.end_s[late]):
                late = u
        if early is not None and (late is None or deadline - self.end_s[early] <= lead_s):
            return early
        return late
