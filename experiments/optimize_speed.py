"""Benchmark: how long ``tfmem.optimize`` takes on a large graph (target: 20,000 nodes in under 10 s).

Builds a statically unrolled RNN training step of about ``--nodes`` ops and times ``tfmem.load``,
``tfmem.simulate`` and ``tfmem.optimize`` with the partition and limit_parallelism passes (which includes
a simulation before and after; above 10,000 ops they are of the graph as written). Writes
experiments/results/optimize_speed.*, with the machine's load average (timings stretch with it).

    python -m experiments.optimize_speed               # ~20,000 nodes
    python -m experiments.optimize_speed --tiny        # ~2,000 nodes, a smoke run
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfmem
from experiments._common import RESULTS, provenance, write
from tfmem import examples

NODES_PER_STEP = 47  # ops per unrolled step of examples.unrolled_rnn (forward, backward, loss)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.optimize_speed", description=__doc__)
    parser.add_argument("--nodes", type=int, default=20_000, help="approximate graph size")
    parser.add_argument("--tiny", action="store_true", help="about 2,000 nodes")
    parser.add_argument("--repeats", type=int, default=3, help="optimize runs; the table gives the median")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    target = 2_000 if args.tiny else args.nodes
    built = examples.unrolled_rnn(steps=max(2, target // NODES_PER_STEP), batch=8, hidden=64, inputs=32)
    nodes = len(built.graph.as_graph_def().node)
    timings = {}
    t0 = time.perf_counter()
    ir = tfmem.load(built.graph, built.feed_shapes)
    timings["load_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    profile = tfmem.simulate(ir, built.fetches)
    timings["simulate_s"] = time.perf_counter() - t0
    runs = []
    for _ in range(max(1, args.repeats)):
        t0 = time.perf_counter()
        opt = tfmem.optimize(built.graph, built.fetches, passes=["partition", "limit_parallelism"],
                             feed_shapes=built.feed_shapes)
        runs.append(time.perf_counter() - t0)
    timings["optimize_runs_s"] = runs
    timings["optimize_s"] = statistics.median(runs)
    load_avg = os.getloadavg()[0]  # other work on the machine stretches every timing here
    result = provenance(argv, nodes=nodes, **timings, load_average_1min=load_avg,
                        simulated_peak_bytes=profile.peak_bytes,
                        passes=[{"name": p.name, "notes": list(p.notes)} for p in opt.report.passes])
    md = (
        "# tfmem.optimize speed\n\n"
        f"Command: `{result['command']}` ({result['date']}, {result['machine']['cpus']} CPUs, "
        f"1-minute load average {load_avg:.1f} at the end).\n\n"
        "| graph nodes | load | simulate | optimize (partition + limit_parallelism), median | runs |\n"
        "|---:|---:|---:|---:|---|\n"
        f"| {nodes} | {timings['load_s']:.2f} s | {timings['simulate_s']:.2f} s | {timings['optimize_s']:.2f} s "
        f"| {', '.join(f'{r:.2f}' for r in runs)} s |\n\n"
        "`optimize` includes loading the graph, simulating it before and after, and building the returned "
        "`tf.Graph`.\n"
    )
    json_path, md_path = write("optimize_speed", result, md, Path(args.out))
    print(md)
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
