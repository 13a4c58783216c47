"""The covering problem the planner solves: which options free enough memory at every over-target moment, at the
least cost.

Every stretch of the step where the simulated memory is over the target becomes a covering constraint, and a
mixed-integer program (PuLP with its bundled CBC solver) picks the options of least total cost that cover them all:

    minimise    sum_o cost_o * x_o
    subject to  sum_o saving_o(segment) * x_o >= excess(segment)   for every over-target segment
                sum of x_o over the options of tensor t <= 1          for every tensor t
                x_o in {0, 1}

The solver starts from the greedy heuristic's plan (least cost per byte of excess removed, then redundant picks
dropped, then each pick left out in turn where that covers for less). ``reachable_floor`` is the lowest peak
any plan of the options could reach: every one taken at once.
"""

from __future__ import annotations

import bisect
import heapq
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pulp

from passes.place_persistent import (
    PersistentGroup,
)
from passes.recompute import RecomputePlan
from passes.swap_activations import SwapCandidate
from tfmem.sim import costmodel
from tfmem.sim.profile import MemoryProfile

# Swapped bytes also cost CPU time to copy even when the transfer overlaps compute: at least this share of the
# transfer time is charged as overhead, more where the link keeps the cores busy (``copy_share``).
TRANSFER_OVERHEAD_SHARE = 0.25


def copy_share(link: costmodel.DeviceSpec) -> float:
    """Share of a copy's link time charged as step time besides its exposed part (the testbed's gRPC: all)."""
    return max(TRANSFER_OVERHEAD_SHARE, link.transfer_cpu_share)


# Above this many (option, over-target segment) pairs CBC is not asked and the greedy plan is used: writing and
# presolving the model alone take minutes (experiments/results/planner_large_graph.md).
SOLVER_MAX_PAIRS = 1_000_000
# CBC's branch-and-bound nodes per solve (PuLP's ``maxNodes``), on one thread: a deterministic bound, where a
# time limit would give another plan on a busier machine.
SOLVER_NODES = 2000
# Covers ``_greedy``'s leave-one-out search computes at most (each a few milliseconds to a tenth of a second).
GREEDY_COVERS = 40


@dataclass(frozen=True)
class Option:
    """One way to free memory: what it does, what it saves when, and what it costs."""

    kind: str                                        # "swap", "recompute" or "place"
    key: str                                         # the tensor or variable group it concerns
    nbytes: int
    cost_s: float
    savings: tuple[tuple[float, float, int], ...]    # (from_s, to_s, bytes freed) in simulated time
    payload: SwapCandidate | RecomputePlan | PersistentGroup


@dataclass(frozen=True)
class PlanResult:
    chosen: tuple[Option, ...]
    status: str          # "optimal", "best of N CBC nodes", "heuristic (CBC found no plan in N nodes | model too
    #                      large for the solver)", "heuristic" (no solver asked for), "infeasible"
    solve_s: float       # CBC's time, for reports only
    objective_s: float
    heuristic_objective_s: float
    follow_ups: int = 0   # rounds planned on the applied plan's simulation (``Planner._follow_up``)
    solver_calls: int = 0   # CBC runs behind this plan


