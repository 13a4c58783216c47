"""Benchmark: the smallest device on which a graph runs, by the simulator's allocator replay and on the testbed.

``optimize`` keeps a graph as it is when its allocator replay (``tfmem.sim.bfc``: 256-byte rounding, bins,
chunks split only when twice the request, a 2 MiB first region and then the rest of the cap) serves every request
on the budget less ``tfmem.optimizer.as_is_room``'s margin, and accepts a plan by the same replay with its own margin.
This experiment measures how far that replay is from the testbed, for each graph as written (with the executor's
default inter-op pool and with one thread) and for the plan ``optimize`` makes for 0.7x its simulated peak with
the layout check off (default pool):

- ``sim``: the smallest whole-MiB cap on which the replay serves every request (for the default pool, in both
  the emulated interleaving and the one-thread order, as ``optimize`` checks it);
- ``testbed``: the smallest whole-MiB cap on which every one of ``--runs`` testbed runs ran (a fresh pair of
  servers per cap; a step, a warm-up and initialisation all count).

``testbed - sim`` above zero means the replay fits a cap the testbed does not (a margin must cover it); below
zero, the replay is cautious. Written to ``experiments/results/allocator_fit.{json,md}``.

    python -m experiments.allocator_fit            # the examples and the table models (about 40 minutes)
    python -m experiments.allocator_fit --only graphs
    python -m experiments.allocator_fit --tiny     # CI smoke: one small MLP, one run per cap
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tqdm import tqdm

import tfmem
from experiments._common import RESULTS, load_average, provenance, write
from tfmem import examples
from tfmem.ir.loading import load
from tfmem.optimizer import AS_IS_MARGIN_SHARE, layout_failures
from tfmem.pipeline import PassContext
from tfmem.units import format_bytes

MiB = 2**20
# The search below and above the replay's cap stops this far out: a graph the replay misjudges by more is a
# finding in itself, recorded as such.
SPAN_MIB = 12
POOLS = (("default pool", None), ("one thread", 1))
# Plans are made for this fraction of the graph's simulated one-thread peak: below what the graph needs with one
# thread, so that optimize plans rather than keeps it.
PLAN_FRACTION = 0.75


def graphs(tiny: bool) -> dict[str, Any]:
    """Graphs a user would write (``tfmem.examples``) and the table models (``experiments._common``)."""
    if tiny:
        return {"mlp-784-1024-10": examples.mlp(dims=(784, 1024, 10))}
    from experiments._common import table_models

    return {
        "mlp-784-1024-10": examples.mlp(dims=(784, 1024, 10)),
        "mlp": examples.mlp(),
        "convnet": examples.residual_convnet(),
        "wide": examples.wide_branches(),
        "rnn": examples.unrolled_rnn(),
        "moe": examples.moe_layer(),
        "unet": examples.unet(),
        **table_models(False),
    }


@dataclass(frozen=True)
class Case:
    """One graph to size: what runs (``graph``, with ``config``), the user's fetches and feeds (``built``), and the
    devices ``optimize`` was told (None for a graph as written: every op on the device)."""

    graph: Any
    built: Any
    config: Any = None
    device: str | None = None
    host: str | None = None
    every_order: bool = True   # replay every draw of TF's hashed orders, as optimize checks a graph it keeps


def _replayed(case: Case, threads: int | None) -> tuple[PassContext, Any]:
    """The context and loaded graph ``optimize`` would replay ``case`` with, on ``threads`` inter-op threads."""
    built = case.built
    ctx = PassContext(tuple(built.fetches), device=case.device, host=case.host,
                      feed_shapes=dict(built.feed_shapes or {}), inter_op_threads=threads, session_config=case.config)
    return ctx, load(case.graph, ctx.feed_shapes or None)


def smallest_sim_cap(case: Case, threads: int | None) -> int:
    """The smallest whole-MiB cap on which the replay of what the session runs serves every request, as
    ``optimize`` checks a graph (``tfmem.optimizer.layout_failures``, no margin)."""
    ctx, ir = _replayed(case, threads)
    peak = ctx.simulate(ir).peak_bytes

    def fits(mib: int) -> bool:
        return layout_failures(ctx, ir, mib * MiB, every_order=case.every_order) == 0

    low, high = max(peak // MiB - 1, 1), peak // MiB + 2
    while not fits(high):
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if fits(mid) else (mid, high)
    return high


def smallest_testbed_cap(case: Case, threads: int | None, start: int, runs: int) -> dict[str, Any]:
    """The smallest whole-MiB cap on which ``runs`` testbed runs all ran, searched outward from ``start``."""
    tried: dict[int, str] = {}

    def ran(mib: int) -> bool:
        if mib not in tried:
            endings = []
            for _ in range(runs):
                r = _run(case, mib, threads)
                endings.append(r.ending)
                if not r.ran:
                    break
            tried[mib] = ",".join(endings)
        return all(e == "ran" for e in tried[mib].split(","))

    cap = start
    if ran(cap):
        while cap - 1 >= max(start - SPAN_MIB, 2) and ran(cap - 1):
            cap -= 1
        smallest: int | None = cap
    else:
        while cap < start + SPAN_MIB and not ran(cap):
            cap += 1
        smallest = cap if ran(cap) else None
    return {"smallest_mib": smallest, "tried": {str(k): v for k, v in sorted(tried.items())}}


def _run(case: Case, mib: int, threads: int | None) -> Any:
    from tfmem.errors import TestbedError
    from tfmem.testbed import RunResult, Testbed

    built = case.built
    try:
        with Testbed(mib * MiB, inter_op_threads=threads, step_timeout_s=120) as tb:
            return tb.run(case.graph, list(built.fetches), built.feeds, steps=1, config=case.config)
    except TestbedError as e:
        return RunResult.failed(e)


def exact_need(case: Case, threads: int | None, sim_mib: int) -> int:
    """The smallest device, to 64 KiB, on which the replay serves every request (below ``sim_mib``, which fits)."""
    ctx, ir = _replayed(case, threads)
    low, high = (sim_mib - 1) * MiB, sim_mib * MiB
    while high - low > 64 * 1024:
        mid = (low + high) // 2
        low, high = (mid, high) if layout_failures(ctx, ir, mid, every_order=case.every_order) else (low, mid)
    return high


def with_need(entry: dict[str, Any], need: int) -> dict[str, Any]:
    """``entry`` with the replay's exact need, and the share of the cap below the testbed's smallest that a margin
    must exceed for ``optimize`` to refuse that cap (negative: the replay alone refuses it)."""
    tb = entry["testbed_mib"]
    below = None if tb is None else ((tb - 1) * MiB - need) / ((tb - 1) * MiB)
    return {**entry, "need_bytes": need, "margin_to_refuse_share": below}


def measure(case: Case, runs: int, pools: tuple[tuple[str, int | None], ...] = POOLS) -> dict[str, Any]:
    """Both smallest caps, and their difference, for each of ``pools``; the replay's exact need."""
    row: dict[str, Any] = {"ops": len(load(case.graph).nodes)}
    for label, threads in pools:
        sim = smallest_sim_cap(case, threads)
        found = smallest_testbed_cap(case, threads, sim, runs)
        tb = found["smallest_mib"]
        row[label] = with_need({"sim_mib": sim, "testbed_mib": tb, "tried": found["tried"],
                                "testbed_minus_sim_mib": None if tb is None else tb - sim},
                               exact_need(case, threads, sim))
    return row


