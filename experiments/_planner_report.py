"""Markdown for experiments.planner's results: the guarantee ladder, the strategies table and the large graph."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


from tfmem.units import format_bytes


def markdown(result: dict[str, object]) -> str:
    lines = ["# Budget planner: guarantee, smallest budget, and plans compared", "",
             f"Command: `{result['provenance']['command']}`. {GUARANTEE_METHOD} Memory: testbed allocator "
             "(measured) and simulator; step time: median testbed wall time.", "",
             "## Guarantee and smallest accepted budget", "", *guarantee_md(result)]
    lines += ["", "## Solver vs greedy heuristic (cost model)", "",
              "Overhead: the plan's estimated cost per step (exposed transfers, recomputation); step: the graph's "
              "estimated step as written plus that overhead.", "",
              "| graph | budget | solver status | solve time | MIP overhead | heuristic overhead | heuristic / MIP, "
              "overhead | heuristic / MIP, step |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    for name, g in result["graphs"].items():
        for r in g["guarantee"]:
            if r.get("objective_s") is None:
                continue
            mip, heur, base = r["objective_s"], r["heuristic_objective_s"], r.get("unplanned_step_s")
            step = f"{(base + heur) / (base + mip):.3f}" if base else "-"
            lines.append(f"| {name} | {format_bytes(r['budget_bytes'])} | {r['solver_status']} | {r['solve_s']:.2f} s "
                         f"| {mip * 1e3:.1f} ms | {heur * 1e3:.1f} ms | {f'{heur / mip:.2f}' if mip else '-'} "
                         f"| {step} |")
    lines += ["", "## Strategies at equal budget (measured step time)", "", STRATEGIES_MEASURED, "",
              *strategies_md({name: [g["strategies"]] for name, g in result["graphs"].items()
                               if g.get("strategies")})]
    big = result.get("large_graph")
    if big:
        lines += ["", "## Planner time on a large graph", "", large_md(big).rstrip("\n")]
    return "\n".join(lines) + "\n"


GUARANTEE_METHOD = ("Budgets are fractions of vanilla's measured testbed peak, then up to three more between the "
                    "smallest accepted and the largest refused (the first at 1.3x the refusal's lower bound, then "
                    "bisecting; where every budget was refused, 1.3x the bound first, if below vanilla's peak, then "
                    "bisecting towards it); "
                    "accepted plans run in a testbed of exactly that budget; the lower bound is the one "
                    "reported by the refusal nearest the smallest accepted budget.")


def guarantee_md(result: dict[str, object]) -> list[str]:
    lines = ["| graph | vanilla peak | accepted budgets (measured peak, OOM?) | refused budgets (lower bound) "
             "| smallest accepted / lower bound |", "|---|---:|---|---|---:|"]
    for name, g in result["graphs"].items():
        acc = [r for r in g["guarantee"] if r["accepted"]]
        ref = [r for r in g["guarantee"] if not r["accepted"]]
        acc_s = ", ".join(f"{format_bytes(r['budget_bytes'])} ({format_bytes(r['measured_peak_bytes'] or 0)}"
                          f"{', OOM' if r['oom'] else ''})" for r in acc) or "-"
        ref_s = ", ".join(f"{format_bytes(r['budget_bytes'])} ({format_bytes(r['lower_bound_bytes'])})"
                          for r in ref) or "-"
        smallest = min((r["budget_bytes"] for r in acc), default=None)
        edge = max((r for r in ref if smallest is None or r["budget_bytes"] < smallest),
                   key=lambda r: r["budget_bytes"], default=None)   # the refusal nearest the smallest accepted
        bound = edge["lower_bound_bytes"] if edge else None
        ratio = f"{smallest / bound:.2f}x" if smallest and bound else "-"
        lines.append(f"| {name} | {format_bytes(g['vanilla_peak_bytes'])} | {acc_s} | {ref_s} | {ratio} |")
    return lines


STRATEGIES_MEASURED = ("Measured: testbed step time (median over interleaved rounds of each round's median) and "
                       "the largest device peak; each plan runs in a testbed of exactly the budget. Estimated: the "
                       "cost model's step (`estimated_step_s` of the plan's simulation).")


def strategies_md(rows: dict[str, list[dict[str, object]]]) -> list[str]:
    """The strategies table: per graph, budget and strategy, measured step time and peak, or why there is none;
    then how the planner's plan compares with each strategy alone (``versus``)."""
    first = next((s for budgets in rows.values() for s in budgets), None)
    if first is None:
        return ["No strategies were compared (none are with --tiny, or no budget was accepted)."]
    labels = [k for k, v in first.items() if isinstance(v, dict)]   # the strategies, in the order they ran
    others = [label for label in labels if label != "planner"]
    lines = ["| graph | budget | " + " | ".join(labels) + " | " + " | ".join(f"planner vs {o}" for o in others)
             + " |", "|---|---:|" + "---:|" * len(labels) + "---|" * len(others)]
    for name, budgets in rows.items():
        for s in budgets:
            cells = []
            for label in labels:
                r = s[label]
                cells.append("refused" if r["refused"] else f"same graph as {r['same_as']}" if "same_as" in r else
                             "OOM" if r["oom"] else
                             f"{r['step_s'] * 1e3:.0f} ms ({format_bytes(r['measured_peak_bytes'] or 0)}; "
                             f"est. {r['estimated_step_s'] * 1e3:.0f} ms)")
            cells += [versus(s["planner"], measured_as(s, o)) for o in others]
            lines.append(f"| {name} | {format_bytes(s['budget_bytes'])} | " + " | ".join(cells) + " |")
    return lines