def solve_cover(options: Sequence[Option], profile: MemoryProfile, target_bytes: int,
                solver_nodes: int = SOLVER_NODES, use_solver: bool = True) -> PlanResult:
    """Choose options that cover every over-target moment of ``profile`` at the least cost: CBC from the greedy
    plan for at most ``solver_nodes`` nodes, or the greedy plan alone without ``use_solver``, with no nodes, or
    when the model has more than ``SOLVER_MAX_PAIRS`` (option, segment) pairs."""
    segments, excess = _over_budget_segments(profile, options, target_bytes)
    cover = _cover(options, segments)
    by_option = _option_arrays(cover)
    greedy = _greedy(options, by_option, excess)
    heuristic_cost = sum(options[i].cost_s for i in greedy)
    feasible = all(sum(b for _, b in row) >= need for row, need in zip(cover, excess, strict=True))
    too_large = sum(len(row) for row in cover) > SOLVER_MAX_PAIRS
    if not use_solver or not excess or solver_nodes < 1 or too_large:
        status = "infeasible" if not feasible else (
            "heuristic (model too large for the solver)" if too_large and use_solver and excess else "heuristic")
        return PlanResult(tuple(options[i] for i in greedy), status, 0.0, heuristic_cost, heuristic_cost)
    if not feasible:
        return PlanResult(tuple(options[i] for i in greedy), "infeasible", 0.0, heuristic_cost, heuristic_cost)
    problem = pulp.LpProblem("tfmem_plan", pulp.LpMinimize)
    x = [problem.add_variable(f"x{i}", cat="Binary") for i in range(len(options))]
    # A tiny charge per byte breaks ties toward moving less.
    problem += pulp.lpSum((o.cost_s + o.nbytes * 1e-15) * x[i] for i, o in enumerate(options))
    for row, need in zip(cover, excess, strict=True):  # built from (variable, bytes) pairs: fast at scale
        problem += pulp.LpAffineExpression([(x[i], b) for i, b in row]) >= need
    by_tensor: dict[str, list[int]] = {}
    for i, o in enumerate(options):
        by_tensor.setdefault(o.key, []).append(i)
    for members in by_tensor.values():
        if len(members) > 1:
            problem += pulp.lpSum(x[i] for i in members) <= 1
    chosen_greedy = set(greedy)
    for i, var in enumerate(x):
        var.setInitialValue(1 if i in chosen_greedy else 0)
    with warnings.catch_warnings():  # PuLP 3.3 deprecates its bundled CBC; it is still the one installed
        warnings.simplefilter("ignore", DeprecationWarning)
        solver = pulp.PULP_CBC_CMD(msg=False, warmStart=True, threads=1, maxNodes=solver_nodes)
    started = time.perf_counter()
    problem.solve(solver)
    elapsed = time.perf_counter() - started
    picked = [i for i, var in enumerate(x) if (var.value() or 0) > 0.5]
    cost = sum(options[i].cost_s for i in picked)
    found = pulp.LpStatus[problem.status] == "Optimal"   # PuLP's word for "has a solution", proven or not
    if not found or not _covers(picked, by_option, np.array(excess, dtype=np.int64)):
        return PlanResult(tuple(options[i] for i in greedy), f"heuristic (CBC found no plan in {solver_nodes} nodes)",
                          elapsed, heuristic_cost, heuristic_cost, solver_calls=1)
    if cost >= heuristic_cost:   # the greedy plan is as cheap: keep it (CBC may return another of equal cost)
        picked, cost = greedy, heuristic_cost
    proven = problem.sol_status == pulp.LpSolutionOptimal
    status = "optimal" if proven else f"best of {solver_nodes} CBC nodes"
    return PlanResult(tuple(options[i] for i in picked), status, elapsed, cost, heuristic_cost, solver_calls=1)


def reachable_floor(profile: MemoryProfile, options: Sequence[Option],
                    idle: Sequence[tuple[str, tuple[tuple[float, float, int], ...]]] = ()) -> tuple[int, float]:
    """The lowest peak these options could reach on this order: every one of them taken at once.

    At each moment of the simulated step, the device holds what it holds less everything some option could
    free then (a tensor with several ways to go -- options, and the ``idle`` stretches between its uses in
    which a swap could take it away -- counts once, at its largest saving over the union of their windows: an
    over-estimate, so the result stays a lower bound). Returns the highest such remainder and its time. What
    nothing can free at that moment -- the running ops' working sets, persistent tensors nothing may
    host-place, tensors too small to move -- is what any plan built from these moves must still hold there.

    Examples
    --------
    >>> from types import SimpleNamespace
    >>> prof = SimpleNamespace(timeline=((0.0, 10, 0, "a"), (1.0, 30, 0, "b"), (2.0, 20, 0, "c")))
    >>> opts = [Option("swap", "t", 15, 0.1, ((0.5, 1.5, 15),), None)]
    >>> reachable_floor(prof, opts)   # at 1.0 s: 30 - 15; at 2.0 s nothing can be freed
    (20, 2.0)
    """
    if not profile.timeline:
        return 0, 0.0
    times = np.array([t for t, *_ in profile.timeline], dtype=np.float64)
    held = np.array([d for _, d, *_ in profile.timeline], dtype=np.int64)
    by_key: dict[str, list[tuple[tuple[float, float, int], ...]]] = {}
    for o in options:
        by_key.setdefault(o.key, []).append(o.savings)
    for key, windows in idle:
        by_key.setdefault(key, []).append(windows)
    freeable = np.zeros(len(times) + 1, dtype=np.int64)
    for ways in by_key.values():
        spans = [w for savings in ways for w in savings if w[2] > 0]
        if len(ways) > 1 and spans:  # alternatives for one tensor: the union of their windows, counted once
            spans = _union(spans)
        for start, stop, nbytes in spans:
            lo, hi = np.searchsorted(times, start, "left"), np.searchsorted(times, stop, "right")
            freeable[lo] += nbytes
            freeable[hi] -= nbytes
    remainder = held - np.cumsum(freeable)[:-1]
    at = int(np.argmax(remainder))
    return int(remainder[at]), float(times[at])


