"""The budget planner: one budget in, one plan out -- keep, swap, recompute or host-place each candidate.

The planner works on the graph after ``partition`` and ``limit_parallelism`` (a fixed order). From one
simulation it lists the *options* that could free device memory: swap an activation to the host over one of
its longest idle gaps (the copy back started early enough to hide it, or just before its reader), recompute it
over one of them from tensors that stay alive anyway, or keep a variable group on the host.
Each option frees some bytes over some stretch of simulated time and costs some step time (cost model:
exposed transfer, recomputation). Every stretch of the step where the simulated memory is over the budget
becomes a covering constraint, and a mixed-integer program (PuLP with its bundled CBC solver) picks the
options of least total cost that cover them all:

    minimise    sum_o cost_o * x_o
    subject to  sum_o saving_o(segment) * x_o >= excess(segment)   for every over-budget segment
                sum of x_o over the options of tensor t <= 1          for every tensor t
                x_o in {0, 1}

The solver starts from the greedy heuristic's plan (least cost per byte of excess removed, then redundant picks
dropped, then each pick left out in turn where that covers for less) and has a time limit, shortened as the
planner's own deadline nears (``Planner.deadline_s``); when it runs out, or the model is too large to solve in
time (``SOLVER_MAX_PAIRS``), the heuristic plan is used and the report says so. The chosen plan is applied and
re-simulated: options interact (a swap-in lands while another tensor is back), so if the peak is still over the
budget the excess is added to the requirement and the plan is solved again, a few times; what is still over is
then planned on the applied plan's own simulation (swaps and recomputations only) while the peak falls; if it
is still over, the same is done with the longest gaps and hidden copies alone, and the lower plan kept. Every
plan is judged with its copies to host fenced (``passes.fence_transfers``), as ``optimize`` runs it. A plan that
fits is compared with each strategy alone (on graphs of up to ``COMPARE_SINGLE_MAX_OPS`` ops) and with a greedy
mix that recomputes only what costs less than copying it out and back, then swaps the rest; the quickest by the
simulator's step estimate is kept. If the budget stays out of reach, each strategy is tried alone (its
greedy pass re-simulates after every step, so it sees interactions the model misses; one that falls short is
continued by the other, so recomputation takes what is cheap and swapping the rest) and the fitting one of least
estimated step time is kept; failing that, every option is taken at once and the dearest given back while the
plan still fits (``Planner._everything_then_thin``); failing that too, the planner retries with the large device
ops chained one after another (their working sets then never add up), and finally repairs the best plan
greedily, re-simulating after each step.

The report's ``reachable_floor_bytes`` is the lowest peak any plan of these moves could reach on the order
given (``Planner.floor``); ``tfmem.optimize`` mentions it when it refuses a budget (its lower bound is the
proven one of ``tfmem.sim.bounds``).

Requires: a budget (without one it leaves the graph alone). Ensures: the same values are computed.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import pulp

from passes.fence_transfers import FenceTransfers
from passes.place_persistent import (
    PersistentGroup,
    PlacePersistent,
    chain_to_host,
    persistent_groups,
    place_groups,
    plan_group_prefetches,
)
from passes.recompute import Recompute, RecomputePlan, apply_recompute
from passes.swap_activations import SwapActivations, SwapCandidate, apply_swaps, device_activations
from passes.timeline import StepTimeline
from passes.transfer import readers_through_aliases, trigger_candidates
from tfmem.ir.devices import Placement
from tfmem.ir.editor import GraphEditor
from tfmem.ir.graph import GraphIR
from tfmem.ir.ops import ALIAS_OPS, PERSISTENT_OUTPUT_OPS, VARIABLE_READ_OPS
from tfmem.pipeline import PassContext, PassReport, PassResult
from tfmem.sim import costmodel
from tfmem.sim.memsim import MemoryProfile
from tfmem.sim.opmemory import allocated_bytes
from tfmem.units import format_bytes

# Swapped bytes also cost CPU time to copy even when the transfer overlaps compute: at least this share of the
# transfer time is charged as overhead, more where the link keeps the cores busy (``copy_share``).
TRANSFER_OVERHEAD_SHARE = 0.25


def copy_share(link: costmodel.DeviceSpec) -> float:
    """Share of a copy's link time charged as step time besides its exposed part (the testbed's gRPC: all)."""
    return max(TRANSFER_OVERHEAD_SHARE, link.transfer_cpu_share)


# Above this many (option, over-budget segment) pairs CBC is not asked: writing, reading and presolving the model
# alone outlast the planner's deadline (a 20,017-op MLP: 3.2 million pairs, 17.1 s in CBC for an 11.6 s limit;
# its plan then missed and the next round's greedy one was kept), and the greedy plan is used.
SOLVER_MAX_PAIRS = 1_000_000
# Up to this many ops, a plan that fits is also compared with each single strategy's (each re-simulates the graph
# after every step it takes: seconds on graphs this size, minutes on 20,000 ops).
COMPARE_SINGLE_MAX_OPS = 10000
# Simulations and seconds that ``Planner._everything_then_thin`` spends giving options back (batches halve on
# each miss; one simulation of a 7,000-op MoE plan takes about 2 s here).
THIN_SIMULATIONS = 12
THIN_S = 20.0
# Ops that allocate nothing of their own (views, reads of variables): chaining them orders nothing useful.
UNCHAINED_OPS = ALIAS_OPS | VARIABLE_READ_OPS | PERSISTENT_OUTPUT_OPS
# A single strategy that frees memory but not enough is continued by these, in turn, until the plan fits
# (``single_strategies``). Placing persistent tensors on the host frees the same bytes at every op, so what is
# still over is activations: swap, then recompute (a WGAN-GP at a 20 MiB target: 16.95 MiB this way, where the
# covering model's plans reached 20.7 MiB at best).
MIXED_AFTER = {"recompute": ("swap",), "swap": ("recompute",), "place": ("swap", "recompute")}


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
    status: str          # "optimal", "heuristic (solver timed out | no solver time left | model too large for the
    #                      solver)", "heuristic" (no solver asked for), "infeasible"
    solve_s: float
    objective_s: float
    heuristic_objective_s: float
    follow_ups: int = 0   # rounds planned on the applied plan's simulation (``Planner._follow_up``)


# A plan made by strategies applied greedily: estimated step, label, graph, its simulation, the passes' report.
_StrategyPlan = tuple[float, str, GraphIR, MemoryProfile, PassReport]


@dataclass(frozen=True)
class Planner:
    """Meet ``ctx.target_bytes`` at the least estimated step time (see the module docstring)."""

    name: ClassVar[str] = "planner"
    budget_independent: ClassVar[bool] = False
    time_limit_s: float = 20.0       # CBC's time over all rounds; the greedy plan is used when it runs out
    # The planner's own wall time after which CBC is no longer asked (the greedy plans stand). CBC gets half of
    # what is left (``_solver_time``): writing, reading and presolving the model come on top of its time limit
    # (measured on a 20,000-op graph: 29 s for a solve limited to 20 s; optimize then took 62 s).
    deadline_s: float = 25.0
    rounds: int = 4
    use_solver: bool = True
    kinds: tuple[str, ...] = ("swap", "recompute", "place")
    # Each tensor may leave at any of its this many longest idle gaps (one option each, at most one chosen), and
    # a swapped one may come back just in time, after the op before its reader, as well as early enough to hide
    # the copy. With the longest gap and hidden copies alone, ResNet-20 (momentum) had no cover under 45 MiB
    # (its copies back landed while a 23.75 MiB-scratch convolution ran; best plan 56.35 MiB), where every
    # gap's swap taken at once leaves 38.4 MiB; with both, 46.4 MiB.
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
                    # be quicker as a whole (measured: swapping alone ran an unrolled RNN at 205 ms a step
                    # where a combined plan took 308 ms). Keep whichever the simulator says is quicker.
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
                # parallelism. Measured: on an unrolled RNN swapping alone fit at 205 ms a step where the
                # serialised plan below took 308 ms.
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
            report = _single_report(self.name, graph, new, profile, new_profile, single_report, solved, label,
                                    target_bytes, self.link)
        else:
            report = _report(self.name, graph, new, profile, new_profile, plans, label, target_bytes)
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
        passes = {"swap": SwapActivations(link=self.link), "recompute": Recompute(),
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
                    result = PassResult(more.graph, True, _chained_report(chain))
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
        candidate is off the device, and an option is given back only when the re-simulated plan still fits.
        Measured: an MoE Transformer (16 experts) at an 8 MiB target, where the planner's plans stopped at
        22.8 MiB, all of its placements and swaps at once simulated at 9.2 MiB.
        Options are given back in halving batches, for at most ``THIN_SIMULATIONS`` simulations or ``THIN_S``.
        """
        deadline = time.perf_counter() + THIN_S
        timeline = StepTimeline.build(graph, ctx.fetches, profile, ctx.feed_shapes)
        widest: dict[str, Option] = {}
        for o in self.options(graph, ctx, timeline, profile):
            if o.key not in widest or _freed(o) > _freed(widest[o.key]):
                widest[o.key] = o
        if not widest:
            return None
        kept = sorted(widest.values(), key=lambda o: o.cost_s / max(_freed(o), 1e-12))   # cheapest per byte first

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
                _chained_report([cheap.report, rest.report]))

    def _solver_time(self, plans: list[PlanResult], deadline: float) -> float:
        """CBC's time for the next solve: what is left of ``time_limit_s`` over all rounds, and half of what is
        left before the deadline (``solve`` skips CBC under a second)."""
        return min(self.time_limit_s - sum(p.solve_s for p in plans), (deadline - time.perf_counter()) / 2)

    def _plan_richer_then_plain(self, graph: GraphIR, profile: MemoryProfile, ctx: PassContext,
                                deadline: float = float("inf")) -> tuple[GraphIR, MemoryProfile, list[PlanResult], int]:
        """``_plan``; where its plan misses the budget, also the plan of the longest gaps and hidden copies alone
        (``gaps=1``, no ``just_in_time``), and the lower of the two.

        More options let the covering model reach further, but it charges each option alone, and a plan of
        the plainer options can land lower once applied (measured: a residual conv net, 2 blocks of batch 8, at
        0.4x its peak: 28.5 MiB with the plainer options, 30.0 MiB with all). Graphs of up to
        ``COMPARE_SINGLE_MAX_OPS`` ops only: a second plan of a 20,000-op graph would cost the planner's deadline.
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
        tensor is back, or a tensor whose readers moved, is visible only in the applied graph (measured: an
        unrolled RNN whose first plan missed by 5.3 MiB, and whose model then had no cover for the rest).
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
        out: list[Option] = []
        makespan = max(timeline.end_s.values(), default=0.0)
        if "swap" in self.kinds and ctx.host is not None:
            swaps = SwapActivations(link=self.link).candidates_over_gaps(graph, ctx, timeline, self.gaps,
                                                                         self.just_in_time)
            for c in swaps:
                back = min(timeline.end_s[p.trigger] for p in c.prefetches if p.trigger)
                transfer = sum(p.transfer_s for p in c.prefetches) + self.link.transfer_s(c.nbytes)
                cost = sum(p.exposed_s for p in c.prefetches) + copy_share(self.link) * transfer
                out.append(Option("swap", str(c.tensor), c.nbytes, cost,
                                  ((c.idle_from_s, back, c.nbytes),), c))
        if "recompute" in self.kinds:
            for p in Recompute().candidates_over_gaps(graph, ctx, timeline, self.gaps):
                start = max([timeline.end_s[p.tensor.node]] + [timeline.end_s[c] for c in p.early_readers])
                back = min(timeline.end_s[trigger] for _, trigger in p.groups)
                out.append(Option("recompute", str(p.tensor), p.nbytes, p.total_s,
                                  ((start, back, p.nbytes),), p))
        if "place" in self.kinds and ctx.host is not None:
            usable = trigger_candidates(graph, timeline)
            placement = Placement(ctx.device, ctx.host)
            for g in persistent_groups(graph, timeline.eg, placement, PlacePersistent().min_bytes):
                reads, _ = plan_group_prefetches(graph, g, timeline, usable, self.link)
                windows = sorted(
                    (timeline.end_s[p.trigger] if p.trigger else 0.0, max(timeline.end_s[c] for c in p.consumers),
                     graph.spec(t).nbytes or 0)
                    for t, prefetches in reads for p in prefetches)
                savings = _minus_windows(g.nbytes, windows, makespan)
                transfer = sum(p.transfer_s for _, ps in reads for p in ps) + self.link.transfer_s(g.nbytes)
                cost = sum(p.exposed_s for _, ps in reads for p in ps) + copy_share(self.link) * transfer
                out.append(Option("place", ",".join(g.roots), g.nbytes, cost, savings, g))
        return out

    def solve(self, options: Sequence[Option], profile: MemoryProfile, target_bytes: int,
              time_limit_s: float | None = None) -> PlanResult:
        """Choose options that cover every over-budget moment of ``profile`` at the least cost."""
        time_limit_s = self.time_limit_s if time_limit_s is None else time_limit_s
        segments, excess = _over_budget_segments(profile, options, target_bytes)
        cover = _cover(options, segments)
        greedy = _greedy(options, cover, excess)
        heuristic_cost = sum(options[i].cost_s for i in greedy)
        feasible = all(sum(b for _, b in row) >= need for row, need in zip(cover, excess, strict=True))
        too_large = sum(len(row) for row in cover) > SOLVER_MAX_PAIRS
        if not self.use_solver or not excess or time_limit_s < 1.0 or too_large:
            status = "infeasible" if not feasible else (
                "heuristic" if not (self.use_solver and excess) else
                "heuristic (model too large for the solver)" if too_large else "heuristic (no solver time left)")
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
            solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, warmStart=True)
        started = time.perf_counter()
        problem.solve(solver)
        elapsed = time.perf_counter() - started
        status = pulp.LpStatus[problem.status]
        if status != "Optimal":  # CBC stopped at its time limit without proving optimality
            return PlanResult(tuple(options[i] for i in greedy), "heuristic (solver timed out)", elapsed,
                              heuristic_cost, heuristic_cost)
        picked = [i for i, var in enumerate(x) if (var.value() or 0) > 0.5]
        cost = sum(options[i].cost_s for i in picked)
        return PlanResult(tuple(options[i] for i in picked), "optimal", elapsed, cost, heuristic_cost)


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


def idle_windows(graph: GraphIR, ctx: PassContext, timeline: StepTimeline, min_bytes: int,
                 ) -> list[tuple[str, tuple[tuple[float, float, int], ...]]]:
    """Per swappable activation, every stretch between two of its uses: where some swap could free it.

    The planner's swap options split each tensor at one of its few longest idle gaps, while ``swap_activations``
    (its fallback) may split it elsewhere and swap a swapped-in copy again; a lower bound must allow all of it.
    """
    out = []
    for t in device_activations(graph, ctx, timeline, timeline.order, min_bytes):
        readers = sorted(readers_through_aliases(graph, timeline.eg, t), key=timeline.rank.__getitem__)
        nbytes = graph.spec(t).nbytes or 0
        busy_until, gaps = timeline.end_s[t.node], []
        for c in readers:
            if timeline.start_s[c] > busy_until:
                gaps.append((busy_until, timeline.start_s[c], nbytes))
            busy_until = max(busy_until, timeline.end_s[c])
        if gaps:
            out.append((str(t), tuple(gaps)))
    return out


def serialize_large_ops(graph: GraphIR, ctx: PassContext, min_bytes: int = 64 * 1024,
                        measure: Callable[[GraphIR, str], int] | None = None) -> GraphIR:
    """Chain the device ops that allocate ``min_bytes`` or more (outputs and scratch) in their one-thread order.

    Each waits for the previous one (a control edge, skipped where a data edge already orders them), so
    their working sets no longer add up when the executor has threads to spare. The order is the one-thread
    schedule, which is topological, so the edges cannot close a cycle. ``measure`` says what an op allocates
    (default ``allocated_bytes``).
    """
    measure = measure or allocated_bytes
    profile = ctx.simulate(graph, inter_op_threads=1)
    timeline = StepTimeline.build(graph, ctx.fetches, profile, ctx.feed_shapes)
    placement = Placement(ctx.device, ctx.host)
    big = [u for u in timeline.order if not timeline.eg.is_region(u)
           and placement.domain(graph[u].device) == "device"
           and measure(graph, u) >= min_bytes
           and graph[u].op not in UNCHAINED_OPS]
    editor = GraphEditor(graph)
    for previous, current in zip(big, big[1:], strict=False):
        if previous not in graph[current].predecessors:
            editor.add_control_inputs(current, [previous])
    return editor.finish()


def fenced(graph: GraphIR, ctx: PassContext) -> GraphIR:
    """``graph`` with its copies to host fenced, as ``optimize`` will run it (``passes.fence_transfers``).

    Plans are judged on the fenced graph: the fences' control edges change the order, and with it the peak
    (measured: an unrolled RNN's plan at 33.5 MiB peaked at 37.5 MiB once fenced, over its budget).
    """
    return FenceTransfers().run(graph, ctx).graph


def apply_options(graph: GraphIR, chosen: Sequence[Option], timeline: StepTimeline, host: str | None,
                  link: costmodel.DeviceSpec) -> GraphIR:
    """Apply host placements, then swaps, then recomputations (each on the previous result)."""
    groups = [o.payload for o in chosen if o.kind == "place"]
    swaps = [o.payload for o in chosen if o.kind == "swap"]
    recomputes = [o.payload for o in chosen if o.kind == "recompute"]
    if groups and host is not None:
        graph = place_groups(graph, groups, timeline, host, link)  # type: ignore[arg-type]
    if swaps and host is not None:
        graph = apply_swaps(graph, swaps, host)  # type: ignore[arg-type]
    if recomputes:
        graph = apply_recompute(graph, recomputes)  # type: ignore[arg-type]
    if groups and host is not None:  # last: its chain must respect every edge the others added
        graph = chain_to_host(graph, groups, timeline, host)  # type: ignore[arg-type]
    return graph


def _freed(option: Option) -> float:
    """Byte-seconds an option frees on the simulated step."""
    return sum((stop - start) * nbytes for start, stop, nbytes in option.savings)


def _minus_windows(nbytes: int, windows: list[tuple[float, float, int]], end: float) -> tuple[tuple[float, float, int], ...]:
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


def _greedy(options: Sequence[Option], cover: list[list[tuple[int, int]]], excess: list[int],
            time_limit_s: float = 2.0) -> list[int]:
    """The fallback plan: the cheapest of a greedy cover and its variants that each leave one of its picks out.

    The plain greedy (``_greedy_cover``) commits early to options that look cheap per byte; leaving each pick
    out in turn (costliest first) and covering again finds a cheaper plan where one exists nearby. The search
    repeats from any cheaper plan it finds, within ``time_limit_s``.

    Examples
    --------
    >>> opts = [Option("swap", t, n, cost, (), None) for t, n, cost in [("a", 4, 1.0), ("b", 4, 1.0), ("c", 8, 1.5)]]
    >>> _greedy(opts, cover=[[(0, 4), (2, 8)], [(1, 4), (2, 8)]], excess=[4, 4])   # c covers both at once
    [2]
    """
    by_option = _option_arrays(cover)
    need = np.array(excess, dtype=np.int64)
    deadline = time.perf_counter() + time_limit_s

    def cost(picks: list[int]) -> float:
        return sum(options[i].cost_s for i in picks)

    best = _greedy_cover(options, by_option, need)
    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        for left_out in sorted(best, key=lambda i: -options[i].cost_s):
            if time.perf_counter() >= deadline:
                break
            alternative = _greedy_cover(options, by_option, need, exclude={left_out})
            if cost(alternative) < cost(best) - 1e-12 and _covers(alternative, by_option, need):
                best, improved = alternative, True
                break
    return best


def _option_arrays(cover: list[list[tuple[int, int]]]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per option, the segments it spans and the bytes it frees there, as arrays.

    A 20,000-op graph has millions of (option, segment) pairs, and re-scoring them in Python loops took minutes.
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
    for a tensor, a short gap say, may not span a segment that another of its ways would (measured: on an
    unrolled RNN, without replacements the greedy plan left segments uncovered where CBC covered them all at
    0.58x its cost). Then, costliest first, picks whose segments stay covered without them are dropped.
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


def _report(name: str, before: GraphIR, after: GraphIR, start: MemoryProfile, end: MemoryProfile,
            plans: list[PlanResult], label: str, target_bytes: int) -> PassReport:
    final = plans[-1] if plans else PlanResult((), "none", 0.0, 0.0, 0.0)
    met = "meets" if end.peak_bytes <= target_bytes else "still above"
    counts: dict[str, int] = {}
    for o in final.chosen:
        counts[o.kind] = counts.get(o.kind, 0) + 1
    if not plans:  # the greedy repair of nothing solved
        return PassReport(name, True, nodes_added=len(after) - len(before), details={"order": label},
                          notes=(f"plan: {label}; solver not run", f"simulated peak {format_bytes(start.peak_bytes)} "
                                 f"-> {format_bytes(end.peak_bytes)}, {met} the budget"))
    notes = (
        f"plan ({label}): " + (", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "nothing chosen")
        + f"; solver {final.status} in {sum(p.solve_s for p in plans):.1f} s over {len(plans)} round(s)"
        + (f" and {final.follow_ups} on the applied plan" if final.follow_ups else "") + "; "
        f"estimated overhead {final.objective_s * 1e3:.1f} ms per step (heuristic plan: "
        f"{final.heuristic_objective_s * 1e3:.1f} ms)",
        f"simulated peak {format_bytes(start.peak_bytes)} -> {format_bytes(end.peak_bytes)}, {met} the budget",
    )
    details: dict[str, object] = {
        "decisions": [{"kind": o.kind, "tensor": o.key, "bytes": o.nbytes, "cost_s": o.cost_s} for o in final.chosen],
        "solver_status": final.status, "solve_s": sum(p.solve_s for p in plans), "follow_ups": final.follow_ups,
        "objective_s": final.objective_s, "heuristic_objective_s": final.heuristic_objective_s,
        "order": label,
    }
    return PassReport(name, True, nodes_added=len(after) - len(before), notes=notes, details=details,
                      bytes_moved=sum(o.nbytes for o in final.chosen if o.kind != "recompute"))


def _single_report(name: str, before: GraphIR, after: GraphIR, start: MemoryProfile, end: MemoryProfile,
                   single: PassReport, solved: list[PlanResult], label: str, target_bytes: int,
                   link: costmodel.DeviceSpec) -> PassReport:
    """The report of a plan one strategy made alone: its decisions, and what the solver said meanwhile."""
    decisions = single_decisions(single, link)
    met = "meets" if end.peak_bytes <= target_bytes else "still above"
    final = solved[-1] if solved else None
    solver = (f"solver {final.status} in {sum(p.solve_s for p in solved):.1f} s (its plan not kept)" if final
              else "solver not run")
    overhead = sum(d["cost_s"] for d in decisions)  # type: ignore[misc]
    notes = (f"plan: {label}; {len(decisions)} decisions; {solver}; estimated overhead {overhead * 1e3:.1f} ms "
             "per step", f"simulated peak {format_bytes(start.peak_bytes)} -> {format_bytes(end.peak_bytes)}, "
             f"{met} the budget")
    details: dict[str, object] = {
        "decisions": decisions, "order": label, "solver_status": final.status if final else "not run",
        "solve_s": sum(p.solve_s for p in solved), "plan_overhead_s": overhead,
        # the solved model's figures (its plan was not kept), for comparing the solver with the greedy
        "objective_s": final.objective_s if final else None,
        "heuristic_objective_s": final.heuristic_objective_s if final else None,
    }
    return PassReport(name, True, nodes_added=len(after) - len(before), notes=notes, details=details,
                      bytes_moved=single.bytes_moved)


def _chained_report(reports: Sequence[PassReport]) -> PassReport:
    """One report for passes run one after another: their moves together (what ``single_decisions`` reads)."""
    details: dict[str, object] = {
        key: [item for r in reports for item in r.details.get(key, ())]  # type: ignore[attr-defined]
        for key in ("swapped", "recomputed", "groups")
    }
    # what host placement brings back each step, apart from the swaps' copies (``single_decisions`` splits it)
    details["placed_bytes_per_step"] = sum(r.bytes_moved for r in reports if "groups" in r.details)
    notes = tuple(note for r in reports for note in r.notes)
    return PassReport(", then ".join(r.name for r in reports), True, nodes_added=sum(r.nodes_added for r in reports),
                      notes=notes, details=details, bytes_moved=sum(r.bytes_moved for r in reports))


def single_decisions(report: PassReport, link: costmodel.DeviceSpec) -> list[dict[str, object]]:
    """Per tensor or variable group that a single strategy's pass moved: kind, bytes, estimated cost.

    Costs are the planner's own terms (``options``): a swap's exposed transfer plus ``copy_share(link)``
    of its transfers; a recomputation's compute; for host placements, ``copy_share(link)`` of their
    prefetches' transfer time, split among the groups by bytes (the pass does not report exposure per group).
    """
    out: list[dict[str, object]] = []
    for tensor, nbytes, _ins, transfer_s, exposed_s in report.details.get("swapped", ()):  # type: ignore[attr-defined]
        cost = exposed_s + copy_share(link) * (transfer_s + link.transfer_s(nbytes))
        out.append({"kind": "swap", "tensor": tensor, "bytes": nbytes, "cost_s": cost})
    for tensor, nbytes, _chain, compute_s in report.details.get("recomputed", ()):  # type: ignore[attr-defined]
        out.append({"kind": "recompute", "tensor": tensor, "bytes": nbytes, "cost_s": compute_s})
    groups = list(report.details.get("groups", ()))  # type: ignore[call-overload]
    total = sum(n for _, n in groups) or 1
    for roots, nbytes in groups:
        per_step = int(report.details.get("placed_bytes_per_step", report.bytes_moved))  # type: ignore[call-overload]
        cost = copy_share(link) * link.transfer_s(per_step) * nbytes / total
        out.append({"kind": "place", "tensor": roots, "bytes": nbytes, "cost_s": cost})
    return out
