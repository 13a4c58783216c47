"""The planner's reports: what each plan chose, what it cost by the planner's own terms, and what the solver said."""

from __future__ import annotations

from collections.abc import Sequence

from passes.plan_cover import PlanResult, copy_share
from tfmem.ir.graph import GraphIR
from tfmem.pipeline import PassReport
from tfmem.sim import costmodel
from tfmem.sim.profile import MemoryProfile
from tfmem.units import format_bytes


def solved_report(name: str, before: GraphIR, after: GraphIR, start: MemoryProfile, end: MemoryProfile,
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
        "order": label, "solver_calls": final.solver_calls,
    }
    return PassReport(name, True, nodes_added=len(after) - len(before), notes=notes, details=details,
                      bytes_moved=sum(o.nbytes for o in final.chosen if o.kind != "recompute"))


def strategy_report(name: str, before: GraphIR, after: GraphIR, start: MemoryProfile, end: MemoryProfile,
                   single: PassReport, label: str, target_bytes: int, link: costmodel.DeviceSpec) -> PassReport:
    """The report of a plan strategies made greedily (``tfmem.search``), under the planner's name: its decisions."""
    decisions = single_decisions(single, link)
    met = "meets" if end.peak_bytes <= target_bytes else "still above"
    overhead = sum(d["cost_s"] for d in decisions)  # type: ignore[misc]
    notes = (f"plan: {label}; {len(decisions)} decisions; estimated overhead {overhead * 1e3:.1f} ms per step",
             f"simulated peak {format_bytes(start.peak_bytes)} -> {format_bytes(end.peak_bytes)}, {met} the budget")
    details: dict[str, object] = {
        "decisions": decisions, "order": label, "solver_status": "not run", "solve_s": 0.0,
        "plan_overhead_s": overhead, "objective_s": None, "heuristic_objective_s": None, "solver_calls": 0,
    }
    return PassReport(name, True, nodes_added=len(after) - len(before), notes=notes, details=details,
                      bytes_moved=single.bytes_moved)


def chained_report(reports: Sequence[PassReport]) -> PassReport:
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