def measured_as(row: dict[str, dict[str, object]], label: str) -> dict[str, object]:
    """``label``'s entry, or, where its graph is one another single strategy made first, that one's (measured);
    a graph the planner made stays ``same_as`` the planner."""
    same = row[label].get("same_as")
    return row[same] if same and same != "planner" else row[label]  # type: ignore[index,return-value]


def versus(planner: dict[str, object], other: dict[str, object]) -> str:
    """The planner's plan against one strategy's at the same budget: who runs, and who is quicker in how many of
    the interleaved rounds (each round runs every plan once, so a slow stretch of the machine hits both)."""
    if planner["refused"]:
        return "planner refused"
    if planner["oom"]:
        return "planner OOM"
    if other["refused"]:
        return "only the planner fits"
    if other.get("same_as") == "planner":
        return "same graph"
    if other["oom"]:
        return "only the planner runs (other OOM)"
    pairs = list(zip(planner["rounds_s"], other["rounds_s"], strict=False))  # type: ignore[call-overload]
    quicker = sum(p < o for p, o in pairs)
    change = planner["step_s"] / other["step_s"] - 1  # type: ignore[operator]
    return f"{'quicker' if change < 0 else 'slower'} by {abs(change):.0%}, quicker in {quicker}/{len(pairs)} rounds"


def large_md(big: dict[str, object]) -> str:
    return (f"`optimize(budget={format_bytes(big['budget_bytes'])})` on a {big['ops']:,}-op deep MLP "
            f"(vanilla {format_bytes(big['vanilla_simulated_bytes'])} simulated): {big['optimize_s']:.1f} s "
            f"end to end at a 1-minute load average of {big['load_avg_1min']:.1f}; "
            + ("refused." if big["refused"] else
               f"simulated peak {format_bytes(big['simulated_bytes'])}; the planner pass took "
               f"{(big['planner_s'] or 0):.1f} s, solver {big['solver']} ({(big['solve_s'] or 0):.1f} s in CBC).")
            + "\n")


def at_row(row: dict[str, object]) -> str:
    def mib(key: str) -> str:
        value = row.get(key)
        return format_bytes(value) if isinstance(value, int) else "-"

    oom = "-" if not row["accepted"] else ("yes" if row["oom"] else "no")
    return (f"| {mib('budget_bytes')} | {'yes' if row['accepted'] else 'no'} | {mib('measured_peak_bytes')} | {oom} "
            f"| {mib('simulated_peak_bytes')} | {mib('lower_bound_bytes')} | {mib('best_peak_bytes')} |")