def replay_again(result: dict[str, Any], chosen: dict[str, Any]) -> None:
    """Recompute the replay's figures of the graphs as written in ``result`` with this code, keeping the testbed's
    (the graphs and TF are the same; the replay changed): ``--replay-again``."""
    for name, row in result["graphs"].items():
        for label, threads in POOLS:
            case = Case(chosen[name].graph, chosen[name])
            sim = smallest_sim_cap(case, threads)
            tb = row[label]["testbed_mib"]
            row[label] = with_need({**row[label], "sim_mib": sim,
                                    "testbed_minus_sim_mib": None if tb is None else tb - sim},
                                   exact_need(case, threads, sim))


def plan_case(built: Any) -> tuple[Case | None, str]:
    """The plan ``optimize`` makes for ``PLAN_FRACTION`` x the graph's simulated one-thread peak with its layout check off (so the plan's
    layout is what is measured, not the margin that refused it), as a case; None and the refusal when refused."""
    from experiments.planner_gap import plan_without_layout_check
    from tfmem.testbed import DEVICE, HOST

    peak = tfmem.simulate(built.graph, list(built.fetches), feed_shapes=built.feed_shapes, device=DEVICE,
                          host=HOST, inter_op_threads=1).peak_bytes
    target = int(PLAN_FRACTION * peak)
    opt = plan_without_layout_check(built, target)
    if isinstance(opt, tfmem.InfeasibleBudgetError):
        return None, f"refused at {format_bytes(target)}: {str(opt)[:120]}"
    return Case(opt.graph, built, opt.config, DEVICE, HOST), f"planned for {format_bytes(target)}"


def _rows(section: dict[str, Any]) -> list[str]:
    lines = []
    for name, row in section.items():
        if "refused" in row:
            lines.append(f"| {name} | - | - | - | - | - | - | {row['refused']} |")
            continue
        for label in (k for k, _ in POOLS if k in row):
            r = row[label]
            tried = "; ".join(f"{k}: {v}" for k, v in r["tried"].items())
            tb = "none within the span" if r["testbed_mib"] is None else f"{r['testbed_mib']} MiB"
            diff = "-" if r["testbed_minus_sim_mib"] is None else f"{r['testbed_minus_sim_mib']:+d} MiB"
            need = f"{r['need_bytes'] / MiB:.2f} MiB" if r.get("need_bytes") else "-"
            share = "-" if r.get("margin_to_refuse_share") is None else f"{r['margin_to_refuse_share']:+.1%}"
            lines.append(f"| {name} ({row['ops']}) | {label} | {r['sim_mib']} MiB | {tb} | {diff} | {need} | {share} "
                         f"| {tried} |")
    return lines


