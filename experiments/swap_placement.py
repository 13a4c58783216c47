"""Benchmark: fitting training graphs under a budget where vanilla runs out of memory (issue 4).

For each training graph: measure vanilla on the testbed with room to spare (peak ``P``, step time, outputs);
then at a budget of ``--fraction`` x ``P`` run vanilla, TensorFlow's own memory optimizer
(``RewriterConfig.memory_optimization``: swapping heuristics, and its default heuristics), and
``tfmem.optimize(budget=...)`` (all passes: partition, limit_parallelism, place_persistent,
swap_activations). Recorded: OOM or not, measured device peak, median step time, whether tfmem's outputs
equal vanilla's, and Grappler's virtual-GPU estimate of both graphs. A second budget, where vanilla fits
(``--fits`` x ``P``), records tfmem's step time there.

    python -m experiments.swap_placement             # full run (~10 minutes on 2 cores)
    python -m experiments.swap_placement --tiny      # CI smoke run (one small graph)
"""

from __future__ import annotations

import argparse
import math
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tqdm import tqdm

import tfmem
from experiments._common import RESULTS, provenance, testbed_run, write
from tfmem import examples
from tfmem.measure import grappler_peak
from tfmem.testbed import DEVICE, HOST, RunResult, Testbed
from tfmem.units import format_bytes

MiB = 2**20
ROOMY = "1GiB"


def graphs(tiny: bool) -> dict[str, examples.Built]:
    if tiny:
        return {"mlp-small": examples.mlp(batch=256, dims=(256, 1024, 1024, 10))}
    from models import moe_transformer, resnet

    return {
        "deep MLP (7 layers, Adam)": examples.mlp(batch=256, dims=(1024,) + (1536,) * 6 + (10,), optimizer="adam"),
        "resnet-20 bottleneck (batch 16)": resnet.build(depth=20, batch=16, image=32),
        "residual convnet": examples.residual_convnet(batch=32, size=32, channels=48, blocks=3),
        "unrolled RNN (24 steps)": examples.unrolled_rnn(steps=24, batch=128, hidden=1024, inputs=256),
        "MoE transformer (16 experts)": moe_transformer.build(experts=16, d_model=128, d_ff=512),
    }


def tf_memory_optimizer(mode: int) -> config_pb2.ConfigProto:
    config = config_pb2.ConfigProto()
    config.graph_options.rewrite_options.memory_optimization = mode
    return config


TF_MODES = {
    "TF swapping heuristics": rewriter_config_pb2.RewriterConfig.SWAPPING_HEURISTICS,
    "TF heuristics": rewriter_config_pb2.RewriterConfig.HEURISTICS,
}


def run_graph(built: examples.Built, fractions: list[float], fits: float, steps: int,
              tiny: bool) -> dict[str, object]:
    """Try the budget fractions in order; keep the first at which tfmem runs (or the last tried).

    A fraction at which vanilla itself fits ends the ladder: larger ones would not show anything.
    """
    with Testbed(ROOMY) as tb:
        vanilla = tb.run(built.graph, list(built.fetches), built.feeds, steps=steps)
    tried = []
    row: dict[str, object] = {}
    for fraction in fractions:
        row = run_case(built, vanilla, fraction, fits, steps, tiny)
        t = row["tfmem"]
        outcome = ("refused" if "refused" in t else "error" if t.get("error") else "OOM" if t.get("oom")  # type: ignore[union-attr]
                   else "ran")
        vanilla_fit = "vanilla" in row and not row["vanilla"]["oom"]  # type: ignore[index]
        tried.append({"fraction": fraction, "budget_bytes": row["budget_bytes"], "tfmem": outcome,
                      "vanilla": "fits" if vanilla_fit else "OOM" if "vanilla" in row else "-",
                      "detail": t.get("refused") or t.get("error")})  # type: ignore[union-attr]
        if outcome == "ran" or vanilla_fit:
            break
    row["ladder"] = tried
    return row