def _union(spans: list[tuple[float, float, int]]) -> list[tuple[float, float, int]]:
    """Overlapping windows merged, each merged one at the largest saving among its parts.

    >>> _union([(0.0, 2.0, 5), (1.0, 3.0, 8), (4.0, 5.0, 1)])
    [(0.0, 3.0, 8), (4.0, 5.0, 1)]
    """
    merged: list[tuple[float, float, int]] = []
    for start, stop, nbytes in sorted(spans):
        if merged and start <= merged[-1][1]:
            a, b, n = merged[-1]
            merged[-1] = (a, max(b, stop), max(n, nbytes))
        else:
            merged.append((start, stop, nbytes))
    return merged


def freed_byte_seconds(option: Option) -> float:
    """Byte-seconds an option frees on the simulated step."""
    return sum((stop - start) * nbytes for start, stop, nbytes in option.savings)


def savings_outside(nbytes: int, windows: list[tuple[float, float, int]], end: float) -> tuple[tuple[float, float, int], ...]:
    """Savings of a host-placed group: all of it, except what its prefetched copies hold while in use."""
    pieces, cursor = [], 0.0
    for start, stop, held in windows:
        if start > cursor:
            pieces.append((cursor, start, nbytes))
        pieces.append((start, stop, max(nbytes - held, 0)))
        cursor = max(cursor, stop)
    if cursor < end:
        pieces.append((cursor, end + 1.0, nbytes))
    return tuple(p for p in pieces if p[1] > p[0])


def _over_budget_segments(profile: MemoryProfile, options: Sequence[Option], target_bytes: int,
                          ) -> tuple[list[tuple[float, float]], list[int]]:
    """Split time where any option's saving changes; keep the segments whose memory exceeds ``budget``."""
    cuts = sorted({0.0} | {t for o in options for s, e, _ in o.savings for t in (s, e)})
    need: dict[int, int] = {}
    for time_s, device_bytes, _host, _unit in profile.timeline:
        if device_bytes > target_bytes:
            seg = max(bisect.bisect_right(cuts, time_s) - 1, 0)
            need[seg] = max(need.get(seg, 0), device_bytes - target_bytes)
    segments = [(cuts[s], cuts[s + 1] if s + 1 < len(cuts) else float("inf")) for s in sorted(need)]
    return segments, [need[s] for s in sorted(need)]


def _cover(options: Sequence[Option], segments: list[tuple[float, float]]) -> list[list[tuple[int, int]]]:
    """Per segment, the options whose savings span it whole, with the bytes each frees there."""
    starts = [a for a, _ in segments]
    ends = [b for _, b in segments]
    rows: list[dict[int, int]] = [{} for _ in segments]
    for i, o in enumerate(options):
        for s, e, b in o.savings:
            if b <= 0:
                continue
            # segments are sorted and disjoint: those with start >= s and end <= e form one run
            for k in range(bisect.bisect_left(starts, s), bisect.bisect_right(ends, e)):
                if starts[k] >= s and ends[k] <= e:
                    rows[k][i] = max(rows[k].get(i, 0), b)
    return [sorted(r.items()) for r in rows]


def _greedy(options: Sequence[Option], by_option: dict[int, tuple[np.ndarray, np.ndarray]], excess: list[int],
            covers: int = GREEDY_COVERS) -> list[int]:
    """The fallback plan: the cheapest of a greedy cover and its variants that each leave one of its picks out.

    The plain greedy (``_greedy_cover``) commits early to options that look cheap per byte; leaving each pick
    out in turn (costliest first) and covering again finds a cheaper plan where one exists nearby. The search
    repeats from any cheaper plan it finds, for at most ``covers`` covers computed.

    Examples
    --------
    >>> opts = [Option("swap", t, n, cost, (), None) for t, n, cost in [("a", 4, 1.0), ("b", 4, 1.0), ("c", 8, 1.5)]]
    >>> _greedy(opts, _option_arrays([[(0, 4), (2, 8)], [(1, 4), (2, 8)]]), excess=[4, 4])   # c covers both at once
    [2]
    """
    need = np.array(excess, dtype=np.int64)

    def cost(picks: list[int]) -> float:
        return sum(options[i].cost_s for i in picks)

    best = _greedy_cover(options, by_option, need)
    improved = True
    while improved and covers > 0:
        improved = False
        for left_out in sorted(best, key=lambda i: (-options[i].cost_s, i))[:covers]:
            covers -= 1
            alternative = _greedy_cover(options, by_option, need, exclude={left_out})
            if cost(alternative) < cost(best) - 1e-12 and _covers(alternative, by_option, need):
                best, improved = alternative, True
                break
    return best


