"""Emulate the order in which TensorFlow's executor runs a graph.

TensorFlow runs every ready op as soon as it can. With its thread pool, the executor keeps a per-thread
"inline" queue of ready ops; of the ops an op makes ready, cheap ones join the inline queue, and of the
expensive ones all but the last are pushed to the thread pool (an Eigen pool: a worker pushes to the
*front* of its own queue, so its own pushes come back last-in first-out) while the last one runs inline if
the inline queue is empty. Roots are the successors of the ``_SOURCE`` node, which runs first, so they
are scheduled by the same rule, in hashed order when there are more than ``EDGE_SET_INLINE`` of them.

``emulate`` reproduces that policy as a discrete-event simulation: with one inter-op thread it is exactly the
order above; with more, idle threads take tasks from the shared pool while each op takes its cost-model time.
The memory simulator replays the returned ``Schedule``.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from tfmem.errors import ScheduleError
from tfmem.ir.execution import EDGE_SET_INLINE, hash_order


@dataclass(frozen=True)
class Schedule:
    """Units in start order, with emulated start and end times in seconds."""

    order: tuple[str, ...]
    start_s: tuple[float, ...]
    end_s: tuple[float, ...]

    @property
    def makespan_s(self) -> float:
        return max(self.end_s, default=0.0)


def emulate(
    units: Sequence[str],
    preds: Mapping[str, Sequence[str]],
    succs: Mapping[str, Sequence[str]],
    duration_s: Callable[[str], float],
    expensive: Callable[[str], bool],
    threads: int = 1,
    seed: int = 0,
) -> Schedule:
    """Emulate TF's executor on the DAG ``units`` (in graph order) with ``threads`` inter-op threads.

    ``succs`` lists each unit's successors in the order TF activates them; ``seed`` picks the order of the
    roots when they are too many for TF to keep in order (``tfmem.ir.execution.activation_order``).

    Raises ``ScheduleError`` when some units never become ready (the graph has a cycle).

    Examples
    --------
    >>> s = emulate(["a", "b", "c"], {"c": ["a", "b"]}, {"a": ["c"], "b": ["c"]},
    ...             duration_s=lambda u: 1.0, expensive=lambda u: True)
    >>> s.order  # both roots are expensive: "a" goes to the pool, the last one ("b") runs inline first
    ('b', 'a', 'c')
    """
    pending = {u: len(set(preds.get(u, ()))) for u in units}
    pool: deque[str] = deque()
    inline: list[deque[str]] = [deque() for _ in range(max(1, threads))]
    busy_until: list[tuple[float, int, str]] = []  # heap of (end time, thread, unit)
    idle = list(range(max(1, threads)))
    order: list[str] = []
    start: list[float] = []
    end: list[float] = []
    now = 0.0

    def make_ready(thread: int, done: str | None) -> None:
        ready = []
        for s in succs.get(done, ()) if done is not None else roots:
            pending[s] -= 1
            if pending[s] == 0:
                ready.append(s)
        expensive_last: str | None = None
        for r in ready:
            if not expensive(r):
                inline[thread].append(r)
                continue
            if expensive_last is not None:
                pool.appendleft(expensive_last)
            expensive_last = r
        if expensive_last is not None:
            if inline[thread]:
                pool.appendleft(expensive_last)
            else:
                inline[thread].append(expensive_last)

    roots = [u for u in units if pending[u] == 0]
    if len(roots) > EDGE_SET_INLINE:  # _SOURCE's out-edges are hashed too (see ExecutionGraph.unit_succs)
        roots = list(hash_order("_SOURCE", roots, seed))
    for u in roots:  # roots hang off TF's _SOURCE node, which completes first on thread 0
        pending[u] = 1
    make_ready(0, None)
    while True:
        for thread in sorted(idle):
            source = inline[thread] if inline[thread] else pool
            if not source:
                continue
            unit = source.popleft()
            idle.remove(thread)
            order.append(unit)
            start.append(now)
            end.append(now + duration_s(unit))
            heapq.heappush(busy_until, (end[-1], thread, unit))
        if not busy_until:
            break
        now, thread, unit = heapq.heappop(busy_until)
        idle.append(thread)
        make_ready(thread, unit)

    if len(order) != len(units):
        stuck = [u for u in units if pending[u] > 0][:5]
        raise ScheduleError(
            f"{len(units) - len(order)} op(s) never become ready (a cycle through e.g. {', '.join(stuck)}); "
            "the graph's data and control edges must form a DAG outside control-flow frames"
        )
    return Schedule(tuple(order), tuple(start), tuple(end))


def fixed(order: Sequence[str], duration_s: Callable[[str], float]) -> Schedule:
    """A one-thread schedule that runs ``order`` exactly as given."""
    starts, ends, now = [], [], 0.0
    for u in order:
        starts.append(now)
        now += duration_s(u)
        ends.append(now)
    return Schedule(tuple(order), tuple(starts), tuple(ends))
