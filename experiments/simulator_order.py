"""How much of the simulator's error is the order it guesses: replay each traced testbed step in its own order.

The simulator does not know the order TF's executor will run a step in; it emulates the executor (and a
one-thread order) and reports the worse. Where the measured peak differs from that, two things can be wrong:
the order, or the bytes (what each op allocates and frees). This experiment tells them apart. For each graph it
runs the graph as written on the testbed ``--runs`` times, tracing one step each time (``RunOptions.FULL_TRACE``:
every op's start time), then simulates the same graph in exactly the order that step ran (``simulate(order=...)``)
and compares three peaks: the simulator's usual one, the one replayed in the run's order, and the measured one.

    python -m experiments.simulator_order                  # the four held-out graphs, 3 runs each (about 5 minutes)
    python -m experiments.simulator_order --graph WGAN-GP --runs 5
    python -m experiments.simulator_order --tiny           # CI smoke: a small MLP, one run
"""

from __future__ import annotations

import argparse
import heapq
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf
from tqdm import tqdm

from experiments._common import RESULTS, provenance, write
from experiments.planner import held_out_matching
from tfmem import examples
from tfmem.ir.devices import DEFAULT_DEVICE, with_default_device
from tfmem.ir.execution import ExecutionGraph
from tfmem.ir.graph import GraphIR
from tfmem.ir.loading import to_graph_def
from tfmem.ir.shapes import annotate
from tfmem.sim import costmodel
from tfmem.sim.analysis import analyse
from tfmem.sim.executor_folding import fold_like_executor
from tfmem.sim.grappler import runtime_graph_def
from tfmem.sim.memsim import simulate
from tfmem.testbed import Testbed
from tfmem.units import format_bytes

MiB = 2**20
CAPACITY = 2 << 30   # far above every graph here: the step runs as it would unbounded


def start_times(metadata: tf.compat.v1.RunMetadata) -> dict[str, int]:
    """Each traced op's first start time (microseconds), over every device of the step."""
    starts: dict[str, int] = {}
    for device in metadata.step_stats.dev_stats:
        for stats in device.node_stats:
            starts[stats.node_name] = min(stats.all_start_micros, starts.get(stats.node_name, stats.all_start_micros))
    return starts


def largest_overlap(metadata: tf.compat.v1.RunMetadata, device: str = "worker") -> tuple[int, tuple[str, ...]]:
    """The most that ops running at once on ``device`` allocated between them (each op's own peak, scratch and
    outputs), and which ops: what a one-thread replay cannot show."""
    spans = sorted(
        (stats.all_start_micros, stats.all_start_micros + stats.all_end_rel_micros,
         max((m.peak_bytes for m in stats.memory), default=0), stats.node_name)
        for dev in metadata.step_stats.dev_stats if device in dev.device for stats in dev.node_stats)
    best: tuple[int, tuple[str, ...]] = (0, ())
    for i, (start, _end, nbytes, name) in enumerate(spans):
        running = [(b, n) for _, e, b, n in spans[:i] if e > start] + [(nbytes, name)]
        total = sum(b for b, _ in running)
        if total > best[0] and len(running) > 1:
            best = (total, tuple(n for _, n in sorted(running, reverse=True)[:2]))
    return best


def traced_order(eg: ExecutionGraph, guess: Sequence[str], starts: Mapping[str, int]) -> list[str]:
    """The units of ``eg`` in the order a traced step started them, as a valid topological order.

    A unit the trace does not name (an op the session's Grappler renamed or folded, a region's members) takes
    the start time of the unit before it in ``guess`` (the simulator's own order), so it runs right after it;
    ties keep ``guess``'s order. A unit never starts before its inputs' producers, whatever the clock says.
    """
    key: dict[str, int] = {}
    last = 0
    for unit in guess:
        member_starts = [starts[n] for n in eg.members[unit] if n in starts]
        last = min(member_starts) if member_starts else last
        key[unit] = last
    position = {u: i for i, u in enumerate(guess)}
    preds = eg.unit_preds
    waiting = {u: len(set(preds.get(u, ()))) for u in eg.units}
    succs: dict[str, list[str]] = {u: [] for u in eg.units}
    for unit in eg.units:
        for pred in set(preds.get(unit, ())):
            succs[pred].append(unit)
    ready = [(key.get(u, 0), position.get(u, 0), u) for u in eg.units if waiting[u] == 0]
    heapq.heapify(ready)
    order: list[str] = []
    while ready:
        _, _, unit = heapq.heappop(ready)
        order.append(unit)
        for succ in succs[unit]:
            waiting[succ] -= 1
            if waiting[succ] == 0:
                heapq.heappush(ready, (key.get(succ, 0), position.get(succ, 0), succ))
    return order


