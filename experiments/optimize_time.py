"""Benchmark: how long one ``tfmem.optimize`` call takes per graph and budget, and the work its search did.

Per graph, vanilla's peak is measured on an uncapped testbed; then ``optimize`` plans for ``--fractions`` of it
(default 0.7, 0.5 and 0.35), ``--repeats`` times each. The table gives the median time, whether the budget was
accepted, and the budget search's counts (``tfmem.search.SearchLog``): attempts, replans, simulations (and
Grappler rewrites among them), CBC runs and allocator-layout replays; and whether every repeat returned the same GraphDef bytes (the search is bounded
by counts, so it must). Results are written after every graph.

Graphs: the project's examples and models, an unrolled RNN of about 20,000 ops (simulated as written), and,
when installed (``pip install --no-deps tf-slim==1.1.0 tf-keras==2.21.0``), TF-Slim's ResNet-50 v1 and
tf_keras' MobileNetV2 (``models/zoo.py``).

    python -m experiments.optimize_time                    # every graph, 3 repeats
    python -m experiments.optimize_time --graph resnet50-slim --repeats 1
    python -m experiments.optimize_time --tiny             # the MLP at 0.55x, once: a smoke run
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfmem
from experiments._common import RESULTS, load_average, provenance, testbed_run, write
from models import moe_transformer, zoo
from tfmem import examples
from tfmem.errors import InfeasibleBudgetError
from tfmem.examples import Built
from tfmem.testbed import DEVICE, HOST

# name -> builder; the zoo graphs only where their packages are installed
GRAPHS: dict[str, Callable[[], Built]] = {
    "mlp": lambda: examples.mlp(batch=1024, dims=(512, 2048, 2048, 2048, 10), optimizer="momentum"),
    "convnet": lambda: examples.residual_convnet(batch=8, size=32, channels=32, blocks=3),
    "unet": lambda: examples.unet(batch=4, size=64, channels=16, levels=3),
    "moe-transformer": lambda: moe_transformer.build(experts=4, layers=2, d_model=64, d_ff=128, heads=2, seq=32,
                                                     batch=8, vocab=256),
    "rnn-20k": lambda: examples.unrolled_rnn(steps=425, batch=8, hidden=64, inputs=32),
    "resnet50-slim": lambda: zoo.slim_resnet50(batch=8, size=64),
    "mobilenetv2-keras": lambda: zoo.keras_mobilenet_v2(batch=16, size=96),
}
ZOO = {"resnet50-slim", "mobilenetv2-keras"}
UNCAPPED = 16 * 2**30


def measure(name: str, built: Built, fractions: list[float], repeats: int) -> list[dict[str, Any]]:
    """One row per fraction of vanilla's measured peak."""
    vanilla = testbed_run(UNCAPPED, built.graph, built, steps=1, step_timeout_s=600)
    if vanilla.oom or not vanilla.device_peak_bytes:
        return [{"graph": name, "error": f"vanilla did not run: {vanilla.error}"}]
    ops = len(built.graph.as_graph_def().node)
    rows = []
    for fraction in fractions:
        budget = int(vanilla.device_peak_bytes * fraction)
        times, digests, outcome = [], [], None
        for _ in range(repeats):
            started = time.perf_counter()
            try:
                opt = tfmem.optimize(built.graph, built.fetches, budget=budget, feed_shapes=built.feed_shapes,
                                     device=DEVICE, host=HOST)
                log, accepted, peak = opt.report.search, True, opt.report.after.peak_bytes
                digests.append(hashlib.sha256(opt.graph_def.SerializeToString(deterministic=True)).hexdigest())
            except InfeasibleBudgetError as e:
                log, accepted, peak = e.search, False, e.best_peak_bytes
                digests.append("refused")
            times.append(time.perf_counter() - started)
            outcome = (log, accepted, peak)
        assert outcome is not None
        log, accepted, peak = outcome
        rows.append({
            "graph": name, "ops": ops, "vanilla_peak_bytes": vanilla.device_peak_bytes, "fraction": fraction,
            "budget_bytes": budget, "times_s": [round(t, 2) for t in times], "median_s": statistics.median(times),
            "accepted": accepted, "plan_peak_bytes": peak, "identical_repeats": len(set(digests)) == 1,
            "attempts": len(log.attempts) if log else None, "replans": log.replans if log else None,
            "simulations": log.simulations if log else None,
            "grappler_rewrites": log.grappler_rewrites if log else None,
            "solver_calls": log.solver_calls if log else None,
            "layout_checks": log.layout_checks if log else None,
            "search": [a.line() for a in log.attempts] if log else [],
        })
        print(f"{name} {fraction}: {statistics.median(times):.1f} s, "
              f"{'accepted' if accepted else 'refused'}, {log.summary() if log else ''}", flush=True)
    return rows


