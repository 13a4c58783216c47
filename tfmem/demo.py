"""``python -m tfmem.demo`` (``make demo``): a training graph that does not fit, made to fit, checked for real.

1. Build a deep MLP training step (``tfmem.examples.mlp``) and simulate it: its peak is the vanilla peak.
2. Pick a device budget of ~70% of that peak and run the vanilla graph on a testbed capped at the budget:
   it runs out of memory, for real (``ResourceExhaustedError`` in the capped TensorFlow server).
3. ``tfmem.optimize`` the graph for the budget. If it succeeds, run the optimized graph under the same cap and
   compare its outputs bit for bit with the vanilla graph run under a large budget. If the budget cannot be met
   (``InfeasibleBudgetError``), say why, show ``tfmem analyze`` and run the vanilla graph under a budget that
   fits instead.
4. Print a table of every run, and write the report's plot and markdown to ``demo_out/``.

``--tiny`` shrinks everything for the test suite.
"""

from __future__ import annotations

import os

# Before TensorFlow's first import (see tfmem.cli): keep its C++ start-up chatter out of the demo's output.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import argparse
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tensorflow as tf

import tfmem
from tfmem.errors import TestbedError
from tfmem.examples import Built, mlp
from tfmem.measure import grappler_peak
from tfmem.report import GRAPPLER, TESTBED, Report
from tfmem.testbed import DEVICE, HOST, RunResult, Testbed
from tfmem.units import format_bytes

MiB = 2**20
BUDGET_FRACTION = 0.7  # of the vanilla simulated peak: clearly too small, yet within reach of the passes
# name -> (batch, inputs, width, hidden layers, timed steps). "full" peaks at a few tens of MiB (simulator);
# "tiny" keeps its input small next to the budget, so that running out happens in the step, not in the feeds.
SIZES = {"full": (1024, 512, 512, 8, 3), "tiny": (1024, 64, 256, 4, 1)}


@dataclass(frozen=True)
class Row:
    """One line of the demo's table; None prints as a dash."""

    run: str
    budget_bytes: int
    measured_bytes: int | None
    simulated_bytes: int | None
    grappler_bytes: int | None
    step_s: float | None
    oom: bool
    failed: bool = False  # ran out of memory, or failed otherwise (printed as it happened)


class Progress:
    """Prints ``[  12.3s] message`` lines, so a run of tens of seconds shows where it is."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self._lock = threading.Lock()  # testbed threads report too; keep their lines whole

    def __call__(self, message: str) -> None:
        with self._lock:
            print(f"[{time.perf_counter() - self.start:6.1f}s] {message}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; return 0 when every run behaved as printed (the table says what happened).

    Parameters
    ----------
    argv : ``["--tiny"]`` for a small, fast run; ``["--out", DIR]`` to write elsewhere than ``demo_out/``

    Examples
    --------
    >>> main(["--tiny", "--out", "/tmp/tfmem-demo"])  # doctest: +SKIP
    """
    args = _parse(argv)
    say = Progress()
    batch, inputs, width, depth, steps = SIZES["tiny" if args.tiny else "full"]
    built = mlp(batch=batch, dims=(inputs,) + (width,) * depth + (10,))
    say(f"built an MLP training step: batch {batch}, {depth} hidden layers of {width}, {built.params:,} "
        f"parameters; fetches {built.fetches}")
    vanilla = tfmem.simulate(built.graph, built.fetches, feed_shapes=built.feed_shapes, device=DEVICE, host=HOST)
    grappler = grappler_peak(built.graph, built.fetches, host=HOST)
    budget = max(MiB, int(vanilla.peak_bytes * BUDGET_FRACTION) // MiB * MiB)  # the testbed caps in whole MiB
    large = math.ceil((2 * vanilla.peak_bytes + 16 * MiB) / MiB) * MiB
    say(f"vanilla peak: {format_bytes(vanilla.peak_bytes)} (simulator), {format_bytes(grappler)} (Grappler); "
        f"device budget {format_bytes(budget)} ({budget / vanilla.peak_bytes:.0%} of the simulated peak)")
    opt, infeasible = _optimize(built, budget, say)
    say(f"starting two testbeds in parallel: capped at {format_bytes(budget)}, and at {format_bytes(large)} "
        "(TensorFlow servers take ~10-30 s to start) ...")
    capped, big = _run_testbeds(built, opt, budget, large, steps, say)
    rows = _rows(built, vanilla, grappler, opt, budget, large, capped, big)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if infeasible is not None:
        print(f"\ntfmem.optimize could not meet the budget: {infeasible}\n")
        _show_analyze(built, out)
    print()
    _print_table(rows)
    _print_outputs(capped, big, opt is not None)
    report = _report(opt, vanilla, budget, rows, infeasible)
    report.plot(out / "memory.png")
    (out / "report.md").write_text(report.to_markdown())
    say(f"wrote {out / 'memory.png'} and {out / 'report.md'}; demo done")
    return 0


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tfmem.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="small sizes, one timed step (for tests)")
    parser.add_argument("--out", default="demo_out", help="directory for memory.png and report.md")
    return parser.parse_args(argv)


