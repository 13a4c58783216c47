"""Benchmark: at budgets the unmodified graph already runs in, ``optimize``'s result against the graph itself.

A memory planner must never lose to doing nothing. For each graph and each budget (whole MiB, on a testbed capped
there): the unmodified graph with the executor's default inter-op pool and with one thread (does it run, and its
step time), and what ``optimize(budget=...)`` returns (kept as it is, kept with one thread, a plan, or a
refusal; its step time run with ``Optimized.config``). The runs of one budget share one testbed and are
interleaved over ``--rounds`` rounds, so that a slow stretch of the shared machine hits them alike; a step time is
the median over rounds of each round's median step. Written to ``experiments/results/budget_met.{json,md}``.

    python -m experiments.budget_met             # DeepSpeech at 44 and 45 MiB, an MLP at 14-16 MiB (~15 minutes)
    python -m experiments.budget_met --tiny      # CI smoke: a small MLP at two budgets, one round
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tensorflow.core.protobuf import config_pb2
from tqdm import tqdm

import tfmem
from experiments._common import RESULTS, load_average, provenance, run_on, write
from tfmem import examples
from tfmem.testbed import DEVICE, HOST, Testbed

MiB = 2**20


def cases(tiny: bool) -> dict[str, tuple[Any, list[int]]]:
    """Graph name -> (built graph, budgets in MiB). The budgets sit at and just above the smallest cap on which
    the unmodified graph runs on the testbed (``experiments/results/allocator_fit.md``)."""
    if tiny:
        return {"mlp-784-1024-10": (examples.mlp(dims=(784, 1024, 10)), [9, 12])}
    from models import deepspeech

    return {
        "deepspeech": (deepspeech.build(seq_len=16, batch=16, freq=64, hidden=128), [44, 45]),
        "mlp": (examples.mlp(), [14, 15, 16]),
    }


def _outcome(opt: tfmem.Optimized) -> str:
    if not opt.report.passes:
        return "kept, one thread" if opt.config.inter_op_parallelism_threads == 1 else "kept"
    return "plan"


def measure(built: Any, budget_mib: int, rounds: int) -> dict[str, Any]:
    budget = budget_mib * MiB
    row: dict[str, Any] = {"budget_bytes": budget}
    started = time.perf_counter()
    runs: dict[str, tuple[Any, Any]] = {}
    try:
        opt = tfmem.optimize(built.graph, list(built.fetches), budget=budget, feed_shapes=built.feed_shapes,
                             device=DEVICE, host=HOST)
        row.update(optimize=_outcome(opt), optimize_s=time.perf_counter() - started,
                   simulated_peak_bytes=opt.report.after.peak_bytes)
        runs["tfmem"] = (opt.graph, opt.config)
    except tfmem.InfeasibleBudgetError as e:
        row.update(optimize="refused", optimize_s=time.perf_counter() - started, refusal=str(e)[:300])
    one = config_pb2.ConfigProto(inter_op_parallelism_threads=1)
    runs = {"unmodified": (built.graph, None), "unmodified, one thread": (built.graph, one), **runs}
    steps: dict[str, list[float]] = {k: [] for k in runs}
    endings: dict[str, str] = {}
    peaks: dict[str, int | None] = {}
    with Testbed(budget, step_timeout_s=120) as tb:
        for r in range(rounds):
            labels = list(runs)
            for label in labels[r % len(labels):] + labels[:r % len(labels)]:
                if endings.get(label, "ran") != "ran":
                    continue
                graph, config = runs[label]
                result = run_on(tb, graph, built, 3, config)
                endings[label] = result.ending
                if result.ran:
                    steps[label].append(result.step_time_s)
                    peaks[label] = max(peaks.get(label) or 0, result.device_peak_bytes or 0)
    row["runs"] = {label: {"ending": endings[label], "step_s": statistics.median(steps[label]) if steps[label] else None,
                           "measured_peak_bytes": peaks.get(label)} for label in runs}
    return row


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Budgets the unmodified graph meets: optimize's result against the graph itself",
        "",
        f"Command: `{result['command']}` ({result['date']}; TF {result['versions']['tensorflow']}; "
        f"{result['machine']['cpus']} cores, load average {result['load_average']} before the run). Testbed capped "
        f"at the budget; {result['rounds']} interleaved round(s) of 3 timed steps each; step = median over rounds. "
        "Peaks: testbed allocator (measured). `optimize` is given `device=` and `host=`.",
        "",
        "| graph | budget | unmodified (default pool) | unmodified (one thread) | optimize returns | its step | "
        "vs unmodified | optimize time |",
        "|---|---:|---|---|---|---:|---:|---:|",
    ]

    def cell(r: dict[str, Any] | None) -> str:
        if r is None:
            return "-"
        if r["ending"] != "ran":
            return r["ending"]
        return f"ran, {r['step_s'] * 1e3:.1f} ms, peak {r['measured_peak_bytes'] / MiB:.1f} MiB"

    for name, rows in result["graphs"].items():
        for row in rows:
            runs = row["runs"]
            mine = runs.get("tfmem")
            base = next((runs[k] for k in ("unmodified", "unmodified, one thread") if runs[k]["ending"] == "ran"),
                        None)
            ratio = (f"{mine['step_s'] / base['step_s']:.2f}x" if mine and base and mine["ending"] == "ran"
                     else "-")
            lines.append(f"| {name} | {row['budget_bytes'] // MiB} MiB | {cell(runs['unmodified'])} | "
                         f"{cell(runs['unmodified, one thread'])} | {row['optimize']} | {cell(mine)} | {ratio} | "
                         f"{row['optimize_s']:.1f} s |")
    lines += ["", "`vs unmodified`: optimize's step over the unmodified graph's, default pool where it ran, else one "
              "thread."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CI smoke run: a small MLP at two budgets, one round")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds per budget (default 5; --tiny 1)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    rounds = args.rounds or (1 if args.tiny else 5)
    chosen = cases(args.tiny)
    result = provenance(argv, rounds=rounds, load_average=load_average())
    result["graphs"] = {}
    with tqdm(total=sum(len(b) for _, b in chosen.values()), desc="budget_met", unit="budget") as bar:
        for name, (built, budgets) in chosen.items():
            result["graphs"][name] = []
            for mib in budgets:
                bar.set_postfix_str(f"{name} at {mib} MiB")
                result["graphs"][name].append(measure(built, mib, rounds))
                bar.update(1)
    write("budget_met_tiny" if args.tiny else "budget_met", result, markdown(result), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