def markdown(result: dict[str, Any]) -> str:
    runs = sorted({(r.get("date", "?"), r.get("command", "?")) for r in result["rows"]})
    lines = ["# How long optimize takes", "",
             "Commands: " + "; ".join(f"`{c}` ({d})" for d, c in runs) + f" ({result['machine']['cpus']} CPUs, "
             f"load average {result['load_average']['1m']} at the end of the last). Budgets are fractions of "
             "vanilla's peak measured on the "
             "testbed; times are the median of the repeats (all of them in the JSON); counts are the search's "
             "(`tfmem.search.SearchLog`), the same on every repeat; \"refused unplanned\": the lower bound alone "
             "exceeds the budget less its margin, so nothing was tried.", "",
             "| graph | ops | budget | optimize (median) | repeats | outcome | attempts | replans | simulations "
             "(Grappler rewrites) | solver calls | layout replays | same GraphDef every repeat |",
             "|---|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['graph']} | | | | | {r['error']} | | | | | | |")
            continue
        outcome = "accepted" if r["accepted"] else "refused" if r["attempts"] is not None else "refused unplanned"
        counts = ("- | - | - | - | -" if r["attempts"] is None else
                  f"{r['attempts']} | {r['replans']} | {r['simulations']} ({r['grappler_rewrites']}) | "
                  f"{r['solver_calls']} | {r['layout_checks']}")
        lines.append(
            f"| {r['graph']} | {r['ops']} | {r['fraction']:.2f}x ({r['budget_bytes'] / 2**20:.1f} MiB) | "
            f"{r['median_s']:.1f} s | {len(r['times_s'])} | {outcome} | {counts} | "
            f"{'yes' if r['identical_repeats'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.optimize_time", description=__doc__)
    parser.add_argument("--graph", action="append", choices=sorted(GRAPHS), help="only these graphs (repeatable)")
    parser.add_argument("--fractions", default="0.7,0.5,0.35", help="budgets as fractions of vanilla's peak")
    parser.add_argument("--repeats", type=int, default=3, help="optimize calls per budget; the table gives the median")
    parser.add_argument("--tiny", action="store_true", help="the MLP at 0.55x, once")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    if args.tiny:
        names, fractions, repeats = ["mlp"], [0.55], 1
    else:
        names = args.graph or [n for n in GRAPHS if n not in ZOO or zoo.available()]
        fractions, repeats = [float(f) for f in args.fractions.split(",")], max(1, args.repeats)
    name = "optimize_time_tiny" if args.tiny else "optimize_time"
    run = provenance(argv)
    rows: list[dict[str, Any]] = []
    previous = Path(args.out) / f"{name}.json"
    if args.graph and previous.exists():
        # a run of some graphs replaces their rows; the others keep theirs (each row says its command and date)
        rows = [r for r in json.loads(previous.read_text())["rows"] if r["graph"] not in names]
    for graph in names:
        rows += [{**r, "command": run["command"], "date": run["date"]}
                 for r in measure(graph, GRAPHS[graph](), fractions, repeats)]
        rows.sort(key=lambda r: list(GRAPHS).index(r["graph"]))
        result = provenance(argv, load_average=load_average(), rows=rows)
        paths = write(name, result, markdown(result), Path(args.out))
    print(f"wrote {paths[0]} and {paths[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