def _optimize(built: Built, budget: int, say: Callable[[str], None]
              ) -> tuple[tfmem.Optimized | None, tfmem.InfeasibleBudgetError | None]:
    say(f"tfmem.optimize(graph, fetches, budget={format_bytes(budget)!r}, passes='auto') ...")
    try:
        opt = tfmem.optimize(built.graph, built.fetches, budget=budget, feed_shapes=built.feed_shapes,
                             device=DEVICE, host=HOST)
    except tfmem.InfeasibleBudgetError as e:
        say(f"optimize: budget unreachable (lower bound {format_bytes(e.lower_bound_bytes)}, best peak "
            f"{format_bytes(e.best_peak_bytes)})")
        return None, e
    ran = ", ".join(p.name for p in opt.report.passes if p.changed) or "no pass changed the graph"
    say(f"optimize: simulated peak {format_bytes(opt.report.after.peak_bytes)} ({ran})")
    return opt, None


def _run_testbeds(built: Built, opt: tfmem.Optimized | None, budget: int, large: int, steps: int,
                  say: Callable[[str], None]) -> tuple[list[RunResult], RunResult]:
    """Runs on the capped testbed ([vanilla, optimized?]) and the vanilla run on the large one.

    Starting a testbed is mostly two TensorFlow imports, so both start at once. Each testbed lives in one
    thread from start to close (its children die with the thread that started them); a lock keeps the runs
    themselves apart so step times do not compete for cores.
    """
    lock = threading.Lock()

    def run(tb: Testbed, label: str, graph: tf.Graph | tf.compat.v1.GraphDef,
            config: tf.compat.v1.ConfigProto | None = None) -> RunResult:
        with lock:
            say(f"running {label} on the testbed capped at {format_bytes(tb.device_memory_bytes)} ...")
            try:
                result = tb.run(graph, built.fetches, built.feeds, steps=steps, config=config)
            except TestbedError as e:  # keep the other runs and the table; the row says "failed"
                result = RunResult.failed(e)
        peak = format_bytes(result.device_peak_bytes or 0)
        say(f"{label}: " + ("OUT OF MEMORY" if result.oom else f"FAILED: {result.error}" if result.error
                            else f"fits, peak {peak}"))
        return result

    def on_capped() -> list[RunResult]:
        with Testbed(budget) as tb:
            results = [run(tb, "vanilla", built.graph)]
            if opt is not None:
                results.append(run(tb, "optimized", opt.graph_def, opt.config))
            return results

    def on_large() -> RunResult:
        with Testbed(large) as tb:
            return run(tb, "vanilla (large budget)", built.graph)

    with ThreadPoolExecutor(max_workers=2) as pool:
        capped: Future[list[RunResult]] = pool.submit(on_capped)
        big: Future[RunResult] = pool.submit(on_large)
        return capped.result(), big.result()


