"""The planner: one target in, one plan out -- keep, swap, recompute or host-place each candidate.

The planner works on the graph after ``partition`` and ``limit_parallelism`` (a fixed order). From one
simulation it lists the *options* that could free device memory: swap an activation to the host over one of
its longest idle gaps (the copy back started early enough to hide it, or just before its reader), recompute it
over one of them from tensors that stay alive anyway, or keep a variable group on the host.
Each option frees some bytes over some stretch of simulated time and costs some step time (cost model:
exposed transfer, recomputation; ``passes.plan_options``); a covering program picks the options of least total
cost that free enough at every moment over the target (``passes.plan_cover``: CBC from the greedy heuristic's
plan, for at most ``solver_nodes`` branch-and-bound nodes, so the same model gives the same plan anywhere).

The chosen plan is applied and re-simulated: options interact (a swap-in lands while another tensor is back), so
if the peak is still over the target the excess is added to the requirement and the model solved again, up to
``rounds`` times; what is still over is then planned on the applied plan's own simulation (swaps and
recomputations only) while the peak falls. Every plan is judged with its copies to host fenced
(``passes.fence_transfers``), as ``optimize`` runs it. The pass does not search further: the other plans
``optimize`` compares (each strategy alone, every option then thinned, ...) are the budget search's
(``tfmem.search``).

The report's ``reachable_floor_bytes`` is the lowest peak any plan of these moves could reach on the order
given (``Planner.floor``); ``tfmem.optimize`` mentions it when it refuses a budget (its lower bound is the
proven one of ``tfmem.sim.bounds``).

Requires: a target, ``ctx.target_bytes`` (without one it leaves the graph alone). Ensures: the same values are computed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from passes.fence_transfers import FenceTransfers
from passes.plan_cover import (
    SOLVER_NODES,
    Option,
    PlanResult,
    freed_byte_seconds,
    reachable_floor,
    solve_cover,
)
from passes.plan_options import apply_options, build_options, idle_windows
from passes.plan_report import solved_report
from passes.swap_activations import SwapActivations
from passes.timeline import StepTimeline
from tfmem.ir.graph import GraphIR
from tfmem.pipeline import PassContext, PassReport, PassResult
from tfmem.sim import costmodel
from tfmem.sim.profile import MemoryProfile

# Simulations that ``Planner.everything_then_thin`` spends giving options back (batches halve on each miss).
THIN_SIMULATIONS = 12


@dataclass(frozen=True)
class Planner:
    """Meet ``ctx.target_bytes`` at the least estimated step time (see the module docstring)."""

    name: ClassVar[str] = "planner"
    budget_independent: ClassVar[bool] = False
    peak_non_increasing: ClassVar[bool] = False
    # CBC's branch-and-bound nodes per solve: a count, so the plan does not depend on the machine or its load;
    # the greedy plan it starts from stands where no better one is found within them.
    solver_nodes: int = SOLVER_NODES
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
        new, new_profile, plans, floor = self._plan(graph, profile, ctx)
        # The floor is a model's answer; a plan that went lower is the better witness of what is reachable.
        floor = min(floor, new_profile.peak_bytes)
        if new is graph:
            report = PassReport.empty(self.name, "no option frees memory at the peak")
            report.details.update(reachable_floor_bytes=floor, solver_calls=plans[-1].solver_calls if plans else 0)
            return PassResult(graph, False, report)
        report = solved_report(self.name, graph, new, profile, new_profile, plans, "as ordered", target_bytes)
        report.details["reachable_floor_bytes"] = floor
        return PassResult(new, True, report)

    def everything_then_thin(self, graph: GraphIR, ctx: PassContext) -> PassResult | None:
        """Every option at once (per tensor, the one freeing the most bytes for the longest), then as many of the
        dearest per byte freed given back as the target allows; None when there is no option.

        The covering model and the greedy passes add options a few at a time, judged on a simulation that
        each one changes; from the other end, nothing is assumed about the options' interactions: every
        candidate is off the device, and an option is given back only when the re-simulated plan still fits
        (``tests/test_planner.py::test_every_option_at_once_then_thinned_fits_and_keeps_the_values``).
        Options are given back in halving batches, for at most ``THIN_SIMULATIONS`` simulations.
        """
        target_bytes = ctx.target_bytes
        if target_bytes is None:
            return None
        profile = ctx.simulate(graph)
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
            if best[1].peak_bytes > target_bytes or batch == 0:
                break
            trial = judge(kept[:-batch])
            if trial[1].peak_bytes <= target_bytes:
                kept, best = kept[:-batch], trial
                batch = min(batch, len(kept) // 2)
            else:
                batch //= 2
        cost = sum(o.cost_s for o in kept)
        plan = PlanResult(tuple(kept), "heuristic", 0.0, cost, cost)
        label = f"every option at once, then the dearest given back ({len(widest) - len(kept)} of {len(widest)})"
        return PassResult(best[0], True, solved_report(self.name, graph, best[0], profile, best[1], [plan], label,
                                                      target_bytes))

    def _plan(self, graph: GraphIR, profile: MemoryProfile, ctx: PassContext,
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
            plan = self.solve(options, profile, target_bytes - extra)
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
        calls = sum(p.solver_calls for p in plans)
        if best_round >= 0 and best_profile.peak_bytes > target_bytes:
            best_graph, best_profile, plans, more = self._follow_up(best_graph, best_profile, plans, ctx)
            calls += more
        if plans:   # the last plan is the one the report describes: it carries the count of every CBC run
            plans[-1] = dataclasses.replace(plans[-1], solver_calls=calls)
        return best_graph, best_profile, plans, floor

    def _follow_up(self, graph: GraphIR, profile: MemoryProfile, plans: list[PlanResult], ctx: PassContext,
                   ) -> tuple[GraphIR, MemoryProfile, list[PlanResult], int]:
        """Plan what is still over the budget on the applied plan's own simulation, while the peak falls; also
        how many times CBC ran.

        Asking the first model for more only re-solves what it could see; a swap-in that lands while another
        tensor is back, or a tensor whose readers moved, is visible only in the applied graph.
        Host placement is not offered again: it is applied first, before swaps and recomputations.
        """
        target_bytes = ctx.target_bytes or 0
        kinds = tuple(k for k in self.kinds if k != "place")
        calls = 0
        for _ in range(self.rounds):
            timeline = StepTimeline.build(graph, ctx.fetches, profile, ctx.feed_shapes)
            options = dataclasses.replace(self, kinds=kinds).options(graph, ctx, timeline, profile)
            plan = self.solve(options, profile, target_bytes)
            calls += plan.solver_calls
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
        return graph, profile, plans, calls

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

    def solve(self, options: Sequence[Option], profile: MemoryProfile, target_bytes: int) -> PlanResult:
        """Choose options that cover every over-target moment of ``profile`` at the least cost."""
        return solve_cover(options, profile, target_bytes, self.solver_nodes, use_solver=self.use_solver)


def fenced(graph: GraphIR, ctx: PassContext) -> GraphIR:
    """``graph`` with its copies to host fenced, as ``optimize`` will run it (``passes.fence_transfers``).

    Plans are judged on the fenced graph: the fences' control edges change the order, and with it the peak
    (``tests/test_guarantee_rewrites.py::test_optimize_fences_after_the_plan``).
    """
    return FenceTransfers().run(graph, ctx).graph


