"""The planner: one target in, one plan out -- keep, swap, recompute or host-place each candidate.

The planner works on the graph after ``partition`` and ``limit_parallelism`` (a fixed order). From one
simulation it lists the *options* that could free device memory: swap an activation to the host over one of
its longest idle gaps (the copy back started early enough to hide it, or just before its reader), recompute it
over one of them from tensors that stay alive anyway, or keep a variable group on the host.
Each option frees some bytes over some stretch of simulated time and costs some step time (cost model:
exposed transfer, recomputation; ``passes.plan_options``); a covering program picks the options of least total
cost that free enough at every moment over the target (``passes.plan_cover``).

The solver starts from the greedy heuristic's plan (least cost per byte of excess removed, then redundant picks
dropped, then each pick left out in turn where that covers for less) and has a time limit, shortened as the
planner's own deadline nears (``Planner.deadline_s``); when it runs out, or the model is too large to solve in
time (``SOLVER_MAX_PAIRS``), the heuristic plan is used and the report says so. The chosen plan is applied and
re-simulated: options interact (a swap-in lands while another tensor is back), so if the peak is still over the
target the excess is added to the requirement and the plan is solved again, a few times; what is still over is
then planned on the applied plan's own simulation (swaps and recomputations only) while the peak falls; if it
is still over, the same is done with the longest gaps and hidden copies alone, and the lower plan kept. Every
plan is judged with its copies to host fenced (``passes.fence_transfers``), as ``optimize`` runs it. A plan that
fits is compared with each strategy alone (on graphs of up to ``COMPARE_SINGLE_MAX_OPS`` ops) and with a greedy
mix that recomputes only what costs less than copying it out and back, then swaps the rest; the quickest by the
simulator's step estimate is kept. If the target stays out of reach, each strategy is tried alone (its
greedy pass re-simulates after every step, so it sees interactions the model misses; one that falls short is
continued by the other, so recomputation takes what is cheap and swapping the rest) and the fitting one of least
estimated step time is kept; failing that, every option is taken at once and the dearest given back while the
plan still fits (``Planner._everything_then_thin``); failing that too, the planner retries with the large device
ops chained one after another (their working sets then never add up), and finally repairs the best plan
greedily, re-simulating after each step.

The report's ``reachable_floor_bytes`` is the lowest peak any plan of these moves could reach on the order
given (``Planner.floor``); ``tfmem.optimize`` mentions it when it refuses a budget (its lower bound is the
proven one of ``tfmem.sim.bounds``).

Requires: a target, ``ctx.target_bytes`` (without one it leaves the graph alone). Ensures: the same values are computed.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from passes.fence_transfers import FenceTransfers
from passes.place_persistent import (
    PlacePersistent,
)
from passes.plan_cover import (
    Option,
    PlanResult,
    copy_share,
    freed_byte_seconds,
    reachable_floor,
    solve_cover,
)
from passes.plan_options import apply_options, build_options, idle_windows
from passes.plan_report import chained_report, solved_report, strategy_report
from passes.recompute import Recompute
from passes.serialize_scratch import serialize_large_ops
from passes.swap_activations import SwapActivations
from passes.timeline import StepTimeline
from tfmem.ir.graph import GraphIR
from tfmem.pipeline import Pass, PassContext, PassReport, PassResult
from tfmem.sim import costmodel
from tfmem.sim.profile import MemoryProfile

# Up to this many ops, a plan that fits is also compared with each single strategy's (each re-simulates the graph
# after every step it takes: seconds on graphs this size, minutes on 20,000 ops).
COMPARE_SINGLE_MAX_OPS = 10000
# Simulations and seconds that ``Planner._everything_then_thin`` spends giving options back (batches halve on
# each miss; a simulation of a large graph costs seconds: experiments/results/optimize_speed.md).
THIN_SIMULATIONS = 12
THIN_S = 20.0
# A strategy that frees memory but not enough is continued by these, in turn, until the plan fits: after host
# placement what is over is activations (tests/test_planner.py, host placement continued by swapping).
MIXED_AFTER = {"recompute": ("swap",), "swap": ("recompute",), "place": ("swap", "recompute")}


# A plan made by strategies applied greedily: estimated step, label, graph, its simulation, the passes' report.
_StrategyPlan = tuple[float, str, GraphIR, MemoryProfile, PassReport]


@dataclass(frozen=True)
class Planner:
    """Meet ``ctx.target_bytes`` at the least estimated step time (see the module docstring)."""

    name: ClassVar[str] = "planner"
    budget_independent: ClassVar[bool] = False
    peak_non_increasing: ClassVar[bool] = False
    time_limit_s: float = 20.0       # CBC's time over all rounds; the greedy plan is used when it runs out
    # The planner's wall time after which CBC is not asked (the greedy plans stand); CBC gets half of what is left,
    # as building the model comes on top of its limit (experiments/results/planner_large_graph.md).
    deadline_s: float = 25.0
    rounds: int = 4
    use_solver: bool = True
    kinds: tuple[str, ...] = ("swap", "recompute", "place")
    # A tensor may leave at any of its this many longest idle gaps, and a swapped one may also come back just before
    # its reader, so copies back need not land beside a large op (tests/test_planner.py, swap options at several gaps).
    gaps: int = 3
    just_in_time: bool = True
    link: costmodel.DeviceSpec = field(default=costmodel.DEFAULT_DEVICE)

    def run(self, graph: GraphIR, ctx: PassContext) -> PassResult:
        target_bytes = ctx.target_bytes
        if target_bytes is None:
            return PassResult(graph, False, PassReport.empty(self.name, "no budget: nothing to plan"))
        profile = ctx.simulate(graph)
        if profile.peak_bytes <= target_bytes:
            return PassResult(graph, False, PassReport.empty(self.name, "already within the budget"))
        started = time.perf_counter()
        deadline = started + self.deadline_s
        attempts = [("as ordered", graph, profile)]
        best: tuple[GraphIR, MemoryProfile, list[PlanResult], str] | None = None
        floors: list[int] = []   # per order tried, the lowest peak its options could reach
        single_report: PassReport | None = None   # when a strategy alone made the plan: its pass's report
        solved: list[PlanResult] = []
        for label, start, start_profile in attempts:
            new, new_profile, plans, floor = self._plan_richer_then_plain(start, start_profile, ctx, deadline)
            floors.append(floor)
            solved = solved or plans
            if best is None or new_profile.peak_bytes < best[1].peak_bytes:
                best, single_report = (new, new_profile, plans, label), None
            if new_profile.peak_bytes <= target_bytes:
                if label == "as ordered" and len(graph) <= COMPARE_SINGLE_MAX_OPS:
                    # The covering model charges each option alone; a single strategy applied greedily may still
                    # be quicker as a whole (experiments/results/planner_strategies.md compares them). Keep
                    # whichever the simulator says is quicker.
                    single = self.single_strategies(graph, ctx, target_bytes)
                    if single is not None and single[1].estimated_step_s < new_profile.estimated_step_s:
                        best = (single[0], single[1], [],
                                single[3].split(":")[0] + ": quicker than the solved plan "
                                f"({single[1].estimated_step_s * 1e3:.1f} vs "
                                f"{new_profile.estimated_step_s * 1e3:.1f} ms estimated)")
                        single_report = single[4]
                break
            if label == "as ordered":
                # The covering model missed something (an option it does not list, or an interaction): a single
                # strategy, applied greedily and re-simulated at every step, may still fit without giving up
                # parallelism, where the serialised plan below is slower.
                single = self.single_strategies(graph, ctx, target_bytes)
                if single is not None:
                    best, single_report = single[:4], single[4]
                    break
                everything = self._everything_then_thin(graph, ctx, profile, target_bytes)
                if everything is not None and everything[1].peak_bytes < best[1].peak_bytes:
                    best, single_report = everything, None
                    if everything[1].peak_bytes <= target_bytes:
                        break
                # serialise: ops that run side by side hold their working sets together
                serial = serialize_large_ops(graph, ctx)
                attempts.append(("large ops one at a time", serial, ctx.simulate(serial)))
        assert best is not None
        if best[1].peak_bytes > target_bytes:  # the model missed interactions: repair greedily, re-simulating each step
            repaired = best[0]
            for step in (PlacePersistent(link=self.link), SwapActivations(link=self.link), Recompute()):
                if ctx.simulate(repaired).peak_bytes <= target_bytes:
                    break
                repaired = step.run(repaired, ctx).graph
            repaired_profile = ctx.simulate(repaired)
            if repaired_profile.peak_bytes < best[1].peak_bytes:
                best = (repaired, repaired_profile, best[2], best[3] + ", then greedy repair")
        new, new_profile, plans, label = best
        chosen = plans[-1].chosen if plans else ()
        # The floor is a model's answer; a plan that went lower (a greedy pass's option the model does not list)
        # is the better witness of what is reachable.
        floor = min(min(floors), new_profile.peak_bytes)
        if not chosen and new is graph:
            report = PassReport.empty(self.name, "no option frees memory at the peak")
            report.details["reachable_floor_bytes"] = floor
            return PassResult(graph, False, report)
        if single_report is not None:
            report = strategy_report(self.name, graph, new, profile, new_profile, single_report, solved, label,
                                    target_bytes, self.link)
        else:
            report = solved_report(self.name, graph, new, profile, new_profile, plans, label, target_bytes)
        report.details["planner_s"] = time.perf_counter() - started
        report.details["reachable_floor_bytes"] = floor
        return PassResult(new, True, report)

    def single_strategies(self, graph: GraphIR, ctx: PassContext, target_bytes: int,
                          ) -> tuple[GraphIR, MemoryProfile, list[PlanResult], str, PassReport] | None:
        """Each allowed strategy alone on ``graph``; of those that fit, the one of least estimated step time,
        with its pass's report (what it moved); None when none fits.

        A strategy that freed memory but not enough is continued by the ones ``MIXED_AFTER`` names, in turn,
        until the plan fits (swap then recompute, or the reverse; host placement, then swapping, then
        recomputing): a greedy mix that can fit where no strategy does alone, and copy less than swapping alone.
        """
        passes: dict[str, Pass] = {"swap": SwapActivations(link=self.link), "recompute": Recompute(),
                  "place": PlacePersistent(link=self.link)}
        made: list[_StrategyPlan] = []
        for kind in self.kinds:
            if kind != "recompute" and ctx.host is None:
                continue
            result = passes[kind].run(graph, ctx)
            if not result.changed:
                continue
            new = fenced(result.graph, ctx)
            prof = ctx.simulate(new)
            label = f"{passes[kind].name} alone"
            if prof.peak_bytes > target_bytes and ctx.host is not None:
                chain, names = [result.report], [passes[kind].name]
                for then in (t for t in MIXED_AFTER.get(kind, ()) if t in self.kinds):
                    more = passes[then].run(result.graph, ctx)
                    if not more.changed:
                        continue
                    chain.append(more.report)
                    names.append(passes[then].name)
                    new = fenced(more.graph, ctx)
                    prof = ctx.simulate(new)
                    result = PassResult(more.graph, True, chained_report(chain))
                    if prof.peak_bytes <= target_bytes:
                        break
                label = ", then ".join(names) if len(names) > 1 else label
            made.append((prof.estimated_step_s, label, new, prof, result.report))
        cheap = self._cheap_recompute_then_swap(graph, ctx, target_bytes)
        if cheap is not None:
            made.append(cheap)
        fitting = [m for m in made if m[3].peak_bytes <= target_bytes]
        if not fitting:
            return None
        _, label, new, prof, report = min(fitting, key=lambda f: (f[0], f[1]))
        return new, prof, [], f"{label}: the covering model found no plan that fits", report

    def _everything_then_thin(self, graph: GraphIR, ctx: PassContext, profile: MemoryProfile, target_bytes: int,
                              ) -> tuple[GraphIR, MemoryProfile, list[PlanResult], str] | None:
        """Every option at once (per tensor, the one freeing the most bytes for the longest), then as many of the
        dearest per byte freed dropped again as the budget allows; None when there is no option.

        The covering model and the greedy passes add options a few at a time, judged on a simulation that
        each one changes; from the other end, nothing is assumed about the options' interactions: every
        candidate is off the device, and an option is given back only when the re-simulated plan still fits
        (``tests/test_planner.py::test_every_option_at_once_then_thinned_fits_and_keeps_the_values``).
        Options are given back in halving batches, for at most ``THIN_SIMULATIONS`` simulations or ``THIN_S``.
        """
        deadline = time.perf_counter() + THIN_S
        timeline = StepTimeline.build(graph, ctx.fetches, profile, ctx.feed_shapes)
        widest: dict[str, Option] = {}
        for o in self.options(graph, ctx, timeline, profile):
            if o.key not in widest or freed_byte_seconds(o) > freed_byte_seconds(widest[o.key]):
                widest[o.key] = o
        if not widest:
            return None
        kept = sorted(widest.values(), key=lambda o: o.cost_s / max(freed_byte_seconds(o), 1e-12))   # cheapest per byte first

        def judge(chosen: list[Option]) -> tuple[GraphIR, MemoryProfile]:
            new = fenced(apply_options(graph, chosen, timeline, ctx.host, self.link), ctx)
            return new, ctx.simulate(new)

        best = judge(kept)
        batch = len(kept) // 2
        for _ in range(THIN_SIMULATIONS):
            if best[1].peak_bytes > target_bytes or batch == 0 or time.perf_counter() > deadline:
                break
            trial = judge(kept[:-batch])
            if trial[1].peak_bytes <= target_bytes:
                kept, best = kept[:-batch], trial
                batch = min(batch, len(kept) // 2)
            else:
                batch //= 2
        cost = sum(o.cost_s for o in kept)
        plan = PlanResult(tuple(kept), "heuristic", 0.0, cost, cost)
        return (*best, [plan], f"every option at once, then the dearest given back ({len(widest) - len(kept)} "
                f"of {len(widest)})")

    def _cheap_recompute_then_swap(self, graph: GraphIR, ctx: PassContext, target_bytes: int) -> _StrategyPlan | None:
        """Recompute only what costs less than copying it out and back, then swap what is still over ``budget``;
        as a ``single_strategies`` candidate (None when either frees nothing).

        Recomputing alone takes the dearest tensors too once the cheap ones run out, and swapping alone copies
        tensors a few elementwise ops rebuild for less; the greedy mix in between is what a per-tensor choice
        would make when no tensor's choice changes another's cost.
        """
        if ctx.host is None or not {"recompute", "swap"} <= set(self.kinds):
            return None
        swap_s_per_byte = 2 * copy_share(self.link) / self.link.link_bandwidth  # out and back
        cheap = Recompute(cost_device=self.link, max_s_per_byte=swap_s_per_byte).run(graph, ctx)
        if not cheap.changed:
            return None
        rest = SwapActivations(link=self.link).run(cheap.graph, ctx)
        if not rest.changed:
            return None
        new = fenced(rest.graph, ctx)
        prof = ctx.simulate(new)
        return (prof.estimated_step_s, "recompute where cheaper than copying, then swap_activations", new, prof,
                chained_report([cheap.report, rest.report]))

    def _solver_time(self, plans: list[PlanResult], deadline: float) -> float:
        """CBC's time for the next solve: what is left of ``time_limit_s`` over all rounds, and half of what is
        left before the deadline (``solve`` skips CBC under a second)."""
        return min(self.time_limit_s - sum(p.solve_s for p in plans), (deadline - time.perf_counter()) / 2)

    def _plan_richer_then_plain(self, graph: GraphIR, profile: MemoryProfile, ctx: PassContext,
                                deadline: float = float("inf")) -> tuple[GraphIR, MemoryProfile, list[PlanResult], int]:
        """``_plan``; where its plan misses the budget, also the plan of the longest gaps and hidden copies alone
        (``gaps=1``, no ``just_in_time``), and the lower of the two.

        More options let the covering model reach further, but it charges each option alone, and a plan of
        the plainer options can land lower once applied. Graphs of up to ``COMPARE_SINGLE_MAX_OPS`` ops only: a
        second plan of a 20,000-op graph would cost the planner's deadline.
        """
        found = self._plan(graph, profile, ctx, deadline)
        target_bytes = ctx.target_bytes or 0
        if found[1].peak_bytes <= target_bytes or len(graph) > COMPARE_SINGLE_MAX_OPS or (
                self.gaps == 1 and not self.just_in_time):
            return found
        plain = dataclasses.replace(self, gaps=1, just_in_time=False)._plan(graph, profile, ctx, deadline)
        best = plain if plain[1].peak_bytes < found[1].peak_bytes else found
        return (*best[:3], min(found[3], plain[3]))

    def _plan(self, graph: GraphIR, profile: MemoryProfile, ctx: PassContext, deadline: float = float("inf"),
              ) -> tuple[GraphIR, MemoryProfile, list[PlanResult], int]:
        """Solve, apply and re-simulate; also the lowest peak these options could reach on this order."""
        target_bytes = ctx.target_bytes or 0
        timeline = StepTimeline.build(graph, ctx.fetches, profile, ctx.feed_shapes)
        options = self.options(graph, ctx, timeline, profile)
        floor = self.floor(graph, ctx)
        plans: list[PlanResult] = []
        best_graph, best_profile, best_round = graph, profile, -1
        extra = 0
        for _ in range(self.rounds):
            plan = self.solve(options, profile, target_bytes - extra, time_limit_s=self._solver_time(plans, deadline))
            plans.append(plan)
            if plan.status == "infeasible" and not plan.chosen:
                break
            new = fenced(apply_options(graph, plan.chosen, timeline, ctx.host, self.link), ctx)
            new_profile = ctx.simulate(new)
            if new_profile.peak_bytes < best_profile.peak_bytes:
                best_graph, best_profile, best_round = new, new_profile, len(plans) - 1
            if new_profile.peak_bytes <= target_bytes or plan.status == "infeasible":
                break
            extra += new_profile.peak_bytes - target_bytes   # interactions the model missed: ask for more
        if 0 <= best_round < len(plans) - 1:  # the report describes the plan applied: put it last
            plans.append(plans.pop(best_round))
        if best_round >= 0 and best_profile.peak_bytes > target_bytes:
            best_graph, best_profile, plans = self._follow_up(best_graph, best_profile, plans, ctx, deadline)
        return best_graph, best_profile, plans, floor

    def _follow_up(self, graph: GraphIR, profile: MemoryProfile, plans: list[PlanResult], ctx: PassContext,
                   deadline: float = float("inf")) -> tuple[GraphIR, MemoryProfile, list[PlanResult]]:
        """Plan what is still over the budget on the applied plan's own simulation, while the peak falls.

        Asking the first model for more only re-solves what it could see; a swap-in that lands while another
        tensor is back, or a tensor whose readers moved, is visible only in the applied graph.
        Host placement is not offered again: it is applied first, before swaps and recomputations.
        """
        target_bytes = ctx.target_bytes or 0
        kinds = tuple(k for k in self.kinds if k != "place")
        for _ in range(self.rounds):
            timeline = StepTimeline.build(graph, ctx.fetches, profile, ctx.feed_shapes)
            options = dataclasses.replace(self, kinds=kinds).options(graph, ctx, timeline, profile)
            plan = self.solve(options, profile, target_bytes, time_limit_s=self._solver_time(plans, deadline))
            if not plan.chosen:
                break
            new = fenced(apply_options(graph, plan.chosen, timeline, ctx.host, self.link), ctx)
            new_profile = ctx.simulate(new)
            if new_profile.peak_bytes >= profile.peak_bytes:
                break
            first = plans[-1]
            plans[-1] = PlanResult(first.chosen + plan.chosen, first.status, first.solve_s + plan.solve_s,
                                   first.objective_s + plan.objective_s,
                                   first.heuristic_objective_s + plan.heuristic_objective_s, first.follow_ups + 1)
            graph, profile = new, new_profile
            if profile.peak_bytes <= target_bytes:
                break
        return graph, profile, plans

    def floor(self, graph: GraphIR, ctx: PassContext) -> int:
        """The lowest peak a plan of these moves could reach on ``graph``'s order (see ``reachable_floor``).

        Taken on the one-thread schedule: with more threads, ops that happen to run side by side add their
        working sets, and a plan that delays one of them would go below a floor taken there.
        """
        profile = ctx.simulate(graph, inter_op_threads=1)
        timeline = StepTimeline.build(graph, ctx.fetches, profile, ctx.feed_shapes)
        idle = idle_windows(graph, ctx, timeline, SwapActivations().min_bytes) if ctx.host is not None else []
        return reachable_floor(profile, self.options(graph, ctx, timeline, profile), idle)[0]

    def options(self, graph: GraphIR, ctx: PassContext, timeline: StepTimeline, profile: MemoryProfile) -> list[Option]:
        """Every swap, recompute and placement the planner may choose, with its savings and cost."""
        return build_options(graph, ctx, timeline, profile, self.kinds, self.gaps, self.just_in_time, self.link)

    def solve(self, options: Sequence[Option], profile: MemoryProfile, target_bytes: int,
              time_limit_s: float | None = None) -> PlanResult:
        """Choose options that cover every over-target moment of ``profile`` at the least cost."""
        return solve_cover(options, profile, target_bytes, self.time_limit_s if time_limit_s is None else time_limit_s,
                           use_solver=self.use_solver)


def fenced(graph: GraphIR, ctx: PassContext) -> GraphIR:
    """``graph`` with its copies to host fenced, as ``optimize`` will run it (``passes.fence_transfers``).

    Plans are judged on the fenced graph: the fences' control edges change the order, and with it the peak
    (``tests/test_guarantee_rewrites.py::test_optimize_fences_after_the_plan``).
    """
    return FenceTransfers().run(graph, ctx).graph


