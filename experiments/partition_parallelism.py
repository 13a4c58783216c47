"""Benchmark: partition + limit_parallelism on nonlinear graphs, measured on the testbed.

For each graph and inter-op thread count (1, 2, 8): vanilla vs ``tfmem.optimize(passes=["partition",
"limit_parallelism"])`` -- measured device peak and median step time (testbed), the simulator's peaks, the
chosen ``k`` and whether the outputs are bit-identical. Writes experiments/results/partition_parallelism.*.

    python -m experiments.partition_parallelism            # full run (2-3 minutes on 2 cores)
    python -m experiments.partition_parallelism --tiny     # CI smoke run
"""

from __future__ import annotations

import argparse
import os
from statistics import median

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
from tqdm import tqdm

import tfmem
from experiments._common import RESULTS, provenance, write
from tfmem import examples
from tfmem.testbed import Testbed
from tfmem.units import format_bytes

PASSES = ["partition", "limit_parallelism"]


def graphs(tiny: bool) -> dict[str, examples.Built]:
    if tiny:
        return {"wide-16": examples.wide_branches(branches=16, elems=1 << 14)}
    return {
        "wide-16": examples.wide_branches(branches=16, elems=1 << 18),
        "inception": examples.inception_towers(),
        "inception-big": examples.inception_towers(batch=16, channels=32),
        "unet": examples.unet(),
        "moe-8": examples.moe_layer(experts=8, batch=256),
    }


def measure(tb: Testbed, built: examples.Built, threads: int, steps: int, repeats: int) -> dict[str, object]:
    opt = tfmem.optimize(built.graph, built.fetches, passes=PASSES, feed_shapes=built.feed_shapes,
                         inter_op_threads=threads)
    # partition only tags ops (the tags are stripped at the end): the graph changes only if the limit does
    limit = next(p for p in opt.report.passes if p.name == "limit_parallelism")
    changed = limit.changed
    vanilla_runs, tuned_runs = [], []
    for _ in range(repeats):  # interleaved, so that a busy spell on the machine hits both alike
        vanilla_runs.append(tb.run(built.graph, built.fetches, built.feeds, steps=steps, inter_op_threads=threads))
        tuned_runs.append(tb.run(opt.graph, built.fetches, built.feeds, steps=steps, inter_op_threads=threads))
    same = all(np.array_equal(v.outputs[k], t.outputs[k])
               for v, t in zip(vanilla_runs, tuned_runs, strict=True) for k in v.outputs)
    return {
        "threads": threads, "graph_changed": changed,
        "vanilla_peak_bytes": int(median([r.device_peak_bytes for r in vanilla_runs])),
        "tfmem_peak_bytes": int(median([r.device_peak_bytes for r in tuned_runs])),
        "vanilla_peaks_bytes": [r.device_peak_bytes for r in vanilla_runs],
        "tfmem_peaks_bytes": [r.device_peak_bytes for r in tuned_runs],
        "vanilla_step_s": median([r.step_time_s for r in vanilla_runs]),
        "tfmem_step_s": median([r.step_time_s for r in tuned_runs]),
        "simulated_before_bytes": opt.report.before.peak_bytes, "simulated_after_bytes": opt.report.after.peak_bytes,
        "k": limit.details.get("k"), "control_edges_added": limit.control_edges_added,
        "outputs_identical": same, "oom": any(r.oom for r in vanilla_runs + tuned_runs),
    }


def markdown(result: dict[str, object]) -> str:
    lines = [
        "# partition + limit_parallelism on the testbed", "",
        f"Command: `{result['command']}` ({result['date']}). Peaks: testbed (measured), the median of "
        f"{result['repeats']} runs of each graph, vanilla and tfmem interleaved (each run's peak is the highest of "
        "its steps); step times: medians likewise. 'unchanged': `optimize` found no k worth its edges and "
        "returned the graph as given, so the two columns measure the same graph twice (run-to-run noise).", "",
        "| graph | threads | vanilla peak | tfmem peak | peak ratio | vanilla step | tfmem step | time ratio |"
        " k | identical |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in result["rows"]:  # type: ignore[union-attr]
        ratio = row["vanilla_peak_bytes"] / row["tfmem_peak_bytes"]
        slow = row["tfmem_step_s"] / row["vanilla_step_s"]
        lines.append(
            f"| {row['graph']} | {row['threads']} | {format_bytes(row['vanilla_peak_bytes'])} | "
            f"{format_bytes(row['tfmem_peak_bytes'])} | {ratio:.2f}x | {row['vanilla_step_s'] * 1e3:.1f} ms | "
            f"{row['tfmem_step_s'] * 1e3:.1f} ms | {slow:.2f}x | {row['k'] or ('unchanged' if not row['graph_changed'] else '-')} | "
            f"{'yes' if row['outputs_identical'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.partition_parallelism", description=__doc__)
    parser.add_argument("--tiny", action="store_true", help="small graphs, one thread count: a smoke run")
    parser.add_argument("--repeats", type=int, default=3, help="testbed runs per graph (medians are reported)")
    parser.add_argument("--out", default=str(RESULTS), help="directory for the results files")
    args = parser.parse_args(argv)
    thread_counts = [8] if args.tiny else [1, 2, 8]
    cases = graphs(args.tiny)
    rows = []
    with Testbed("4GiB") as tb:
        for name, built in tqdm(cases.items(), desc="graphs", disable=args.tiny):
            for threads in thread_counts:
                rows.append({"graph": name, **measure(tb, built, threads, steps=2 if args.tiny else 5,
                                                         repeats=1 if args.tiny else max(1, args.repeats))})
    result = provenance(argv, testbed_budget="4GiB", repeats=1 if args.tiny else args.repeats, rows=rows)
    from pathlib import Path
    json_path, md_path = write("partition_parallelism", result, markdown(result), Path(args.out))
    print(markdown(result))
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
