"""The budget search: every plan ``tfmem.optimize`` tries for one budget, in order, and the rule that picks one.

At one target (``Search.plan_at``) the passes before the planner run once, then these attempts, each giving a
``Candidate`` (the passes after the planner applied, simulated):

1. ``solve``: the planner's covering model (``passes.planner``).
2. ``solve, plainer options``: the model with one idle gap per tensor and no just-in-time copies; when 1 misses,
   on graphs of up to ``COMPARE_SINGLE_MAX_OPS`` ops (the model charges each option alone, and a plan of plainer
   options can land lower once applied).
   On graphs over ``COMPARE_SINGLE_MAX_OPS`` ops, when 1 misses, its plan is continued greedily (6, ``greedy
   repair of 'solve'``) before anything else, and 3 to 6 follow only if that misses too.
3. ``<strategy> alone``: swap_activations, recompute and place_persistent, each applied greedily and
   re-simulated at every step (one that falls short continued by ``MIXED_AFTER``), and ``recompute where
   cheaper than copying, then swap_activations``; when 1 and 2 miss, and also when they fit on graphs of up to
   ``COMPARE_SINGLE_MAX_OPS`` ops with an estimated step more than ``COMPARE_MIN_GAIN`` slower than before
   planning (a greedy mix can be quicker than the model's plan: experiments/results/planner_strategies.md).
4. ``every option, then the dearest given back``: when nothing fits yet.
5. ``large ops one at a time, then solve``: when nothing fits yet (ops that run side by side add their working
   sets).
6. ``greedy repair``: the lowest plan so far, continued by each strategy; when nothing fits yet.

A pass list without the planner has one attempt: ``the passes as given``.

The rule (``choose``): of the candidates within the target, the least estimated step time (the earlier
attempt on a tie); when none is, the lowest peak. Across targets (``Search.run``): the first is the budget
less the plan margin (``tfmem.optimizer.target_bytes_for``). Candidates within the highest target are replayed on
the device allocator's layout (``layout_order``: those within the current target quickest first, then the others lowest first), at most
``LAYOUT_CHECKS`` per target; the first that fits is accepted. When candidates fit in total but none fits the
layout, the next target is lower by the least that one of the refused plans' layouts needed (``replan for less
after a layout refusal``, at most ``CAPACITY_RETRIES`` times), and once a plan is accepted after a refusal,
``REFINE_STEPS`` targets in between are tried (``LARGE_REFINE_STEPS`` on large graphs), bisecting, and the
quickest accepted plan kept. When nothing fits in total, the search stops and the budget is refused.

Every bound is a count (attempts, replans, simulations inside the passes, CBC's branch-and-bound nodes), never
elapsed time, so the same graph, budget and options give the same plan under any load (``tests/test_search.py``);
the machine's core count is an input, as TF sizes its thread pools by it. ``SearchLog`` records each attempt with its outcome, the simulations and solver
calls it made and the time it took; ``optimize``'s report lists them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from passes.place_persistent import PlacePersistent
from passes.plan_cover import copy_share
from passes.plan_report import chained_report, strategy_report
from passes.planner import Planner
from passes.recompute import Recompute
from passes.serialize_scratch import serialize_large_ops
from passes.swap_activations import SwapActivations
from tfmem.ir.graph import GraphIR
from tfmem.ir.tags import strip_tags
from tfmem.pipeline import Pass, PassContext, PassReport, PassResult, run_pipeline
from tfmem.sim import grappler, memsim
from tfmem.sim.profile import MemoryProfile
from tfmem.units import format_bytes

# Each attempt is logged as it ends (INFO), for progress on long searches: logging.basicConfig(level=logging.INFO).
_log = logging.getLogger(__name__)
# Up to this many ops, a plan the model makes that fits is also compared with each strategy alone, and a plan
# that misses with the plainer options' plan: each re-simulates the graph at every step (seconds on graphs this
# size; on TF-Slim's ResNet-50, 9,200 ops, the comparisons took 300 of the search's 530 s, profiled, and the
# model's plan is the quicker one on the graphs of experiments/results/planner_strategies.md).
COMPARE_SINGLE_MAX_OPS = 4_000
# A fitting plan is compared only when it is estimated this much slower than the graph before planning: no
# comparison can gain more than the plan's overhead, and each costs several simulations.
COMPARE_MIN_GAIN = 0.03
# A strategy that frees memory but not enough is continued by these, in turn, until the plan fits: after host
# placement what is over is activations (tests/test_planner.py, host placement continued by swapping).
MIXED_AFTER = {"swap_activations": ("recompute",), "recompute": ("swap_activations",),
               "place_persistent": ("swap_activations", "recompute")}
CAPACITY_RETRIES = 6   # replans for less after layout refusals
REFINE_STEPS = 3       # targets tried between the last one the layout refused and the first it took
LARGE_REFINE_STEPS = 1  # on graphs over COMPARE_SINGLE_MAX_OPS ops, where each target's attempts take minutes
LAYOUT_CHECKS = 3      # candidates replayed on the allocator's layout per target (``layout_order``)


@dataclass(frozen=True)
class Candidate:
    """One plan an attempt made: the graph as ``optimize`` would return it, with its simulation."""

    label: str
    target_bytes: int | None
    ir: GraphIR                     # after every pass, tags stripped
    reports: tuple[PassReport, ...]
    profile: MemoryProfile
    planned: GraphIR                # before the passes after the planner (what a repair continues from)
    floor_bytes: int | None = None  # the planner's reachable floor, where it ran

    @property
    def peak_bytes(self) -> int:
        return self.profile.peak_bytes

    @property
    def estimated_step_s(self) -> float:
        return self.profile.estimated_step_s


@dataclass(frozen=True)
class Attempt:
    """One line of the search log."""

    label: str
    target_bytes: int | None
    peak_bytes: int | None
    estimated_step_s: float | None
    outcome: str
    time_s: float             # for the report only: no decision reads it
    simulations: int          # computed, not answered from a cache
    grappler_rewrites: int    # of which this many ran Grappler on a graph not seen before
    solver_calls: int

    def line(self) -> str:
        at = f" for {format_bytes(self.target_bytes)}" if self.target_bytes is not None else ""
        peak = f", peak {format_bytes(self.peak_bytes)}" if self.peak_bytes is not None else ""
        step = f", {self.estimated_step_s * 1e3:.1f} ms/step" if self.estimated_step_s is not None else ""
        return (f"{self.label}{at}: {self.outcome}{peak}{step} ({self.simulations} simulations, "
                f"{self.grappler_rewrites} Grappler rewrites, {self.solver_calls} solver calls, {self.time_s:.1f} s)")


@dataclass
class SearchLog:
    """What the search did, in order, and its totals."""

    attempts: list[Attempt] = field(default_factory=list)
    simulations: int = 0
    grappler_rewrites: int = 0
    solver_calls: int = 0
    replans: int = 0          # targets planned for after the first
    layout_checks: int = 0

    def summary(self) -> str:
        return (f"search: {len(self.attempts)} attempts, {self.replans} replans, {self.simulations} simulations "
                f"({self.grappler_rewrites} Grappler rewrites), {self.solver_calls} solver calls, "
                f"{self.layout_checks} layout replays")


def work_done() -> tuple[int, int]:
    """Simulations computed (cache hits aside) and Grappler rewrites run so far in this process."""
    return memsim.WORK["simulations"], grappler.WORK["rewrites"]


def choose(candidates: Sequence[Candidate], target_bytes: int) -> Candidate:
    """The candidate to keep at one target: the first in ``layout_order`` with no limit (of those within the
    target, the least estimated step time; when none is, the lowest peak; the earlier attempt on a tie).

    >>> from types import SimpleNamespace as N
    >>> c = [N(label=l, peak_bytes=p, estimated_step_s=s) for l, p, s in [("a", 9, 1.0), ("b", 8, 2.0), ("c", 7, 1.5)]]
    >>> choose(c, 8).label, choose(c, 6).label
    ('c', 'c')
    >>> choose(c, 9).label
    'a'
    """
    return layout_order(candidates, target_bytes, max(c.peak_bytes for c in candidates))[0]


def layout_order(candidates: Sequence[Candidate], target_bytes: int, limit_bytes: int) -> list[Candidate]:
    """The candidates within ``limit_bytes`` in the order their layouts are replayed: those within the target
    planned for, quickest first, then the others, lowest peak first (attempt order on ties).

    After a layout refusal the target is lower, and the plans that meet it are the point of planning again: a
    quicker plan above it was refused already, or is like one that was (tests/test_guarantee_rewrites.py).

    >>> from types import SimpleNamespace as N
    >>> c = [N(label=l, peak_bytes=p, estimated_step_s=s) for l, p, s in [("a", 9, 1.0), ("b", 7, 3.0), ("c", 6, 2.0)]]
    >>> [x.label for x in layout_order(c, 7, 9)]
    ['c', 'b', 'a']
    """
    within = sorted((c for c in candidates if c.peak_bytes <= target_bytes), key=lambda c: c.estimated_step_s)
    over = sorted((c for c in candidates if target_bytes < c.peak_bytes <= limit_bytes), key=lambda c: c.peak_bytes)
    return within + over


def _split(pipeline: Sequence[Pass]) -> tuple[list[Pass], Planner | None, list[Pass]]:
    """The passes before the planner, the planner (None if absent) and the passes after it."""
    for i, p in enumerate(pipeline):
        if isinstance(p, Planner):
            return list(pipeline[:i]), p, list(pipeline[i + 1:])
    return list(pipeline), None, []


@dataclass
class Search:
    """The budget search over ``pipeline`` for a graph ``ir`` (see the module docstring).

    ``fits_layout(candidate)`` replays a plan on the allocator's layout, and ``layout_step(candidate)`` says how
    much lower to plan after the layout refused it, and why; both come from ``optimize`` (or a test).
    """

    ir: GraphIR
    pipeline: Sequence[Pass]
    base: PassContext
    before: MemoryProfile
    fits_layout: Callable[[Candidate], bool] | None = None
    layout_step: Callable[[Candidate], tuple[int, str]] | None = None
    log: SearchLog = field(default_factory=SearchLog)
    notes: list[str] = field(default_factory=list)
    refine_steps: int = REFINE_STEPS

    def __post_init__(self) -> None:
        self.prefix, self.planner, self.suffix = _split(self.pipeline)
        if len(self.ir) > COMPARE_SINGLE_MAX_OPS:
            self.refine_steps = LARGE_REFINE_STEPS

    # -- across targets ------------------------------------------------------------------------------------------

    def run(self, max_target: int | None, first_target: int | None, bound: int = 0) -> tuple[Candidate, bool]:
        """The plan for a budget whose plans must stay within ``max_target`` in total, starting at
        ``first_target``; and whether it is accepted (within ``max_target``, and fits the layout where
        ``fits_layout`` is given). Without a target, the passes run once and the result is accepted."""
        if max_target is None or first_target is None:
            return choose(self.plan_at(None), 0), True
        target = first_target
        refused: Candidate | None = None    # the first candidate the layout refused, for the report
        refused_for: int | None = None      # the last target whose candidates fit in total but not in the layout
        for replan in range(CAPACITY_RETRIES + 1):
            if replan:
                self.log.replans += 1
            candidates = self.plan_at(target)
            in_total = layout_order(candidates, target, max_target)
            if not in_total:
                # Missed in total. Not planned again for less: a plan asked for less than the planner reaches can
                # measure far above its simulation (tests/test_guarantee.py, the unrolled RNN at 36 MiB).
                return (refused or choose(candidates, max_target)), False
            accepted = self._first_fitting_layout(in_total)
            if accepted is not None:
                if refused_for is not None:
                    accepted = self._refined(accepted, target, refused_for, max_target)
                return accepted, True
            refused, refused_for = in_total[0], target
            assert self.layout_step is not None
            # The smallest step any refused plan needs: a larger one skips targets where that plan, or one like
            # it, would fit the layout (a greedy plan's layout can need far more room than the solved plan's).
            step, why = min((self.layout_step(c) for c in in_total[:LAYOUT_CHECKS]), key=lambda s: s[0])
            lower = max(target - step, bound)
            floor = refused.floor_bytes
            if floor is not None and lower < floor < target:
                # Not past the planner's reachable floor in one step: asked for less, it makes the same plan as
                # for its floor, and the targets in between, where a plan may fit the layout, would go untried.
                lower = floor
            self.notes.append(f"a plan for {format_bytes(target)} (peak {format_bytes(refused.peak_bytes)}) does not "
                              f"fit the device allocator's chunks{why}; planned again for {format_bytes(lower)}")
            if target <= bound:   # no plan can go lower
                break
            target = lower
        assert refused is not None
        return refused, False

    def _first_fitting_layout(self, in_total: Sequence[Candidate]) -> Candidate | None:
        """The first of ``in_total`` that fits the allocator's layout (at most ``LAYOUT_CHECKS`` replayed)."""
        if self.fits_layout is None:
            return in_total[0]
        for candidate in in_total[:LAYOUT_CHECKS]:
            started, sims = time.perf_counter(), work_done()
            self.log.layout_checks += 1
            fits = self.fits_layout(candidate)
            self._record(candidate.label + ", allocator layout replay", candidate.target_bytes, candidate,
                         "fits" if fits else "refused by the allocator layout", started, sims, 0)
            if fits:
                return candidate
        return None

    def _refined(self, accepted: Candidate, low: int, high: int, max_target: int) -> Candidate:
        """Targets between ``low`` (whose plan the layout took) and ``high`` (refused), bisecting; the quickest
        accepted plan wins.

        The step down after a refusal is what the refused plan's layout needed, which overshoots when a
        different plan would lay out better, and a plan for much less can be much slower
        (``tests/test_search.py::test_after_a_layout_refusal_targets_in_between_are_tried``).
        """
        best = accepted
        for _ in range(self.refine_steps):
            if high - low < 2 * 2**20:
                break
            middle = (low + high) // 2
            self.log.replans += 1
            found = self._first_fitting_layout(layout_order(self.plan_at(middle), middle, max_target))
            if found is None:
                high = middle
                continue
            low = middle
            if found.estimated_step_s < best.estimated_step_s:
                best = found
        return best

    # -- at one target ---------------------------------------------------------------------------------------------

    def plan_at(self, target_bytes: int | None) -> list[Candidate]:
        """Every attempt at one target, in order (see the module docstring)."""
        ctx = dataclasses.replace(self.base, target_bytes=target_bytes)
        started, sims = time.perf_counter(), work_done()
        start, prefix_reports = run_pipeline(self.ir, self.prefix, ctx)
        if self.planner is None or target_bytes is None:
            planner = [self.planner] if self.planner is not None else []
            planned, reports = run_pipeline(start, planner, ctx)
            return [self._candidate("the passes as given", ctx, planned, (*prefix_reports, *reports), started,
                                    sims)]
        start_profile = ctx.simulate(start)
        made: list[Candidate] = []

        def fits() -> bool:
            return any(c.peak_bytes <= target_bytes for c in made)

        def add(label: str, result: PassResult, floor: int | None = None) -> None:
            nonlocal started, sims
            # which attempt made the plan, and its time (experiments read both from the planner's report)
            result.report.details.update(attempt=label, planner_s=time.perf_counter() - started)
            made.append(self._candidate(label, ctx, result.graph, (*prefix_reports, result.report), started, sims,
                                        floor))
            started, sims = time.perf_counter(), work_done()

        def solved(label: str, planner: Planner, graph: GraphIR) -> None:
            result = planner.run(graph, ctx)
            add(label, result, result.report.details.get("reachable_floor_bytes"))   # type: ignore[arg-type]

        small = len(start) <= COMPARE_SINGLE_MAX_OPS
        solved("solve", self.planner, start)
        if start_profile.peak_bytes <= target_bytes:
            return made
        if not fits() and small and (self.planner.gaps > 1 or self.planner.just_in_time):
            solved("solve, plainer options", dataclasses.replace(self.planner, gaps=1, just_in_time=False), start)
        # A fitting plan within COMPARE_MIN_GAIN of the unplanned step leaves no comparison more to gain.
        slack = min((c.estimated_step_s for c in made if c.peak_bytes <= target_bytes), default=float("inf"))
        worth = slack > start_profile.estimated_step_s * (1 + COMPARE_MIN_GAIN)
        early = 0   # candidates a large graph's early repair made or started from: repairing them again adds nothing
        if not fits() and not small:
            # On large graphs each strategy re-simulates the graph tens of times (minutes): the solve's own plan,
            # continued greedily, is tried first (TF-Slim Inception v1 at 0.5x, profiled: its repair fitted in
            # 59 s, after the four strategies had taken 485 s and all missed).
            self._repair_into(made[0], ctx, add)
            early = len(made)
        if (small and worth) or not fits():
            for label, result in self._strategies(start, start_profile, ctx):
                add(label, result)
        if not fits():
            thinned = self.planner.everything_then_thin(start, ctx)
            if thinned is not None:
                add("every option, then the dearest given back", thinned)
        if not fits():
            solved("large ops one at a time, then solve", self.planner, serialize_large_ops(start, ctx))
        if not fits():
            lowest = min(made, key=lambda c: c.peak_bytes)
            if not any(lowest is c for c in made[:early]):
                self._repair_into(lowest, ctx, add)
        # The planner's floor holds for the order all of them started from: every candidate carries the lowest.
        floor = min((c.floor_bytes for c in made if c.floor_bytes is not None), default=None)
        return [dataclasses.replace(c, floor_bytes=floor) for c in made]

    def _strategies(self, start: GraphIR, start_profile: MemoryProfile, ctx: PassContext,
                    ) -> Iterator[tuple[str, PassResult]]:
        """Each allowed strategy alone (continued by ``MIXED_AFTER`` when short), and cheap recomputation then
        swapping; as planner-named results whose reports list what was moved. A generator, so that each
        attempt's work is logged as its own."""
        assert self.planner is not None and ctx.target_bytes is not None
        link = self.planner.link
        passes: dict[str, Pass] = {"swap_activations": SwapActivations(link=link), "recompute": Recompute(),
                                   "place_persistent": PlacePersistent(link=link)}
        allowed = {"swap": "swap_activations", "recompute": "recompute", "place": "place_persistent"}
        kinds = [allowed[k] for k in self.planner.kinds if k in allowed]
        if ctx.host is None:
            kinds = [k for k in kinds if k == "recompute"]
        for kind in kinds:
            chain = [kind, *(k for k in MIXED_AFTER[kind] if k in kinds)] if ctx.host is not None else [kind]
            graph, reports = start, list[PassReport]()
            for name in chain:
                result = passes[name].run(graph, ctx)
                if not result.changed:
                    if name == kind:
                        break
                    continue
                graph, reports = result.graph, [*reports, result.report]
                if self._peak(graph, ctx) <= ctx.target_bytes:
                    break
            if reports:
                yield (", then ".join(r.name for r in reports) + (" alone" if len(reports) == 1 else ""),
                       self._as_planner(start, start_profile, graph, reports, ctx))
        if ctx.host is not None and {"swap_activations", "recompute"} <= set(kinds):
            swap_s_per_byte = 2 * copy_share(link) / link.link_bandwidth   # out and back
            cheap = Recompute(cost_device=link, max_s_per_byte=swap_s_per_byte).run(start, ctx)
            rest = SwapActivations(link=link).run(cheap.graph, ctx) if cheap.changed else cheap
            if cheap.changed and rest.changed:
                yield ("recompute where cheaper than copying, then swap_activations",
                       self._as_planner(start, start_profile, rest.graph, [cheap.report, rest.report], ctx))

    def _repair_into(self, lowest: Candidate, ctx: PassContext, add: Callable[[str, PassResult], None]) -> None:
        """``add`` ``lowest``'s greedy repair (``_repair``) as a candidate, if any strategy moved it."""
        repaired = self._repair(lowest, ctx)
        if repaired is not None:
            add(f"greedy repair of '{lowest.label}'", repaired)

    def _repair(self, lowest: Candidate, ctx: PassContext) -> PassResult | None:
        """``lowest``'s plan continued by each strategy in turn while it is over the target; None if none moved."""
        assert self.planner is not None and ctx.target_bytes is not None
        link = self.planner.link
        graph, reports = lowest.planned, list[PassReport]()
        for step in (PlacePersistent(link=link), SwapActivations(link=link), Recompute()):
            if self._peak(graph, ctx) <= ctx.target_bytes:
                break
            result = step.run(graph, ctx)
            if result.changed:
                graph, reports = result.graph, [*reports, result.report]
        if not reports:
            return None
        planner_report = next((r for r in lowest.reports if r.name == self.planner.name), None)
        chain = chained_report(reports)
        notes = (*(planner_report.notes if planner_report else ()), *chain.notes)
        return PassResult(graph, True, dataclasses.replace(chain, name=self.planner.name, notes=notes,
                                                           details={**(planner_report.details if planner_report
                                                                       else {}), **chain.details}))

    def _as_planner(self, start: GraphIR, start_profile: MemoryProfile, graph: GraphIR, reports: list[PassReport],
                    ctx: PassContext) -> PassResult:
        """A strategy's result reported under the planner's name, with its decisions (``strategy_report``)."""
        assert self.planner is not None and ctx.target_bytes is not None
        label = ", then ".join(r.name for r in reports)
        report = strategy_report(self.planner.name, start, graph, start_profile, ctx.simulate(graph),
                                 chained_report(reports) if len(reports) > 1 else reports[0], label,
                                 ctx.target_bytes, self.planner.link)
        return PassResult(graph, True, report)

    def _peak(self, graph: GraphIR, ctx: PassContext) -> int:
        """The peak of ``graph`` with the passes after the planner applied (how ``optimize`` runs it)."""
        finished, _ = run_pipeline(graph, self.suffix, ctx)
        return ctx.simulate(finished).peak_bytes

    def _candidate(self, label: str, ctx: PassContext, planned: GraphIR, reports: Sequence[PassReport],
                   started: float, sims: tuple[int, int], floor: int | None = None) -> Candidate:
        """A candidate from the planner's output: the passes after it applied, tags stripped, simulated; logged."""
        finished, suffix_reports = run_pipeline(planned, self.suffix, ctx)
        finished = strip_tags(finished)
        all_reports = (*reports, *suffix_reports)
        profile = ctx.simulate(finished) if any(r.changed for r in all_reports) else self.before
        candidate = Candidate(label, ctx.target_bytes, finished, all_reports, profile, planned, floor)
        target = ctx.target_bytes
        outcome = ("fits" if target is None or profile.peak_bytes <= target
                   else f"misses by {format_bytes(profile.peak_bytes - target)}")
        solver_calls = sum(int(r.details.get("solver_calls", 0)) for r in reports)  # type: ignore[call-overload]
        self._record(label, target, candidate, outcome, started, sims, solver_calls)
        return candidate

    def _record(self, label: str, target: int | None, candidate: Candidate, outcome: str, started: float,
                work: tuple[int, int], solver_calls: int) -> None:
        now = work_done()
        simulations, rewrites = now[0] - work[0], now[1] - work[1]
        self.log.simulations += simulations
        self.log.grappler_rewrites += rewrites
        self.log.solver_calls += solver_calls
        attempt = Attempt(label, target, candidate.peak_bytes, candidate.estimated_step_s, outcome,
                          time.perf_counter() - started, simulations, rewrites, solver_calls)
        self.log.attempts.append(attempt)
        _log.info("%s", attempt.line())