def _worst(section: dict[str, Any]) -> int | None:
    diffs = [r[k]["testbed_minus_sim_mib"] for r in section.values() for k, _ in POOLS
             if k in r and r[k]["testbed_minus_sim_mib"] is not None]
    return max(diffs, default=None)


def markdown(result: dict[str, Any]) -> str:
    head = ["| graph (ops) | pool | sim | testbed | testbed - sim | replay needs | margin to refuse testbed - 1 | "
            "caps tried (MiB: endings) |", "|---|---|---:|---:|---:|---:|---:|---|"]
    lines = [
        "# The smallest device a graph runs on: allocator replay vs testbed",
        "",
        f"Command: `{result['command']}` ({result['date']}; TF {result['versions']['tensorflow']}; "
        f"{result['machine']['cpus']} cores, load average {result['load_average']} before the run). "
        f"{result['runs']} testbed run(s) per cap, each on fresh servers (initialisation, one warm-up step, one "
        "timed step).",
        "",
        "`sim`: the smallest whole-MiB cap on which tfmem's allocator replay serves every request (default pool: "
        "in the emulated interleaving and in the one-thread order). `testbed`: the smallest whole-MiB cap on which "
        "every run ran. A positive difference is a cap the replay accepts and the testbed does not; a negative "
        "one, a cap the testbed runs and the replay refuses. `replay needs`: the smallest device, to 64 KiB, the "
        "replay fits. `margin to refuse testbed - 1`: the share of the cap one MiB below the testbed's smallest "
        "that a margin must exceed for the replay to refuse it (negative: the replay alone refuses it).",
        "",
        "## Graphs as written",
        "",
        *([f"Replay: {result['graphs_replay']}.", ""] if result.get("graphs_replay") else []),
        *head, *_rows(result["graphs"]),
        "",
        f"Largest testbed - sim: {_worst(result['graphs'])} MiB. `optimize` keeps a graph as it is when its replay "
        f"fits the budget less {AS_IS_MARGIN_SHARE:.1%} (`tfmem.optimizer.as_is_room`).",
    ]
    if result.get("plans"):
        run = result.get("plans_run")   # when the plans were measured by a run of their own (--only plans)
        lines += ["", f"## Plans (`optimize` for {PLAN_FRACTION}x the simulated one-thread peak, layout check off, "
                  "device and host given)", "",
                  *([f"Command: `{run['command']}` ({run['date']}; load average {run['load_average']} before the "
                     "run). A row whose ops equal the graph's own is a graph `optimize` kept as it is.", ""]
                    if run else []), *head, *_rows(result["plans"]), "",
                  f"Largest testbed - sim: {_worst(result['plans'])} MiB."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CI smoke run: one small MLP, one run per cap")
    parser.add_argument("--runs", type=int, default=None, help="testbed runs per cap (default 2; --tiny 1)")
    parser.add_argument("--only", choices=("graphs", "plans"), help="measure only graphs as written, or only plans")
    parser.add_argument("--replay-again", type=Path, metavar="JSON",
                        help="recompute the replay's figures of the graphs as written in this results file, keeping "
                             "its testbed runs (after a change to the replay; no testbed run)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    runs = args.runs or (1 if args.tiny else 2)
    chosen = graphs(args.tiny)
    if args.replay_again is not None:
        import json

        result = json.loads(args.replay_again.read_text())
        replay_again(result, chosen)
        result["graphs_replay"] = (f"every draw of TF's hashed orders, recomputed by `python -m experiments."
                                   f"allocator_fit --replay-again` on {provenance(argv)['date']}; testbed runs "
                                   "from the run above")
        write("allocator_fit_tiny" if args.tiny else "allocator_fit", result, markdown(result), args.out)
        return 0
    result = provenance(argv, runs=runs, load_average=load_average())
    result["graphs"], result["plans"] = {}, {}
    sections = [k for k in ("graphs", "plans") if args.only in (None, k)]
    with tqdm(total=len(chosen) * len(sections), desc="allocator_fit", unit="graph") as bar:
        for name, built in chosen.items():
            if "graphs" in sections:
                bar.set_postfix_str(f"{name} as written")
                result["graphs"][name] = measure(Case(built.graph, built), runs)
                bar.update(1)
            if "plans" in sections:
                bar.set_postfix_str(f"{name} planned")
                case, how = plan_case(built)
                result["plans"][name] = ({"refused": how} if case is None
                                         else {**measure(case, runs, POOLS[:1]), "plan": how})
                bar.update(1)
    write("allocator_fit_tiny" if args.tiny else "allocator_fit", result, markdown(result), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