def _option_arrays(cover: list[list[tuple[int, int]]]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per option, the segments it spans and the bytes it frees there, as arrays.

    A 20,000-op graph has millions of (option, segment) pairs; re-scoring them in Python loops would take minutes.
    """
    pairs: dict[int, tuple[list[int], list[int]]] = {}
    for s, row in enumerate(cover):
        for i, b in row:
            segs, frees = pairs.setdefault(i, ([], []))
            segs.append(s)
            frees.append(b)
    return {i: (np.array(segs, dtype=np.int64), np.array(frees, dtype=np.int64)) for i, (segs, frees) in pairs.items()}


def _covers(picks: list[int], by_option: dict[int, tuple[np.ndarray, np.ndarray]], need: np.ndarray) -> bool:
    covered = np.zeros_like(need)
    for i in picks:
        segs, frees = by_option[i]
        np.add.at(covered, segs, frees)
    return bool(np.all(covered >= need))


def _greedy_cover(options: Sequence[Option], by_option: dict[int, tuple[np.ndarray, np.ndarray]], need: np.ndarray,
                  exclude: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """Least cost per byte still needed first, until every segment is covered; then drop what became redundant.

    The classic greedy for weighted covering: an option's worth is the excess it still removes (summed over
    the segments it spans, each capped at what that segment still needs), so it is re-scored as the plan
    grows (lazily: a worth only falls). One option per tensor: an option whose tensor already has a pick is
    scored as a replacement (what it adds over the pick, for what it costs more), since the first way chosen
    for a tensor, a short gap say, may not span a segment that another of its ways would
    (``tests/test_planner.py::test_greedy_with_several_ways_per_tensor_takes_one_each_and_still_covers``).
    Then, costliest first, picks whose segments stay covered without them are dropped.
    Options in ``exclude`` are not considered.

    Tensor a's first way spans segment 0, its second (dearer) way both; b spans segment 1 for more. a's first
    way is the cheapest per byte; then a's second way replaces it, for less than adding b:

    >>> opts = [Option("swap", "a", 4, 1.0, (), None), Option("swap", "a", 4, 3.0, (), None),
    ...         Option("swap", "b", 4, 5.0, (), None)]
    >>> _greedy_cover(opts, _option_arrays([[(0, 4), (1, 4)], [(1, 4), (2, 4)]]), np.array([4, 4]))
    [1]
    """
    covered = np.zeros_like(need)
    unmet = int((need > 0).sum())   # segments not yet covered, kept up to date by ``shift``
    chosen: dict[str, int] = {}   # tensor (option key) -> its pick

    def shift(i: int, sign: int) -> None:   # add (+1) or take out (-1) option i's bytes
        nonlocal unmet
        segs, frees = by_option[i]   # each segment once per option
        was = covered[segs] >= need[segs]
        covered[segs] += sign * frees
        now = covered[segs] >= need[segs]
        unmet -= int((now & ~was).sum()) - int((was & ~now).sum())

    def ratio(i: int) -> float:   # cost per byte of excess removed; inf when it removes none
        held = chosen.get(options[i].key)
        if held == i:
            return float("inf")
        gain = _gain(by_option, covered, need, i, held)
        extra = options[i].cost_s - (options[held].cost_s if held is not None else 0.0)
        return (max(extra, 0.0) + 1e-12) / gain if gain > 0 else float("inf")

    heap = [(ratio(i), i) for i in by_option if i not in exclude]
    heapq.heapify(heap)
    while heap and unmet:
        stale, i = heapq.heappop(heap)
        fresh = ratio(i)
        if fresh == float("inf"):
            continue
        if heap and fresh > heap[0][0] and fresh > stale:  # worth fell since it was scored: score it again
            heapq.heappush(heap, (fresh, i))
            continue
        held = chosen.get(options[i].key)
        if held is not None:   # replaced: it may come back, scored against i
            shift(held, -1)
            heapq.heappush(heap, (ratio(held), held))
        chosen[options[i].key] = i
        shift(i, +1)
    picks = list(chosen.values())
    for i in sorted(picks, key=lambda i: -options[i].cost_s):
        segs, frees = by_option[i]
        # still covered without it where covered now (a segment no set of options covers keeps its picks)
        if bool(np.all(covered[segs] - frees >= np.minimum(need[segs], covered[segs]))):
            picks.remove(i)
            np.subtract.at(covered, segs, frees)
    return picks


def _gain(by_option: dict[int, tuple[np.ndarray, np.ndarray]], covered: np.ndarray, need: np.ndarray, i: int,
          replacing: int | None = None) -> int:
    """Excess that taking option ``i`` removes, given ``covered`` bytes per segment (in place of ``replacing``)."""
    segs, frees = by_option[i]
    if replacing is None:
        return int(np.minimum(frees, np.maximum(need[segs] - covered[segs], 0)).sum())
    old_segs, old_frees = by_option[replacing]
    touched = np.union1d(segs, old_segs)
    before = covered[touched]
    after = before.copy()
    after[np.searchsorted(touched, old_segs)] -= old_frees
    after[np.searchsorted(touched, segs)] += frees
    return int((np.minimum(need[touched], after) - np.minimum(need[touched], before)).sum())