def runtime_ir(built: examples.Built) -> GraphIR:
    """The graph as the simulator sees it by default: after Grappler's rewrites, folded like TF's executor."""
    placed = with_default_device(to_graph_def(built.graph), DEFAULT_DEVICE)
    return fold_like_executor(annotate(runtime_graph_def(placed, built.fetches), built.feed_shapes), built.fetches)


def graph_row(name: str, built: examples.Built, runs: int) -> dict[str, object]:
    usual = simulate(built.graph, built.fetches, feed_shapes=built.feed_shapes)
    ir = runtime_ir(built)
    eg = analyse(ir, list(built.fetches), list(built.feed_shapes), costmodel.DEFAULT_DEVICE).eg
    measured = []
    with Testbed(CAPACITY) as tb:
        for _ in range(runs):
            run = tb.run(built.graph, built.fetches, built.feeds, steps=1, trace=True)
            order = traced_order(eg, usual.schedule.order, start_times(run.run_metadata))
            members = [n for unit in order for n in eg.members[unit]]
            # ``ir`` is the step alone: variables no op of it runs are not counted here (none in these graphs).
            replayed = simulate(ir, built.fetches, feed_shapes=built.feed_shapes, order=members, grappler=False)
            overlap, ops = largest_overlap(run.run_metadata)
            measured.append({"measured_peak_bytes": run.device_peak_bytes, "replayed_peak_bytes": replayed.peak_bytes,
                             "replayed_peak_unit": replayed.peak_unit, "largest_overlap_bytes": overlap,
                             "largest_overlap_ops": list(ops)})
    return {"graph": name, "simulated_peak_bytes": usual.peak_bytes, "simulated_peak_unit": usual.peak_unit,
            "runs": measured}


def _short(op: str) -> str:
    """An op's name by its last two scopes (``layer/MatMul``), or whole when it has fewer (``MatMul``, which
    overlapped the others in a run under load)."""
    return "/".join(op.split("/")[-2:])


def markdown(result: dict[str, object]) -> str:
    made = result["provenance"]
    lines = ["# The simulator's order against the executor's: replaying traced steps", "",
             f"Measured by `{made['command']}` ({made['date']}). {METHOD}", "",
             "| graph | simulated (its own order) | replayed in each run's order | measured (testbed) "
             "| most allocated by ops running at once (the two largest) |",
             "|---|---:|---|---|---|"]
    for row in result["rows"]:
        runs = row["runs"]
        replayed = ", ".join(format_bytes(r["replayed_peak_bytes"]) for r in runs)
        measured = ", ".join(format_bytes(r["measured_peak_bytes"]) for r in runs)
        widest = max(runs, key=lambda r: r["largest_overlap_bytes"])
        overlap = (f"{format_bytes(widest['largest_overlap_bytes'])} "
                   f"({', '.join(_short(n) for n in widest['largest_overlap_ops'])})")
        lines.append(f"| {row['graph']} | {format_bytes(row['simulated_peak_bytes'])} | {replayed} | {measured} "
                     f"| {overlap} |")
    return "\n".join(lines) + "\n"


METHOD = ("Each graph runs as written (no tfmem rewrite) on a testbed with a 2 GiB cap; one step per run is traced. "
          "Simulated: `tfmem.sim.memsim.simulate`'s peak (the worse of its emulated executor and one-thread orders). "
          "Replayed: the same simulation, in the order the traced step started its ops. Measured: the testbed "
          "allocator's peak over that step. In a row, the i-th replayed and the i-th measured figure are one run. Ops "
          "running at once: from the trace's start and end times, the largest sum of the ops' own peak allocations "
          "(scratch and outputs) over ops whose runs overlap, in the run where it was largest.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graph", help="only the held-out graph whose name starts with this, e.g. WGAN-GP")
    parser.add_argument("--runs", type=int, default=3, help="traced testbed runs per graph")
    parser.add_argument("--tiny", action="store_true", help="a small MLP, one run (CI smoke)")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    if args.tiny:
        builders = {"mlp-small": lambda: examples.mlp(batch=128, dims=(256, 512, 512, 10))}
        args.runs = 1
    else:
        builders = held_out_matching(parser, args.graph)
    rows = [graph_row(name, build(), args.runs) for name, build in tqdm(builders.items(), desc="graphs", unit="graph")]
    result = {"provenance": provenance(argv), "rows": rows}
    md = markdown(result)
    paths = write("simulator_order_tiny" if args.tiny else "simulator_order", result, md, Path(args.out))
    print(md)
    print("wrote", *paths)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
