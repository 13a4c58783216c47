"""How close the simulator's device peak is to the testbed's measured one (one inter-op thread).

For each graph: the median measured peak over five runs (TF times ops and runs cheap ones inline, so ops near
that threshold can change the order between runs), the simulator's peak and Grappler's estimate for a 12 GiB
virtual GPU. One more row is a planned graph (the U-Net that ``tfmem.optimize`` rewrote for a 56 MiB budget: swaps
to the host, recomputation) measured on a testbed capped at 80 MiB: near its cap TF's BFC hands out free chunks
whole (a 33.75 MiB scratch took a 59.8 MiB chunk), so that peak depends on the capacity and is compared with
``simulate(..., device_memory=80 MiB)``; the simulator's unbounded peak is given beside it. Writes
experiments/results/simulator_accuracy.*.

    python -m experiments.simulator_accuracy           # fifteen graphs, about a minute and a half
    python -m experiments.simulator_accuracy --tiny    # two small graphs
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tqdm import tqdm

import tfmem
from experiments._common import RESULTS, provenance, write
from tfmem import examples
from tfmem.measure import grappler_peak
from tfmem.testbed import DEVICE, HOST, Testbed
from tfmem.units import format_bytes


def graphs(tiny: bool) -> dict[str, examples.Built]:
    if tiny:
        return {"mlp": examples.mlp(batch=16, dims=(64, 256, 10)), "rnn": examples.unrolled_rnn(steps=4)}
    return {
        "mlp-sgd": examples.mlp(batch=64, dims=(784, 1024, 1024, 10)),
        "mlp-adam": examples.mlp(batch=128, dims=(512, 1024, 1024, 1024, 10), optimizer="adam"),
        "mlp-momentum-wide": examples.mlp(batch=128, dims=(512, 2048, 2048, 2048, 10), optimizer="momentum"),
        "conv-residual-branches": examples.residual_convnet(),
        "conv-residual-64px": examples.residual_convnet(channels=16, size=64),
        "inception-towers": examples.inception_towers(),
        "unet-skips": examples.unet(),
        "wide-16-branches": examples.wide_branches(branches=16, elems=1 << 18),
        "unrolled-rnn": examples.unrolled_rnn(),
        "unrolled-rnn-adam": examples.unrolled_rnn(steps=24, hidden=384, optimizer="adam"),
        "moe-16-experts": examples.moe_layer(experts=16, batch=128),
        # Unrolled RNNs (steps x batch x hidden, 256 inputs, as in experiments/planner.py) whose peak depends on
        # the order TF gives the many readers of the shared weights, which differs from run to run.
        "rnn-8x256x512": examples.unrolled_rnn(steps=8, batch=256, hidden=512, inputs=256),
        "rnn-24x64x512": examples.unrolled_rnn(steps=24, batch=64, hidden=512, inputs=256),
        "rnn-24x256x128": examples.unrolled_rnn(steps=24, batch=256, hidden=128, inputs=256),
        "rnn-24x256x512": examples.unrolled_rnn(steps=24, batch=256, hidden=512, inputs=256),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.simulator_accuracy", description=__doc__)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    rows = []
    with Testbed("4GiB", inter_op_threads=1, intra_op_threads=1) as tb:
        for name, built in tqdm(graphs(args.tiny).items(), desc="graphs", disable=args.tiny):
            runs = [tb.run(built.graph, built.fetches, built.feeds, steps=1).device_peak_bytes for _ in range(5)]
            measured = int(statistics.median(runs))
            simulated = tfmem.simulate(built.graph, built.fetches).peak_bytes
            grappler = grappler_peak(built.graph, built.fetches, memory="12GiB")
            rows.append({"graph": name, "measured_bytes": measured, "measured_runs": runs,
                         "simulated_bytes": simulated, "grappler_bytes": grappler,
                         "simulated_over_measured": simulated / measured})
    if not args.tiny:
        rows.append(planned_row())
    result = provenance(argv, testbed_budget="4GiB", inter_op_threads=1, rows=rows)
    lines = ["# Simulator vs testbed (device peak, one inter-op thread)", "",
             f"Command: `{result['command']}` ({result['date']}). Measured: testbed, median of 5 runs.", "",
             "| graph | measured (testbed) | simulated | sim / measured | Grappler estimate (12 GiB GPU) |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['graph']} | {format_bytes(r['measured_bytes'])} | {format_bytes(r['simulated_bytes'])} | "
              f"{r['simulated_over_measured']:.3f} | "
              f"{format_bytes(r['grappler_bytes']) if r['grappler_bytes'] else 'n/a'} |" for r in rows]
    planned = [r for r in rows if "unbounded_simulated_bytes" in r]
    lines += [f"\n{r['graph']}: measured and simulated for a device of {format_bytes(r['device_memory_bytes'])}; "
              f"without a capacity the simulator says {format_bytes(r['unbounded_simulated_bytes'])} (live bytes; "
              "the BFC splits every chunk when the region is unbounded)." for r in planned]
    md = "\n".join(lines) + "\n"
    json_path, md_path = write("simulator_accuracy", result, md, Path(args.out))
    print(md)
    print(f"wrote {json_path} and {md_path}")
    return 0


PLANNED_BUDGET = "56MiB"
PLANNED_DEVICE_MEMORY = 80 << 20


def planned_row() -> dict:
    """The U-Net planned for ``PLANNED_BUDGET`` (device and host of the testbed), run on an 80 MiB testbed."""
    built = examples.unet(batch=8, size=64, channels=16, levels=3)
    opt = tfmem.optimize(built.graph, built.fetches, budget=PLANNED_BUDGET, device=DEVICE, host=HOST,
                         inter_op_threads=1)
    with Testbed(PLANNED_DEVICE_MEMORY, inter_op_threads=1, intra_op_threads=1) as tb:
        runs = [tb.run(opt.graph_def, built.fetches, built.feeds, steps=1).device_peak_bytes for _ in range(5)]
    measured = int(statistics.median(runs))
    simulated = tfmem.simulate(opt.graph_def, built.fetches, device=DEVICE, host=HOST, inter_op_threads=1,
                               device_memory=PLANNED_DEVICE_MEMORY).peak_bytes
    return {"graph": f"unet-planned-{PLANNED_BUDGET} @ {format_bytes(PLANNED_DEVICE_MEMORY)} device",
            "measured_bytes": measured, "measured_runs": runs, "simulated_bytes": simulated,
            "grappler_bytes": None, "simulated_over_measured": simulated / measured,
            "device_memory_bytes": PLANNED_DEVICE_MEMORY,
            "unbounded_simulated_bytes": opt.report.after.peak_bytes}


if __name__ == "__main__":
    raise SystemExit(main())