def run_case(built: examples.Built, vanilla: RunResult, fraction: float, fits: float, steps: int,
             tiny: bool) -> dict[str, object]:
    fetches, feeds = list(built.fetches), built.feeds
    peak = vanilla.device_peak_bytes or 0
    budget = max(int(peak * fraction) // MiB, 2) * MiB
    row: dict[str, object] = {"vanilla_roomy_peak_bytes": peak, "vanilla_roomy_step_s": vanilla.step_time_s,
                              "budget_bytes": budget, "fraction": fraction}
    try:
        opt = tfmem.optimize(built.graph, fetches, budget=budget, feed_shapes=built.feed_shapes,
                             device=DEVICE, host=HOST)
    except tfmem.InfeasibleBudgetError as e:
        row["tfmem"] = {"refused": str(e).split(";")[0], "lower_bound_bytes": e.lower_bound_bytes}
        return row
    row["simulated_bytes"] = {"vanilla": opt.report.before.peak_bytes, "tfmem": opt.report.after.peak_bytes}
    row["passes"] = {p.name: list(p.notes) for p in opt.report.passes if p.changed}
    with Testbed(budget, step_timeout_s=120.0) as tb:
        runs = {"vanilla": tb.run(built.graph, fetches, feeds, steps=steps)}
        if not tiny:
            for label, mode in TF_MODES.items():
                runs[label] = tb.run(built.graph, fetches, feeds, steps=steps, config=tf_memory_optimizer(mode))
    runs["tfmem"] = testbed_run(budget, opt.graph, built, steps)   # a crashed server is a recorded failure
    for label, r in runs.items():
        row[label] = {"oom": r.oom, "error": r.error, "peak_bytes": r.device_peak_bytes, "step_s": r.step_time_s}
    with Testbed(ROOMY) as tb:
        roomy = tb.run(opt.graph, fetches, feeds, steps=steps)
    row["outputs_identical"] = bool(vanilla.outputs) and all(
        np.array_equal(vanilla.outputs[k], roomy.outputs[k]) for k in vanilla.outputs)
    # Estimated on a virtual GPU large enough to hold either (Grappler refuses graphs above its device's
    # memory); "fits a device of the budget's size" is then estimate <= budget.
    row["grappler_gpu_estimate_bytes"] = {
        "vanilla": grappler_peak(built.graph, fetches, memory=ROOMY),
        "tfmem": grappler_peak(opt.graph_def, fetches, memory=ROOMY, host=HOST),
    }
    # Where vanilla fits: tfmem should leave the graph (nearly) alone, and cost little time.
    fit_budget = math.ceil(peak * fits / MiB) * MiB
    opt_fit = tfmem.optimize(built.graph, fetches, budget=fit_budget, feed_shapes=built.feed_shapes,
                             device=DEVICE, host=HOST)
    with Testbed(fit_budget) as tb:
        base = tb.run(built.graph, fetches, feeds, steps=steps)
        tuned = tb.run(opt_fit.graph, fetches, feeds, steps=steps, config=opt_fit.config)
    row["fits"] = {"budget_bytes": fit_budget, "vanilla_step_s": base.step_time_s, "tfmem_step_s": tuned.step_time_s,
                   "tfmem_oom": tuned.oom, "changed": [p.name for p in opt_fit.report.passes if p.changed]}
    return row


def markdown(result: dict[str, object]) -> str:
    lines = [
        "# Swap and placement: training under a budget where vanilla runs out of memory",
        "",
        f"Command: `{result['provenance']['command']}`. Budget: the first of {result['fractions']} x vanilla's "
        "measured peak (testbed) at which tfmem runs; every fraction tried is listed below the table. Peaks: testbed allocator (measured); 'sim' = tfmem simulator; Grappler = Grappler's "
        "virtual-GPU estimate. Step time: median testbed wall time.",
        "",
        "| graph | budget | vanilla | TF swapping | TF heuristics | tfmem | tfmem sim | tfmem step / vanilla roomy "
        "| identical outputs | Grappler vanilla / tfmem (tfmem fits where vanilla does not) "
        "| where vanilla fits: tfmem/vanilla step |",
        "|---|---:|---|---|---|---|---:|---:|---|---|---:|",
    ]

    def cell(r: dict | None) -> str:
        if not r:
            return "-"
        return "OOM" if r["oom"] else f"{format_bytes(r['peak_bytes'])}"

    for name, row in result["graphs"].items():
        t = row.get("tfmem", {})
        if "refused" in t:
            lines.append(f"| {name} | {format_bytes(row['budget_bytes'])} | | | | refused: {t['refused']} | | | | | |")
            continue
        slow = (f"{t['step_s'] / row['vanilla_roomy_step_s']:.2f}x" if t.get("step_s") else "-")
        g = row["grappler_gpu_estimate_bytes"]
        fit = row["fits"]
        fit_ratio = (f"{fit['tfmem_step_s'] / fit['vanilla_step_s']:.2f}x" if fit["tfmem_step_s"] else "OOM")
        lines.append(
            f"| {name} | {format_bytes(row['budget_bytes'])} | {cell(row['vanilla'])} "
            f"| {cell(row.get('TF swapping heuristics'))} | {cell(row.get('TF heuristics'))} | {cell(t)} "
            f"| {format_bytes(row['simulated_bytes']['tfmem'])} | {slow} | {row['outputs_identical']} "
            f"| {format_bytes(g['vanilla'])} / {format_bytes(g['tfmem'])} ({g['tfmem'] < g['vanilla']}) "
            f"| {fit_ratio} |")
    lines += ["", "Budgets tried, in order:", ""]
    for name, row in result["graphs"].items():
        lines.append(f"- {name}: " + "; ".join(
            f"{a['fraction']}x = {format_bytes(a['budget_bytes'])}: vanilla {a['vanilla']}, tfmem {a['tfmem']}"
            + (f" ({a['detail']})" if a.get("detail") and a["tfmem"] != "ran" else "")
            for a in row.get("ladder", [])))
    lines += ["", "What each pass did:", ""]
    for name, row in result["graphs"].items():
        for p, notes in row.get("passes", {}).items():
            lines.append(f"- {name}, `{p}`: " + "; ".join(notes))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="one small graph, no TF-optimizer runs (CI smoke)")
    parser.add_argument("--fraction", default="0.7,0.8,0.9",
                        help="budgets as fractions of vanilla's peak, tried in order until tfmem runs")
    parser.add_argument("--fits", type=float, default=1.15, help="budget where vanilla fits, x its peak")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    try:
        fractions = [float(f) for f in args.fraction.split(",") if f.strip()]
    except ValueError:
        parser.error(f"--fraction takes comma-separated numbers, got {args.fraction!r}")
    if not fractions or not all(0 < f < 1 for f in fractions) or args.fits <= 1:
        parser.error("--fraction values must be in (0, 1) and --fits above 1")
    cases = graphs(args.tiny)
    result: dict[str, object] = {"provenance": provenance(argv), "fractions": fractions, "graphs": {}}
    for name, built in tqdm(cases.items(), desc="graphs", unit="graph"):
        result["graphs"][name] = run_graph(built, fractions, args.fits, args.steps, args.tiny)
    from pathlib import Path

    paths = write("swap_placement_tiny" if args.tiny else "swap_placement", result, markdown(result), Path(args.out))
    print(markdown(result))
    print("wrote", *paths)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