def _rows(built: Built, vanilla: tfmem.MemoryProfile, grappler: int, opt: tfmem.Optimized | None, budget: int,
          large: int, capped: list[RunResult], big: RunResult) -> list[Row]:
    def row(name: str, cap: int, r: RunResult, simulated: int | None, grap: int | None) -> Row:
        return Row(name, cap, r.device_peak_bytes, simulated, grap, r.step_time_s, r.oom, r.error is not None)

    rows = [row("vanilla", budget, capped[0], vanilla.peak_bytes, grappler)]
    if opt is not None:
        opt_grappler = grappler_peak(opt.graph_def, built.fetches, host=HOST)
        rows.append(row("optimized", budget, capped[1], opt.report.after.peak_bytes, opt_grappler))
    rows.append(row("vanilla, large budget", large, big, vanilla.peak_bytes, grappler))
    return rows


def _print_table(rows: list[Row]) -> None:
    def cell(value: float | None, fmt: Callable[[float], str]) -> str:
        return "—" if value is None else fmt(value)

    header = ("run", "budget", "peak measured", "peak simulated", "peak Grappler", "step time", "OOM")
    lines = [header, ("", "", "(testbed)", "(simulator)", "(estimate)", "(testbed)", "")]
    for r in rows:
        lines.append((r.run, format_bytes(r.budget_bytes), cell(r.measured_bytes, format_bytes),
                      cell(r.simulated_bytes, format_bytes), cell(r.grappler_bytes, format_bytes),
                      cell(r.step_s, lambda s: f"{s * 1e3:.1f} ms"), _oom_cell(r)))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for i, line in enumerate(lines):
        print("  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(line, widths, strict=True))))
        if i == 1:
            print("  ".join("-" * w for w in widths))


def _oom_cell(row: Row) -> str:
    return "yes" if row.oom else "failed" if row.failed else "no"


def _print_outputs(capped: list[RunResult], big: RunResult, optimized: bool) -> None:
    if not optimized or capped[-1].error or big.error:
        print("\noutputs identical to vanilla: n/a (no optimized run to compare)")
        return
    same = all(np.array_equal(v, big.outputs[k]) for k, v in capped[-1].outputs.items())
    names = ", ".join(capped[-1].outputs)
    print(f"\noptimized outputs identical to vanilla ({names}, np.array_equal): {'yes' if same else 'NO'}")


def _show_analyze(built: Built, out: Path) -> None:
    from tfmem import cli

    path = out / "mlp.pb"
    path.write_bytes(built.graph.as_graph_def().SerializeToString())
    argv = ["analyze", str(path), *(f"--fetch={f}" for f in built.fetches),
            *(f"--feed-shape={k}={','.join(map(str, v))}" for k, v in built.feed_shapes.items()),
            f"--device={DEVICE}", f"--host={HOST}"]
    print("$ tfmem " + " ".join(argv))
    cli.main(argv)


def _report(opt: tfmem.Optimized | None, vanilla: tfmem.MemoryProfile, budget: int, rows: list[Row],
            infeasible: tfmem.InfeasibleBudgetError | None) -> Report:
    report = opt.report if opt is not None else Report(budget, vanilla, vanilla, [])
    by_run = {r.run: r for r in rows}
    before, after = by_run["vanilla, large budget"], by_run.get("optimized")
    report.add("device peak", before.measured_bytes, after.measured_bytes if after else None, TESTBED)
    report.add("device peak", before.grappler_bytes, after.grappler_bytes if after else None, GRAPPLER)
    report.add("step time", before.step_s, after.step_s if after else None, TESTBED, unit="s")
    if infeasible is not None:
        report.notes.append(f"not optimized: {infeasible}")
    oom = "ran out of memory" if by_run["vanilla"].oom else "did not run out of memory"
    report.notes.append(f"testbed 'before' figures: the vanilla graph under a large budget "
                        f"({format_bytes(before.budget_bytes)}); under {format_bytes(budget)} it {oom}")
    return report


if __name__ == "__main__":
    raise SystemExit(main())
