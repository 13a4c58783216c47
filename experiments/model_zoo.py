"""Benchmark: the TF-Slim and tf_keras model zoos as a new user meets them (issue 32).

Two stages per model (``models.zoo.catalog``: every network of ``tf_slim.nets`` and ``tf_keras.applications``,
each a training step as its zoo builds it, fused batch norm and the zoo's loss included):

* **load**: build the step, simulate it as the session runs it (``tfmem.unoptimized_profile``) and measure it on
  an uncapped testbed, ``--runs`` times (2); the simulated peak over the largest measured one, or the error that
  stopped it.
* **plan** (``--plan`` models): at each fraction of the measured peak, whether vanilla runs out of memory in a
  testbed of that size; ``tfmem.optimize``'s answer (accepted, or refused with its lower bound), its time and
  the memory it took (the process's resident set, sampled); the plan's measured peak in a testbed of exactly the
  budget, its step time over vanilla's (uncapped, same run), and whether its fetched values equal vanilla's bit
  for bit, or, when not, what the report said about it (a difference the report does not announce is "silent").

Runs of some models replace their rows in the results file; the others keep theirs (each row has its command
and date). Writes experiments/results/model_zoo.{json,md}.

    python -m experiments.model_zoo                      # every network of both zoos loads; the issue's 6 plan
    python -m experiments.model_zoo --families --no-plan # one network per family (25) loads
    python -m experiments.model_zoo --no-plan --resume   # the networks a cut-short run did not reach
    python -m experiments.model_zoo --model keras/MobileNetV2 --plan keras/MobileNetV2 --fractions 0.5
    python -m experiments.model_zoo --tiny               # one small network: loads, and plans at 0.7x
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import threading
import time
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfmem
from experiments._common import (
    RESULTS,
    budget_at,
    fmt_run,
    load_average,
    provenance,
    run_record,
    testbed_run,
    write,
)
from models import zoo
from tfmem.errors import InfeasibleBudgetError, TfmemError
from tfmem.testbed import DEVICE, HOST
from tfmem.units import format_bytes

# One network per family (the rest differ in depth or width): what ``--families`` loads.
FAMILIES = ("slim/alexnet_v2", "slim/inception_v1", "slim/inception_v2", "slim/inception_v3", "slim/overfeat",
            "slim/resnet_v1_50", "slim/resnet_v2_50", "slim/vgg_16",
            "keras/ConvNeXtTiny", "keras/DenseNet121", "keras/EfficientNetB0", "keras/EfficientNetV2B0",
            "keras/InceptionResNetV2", "keras/InceptionV3", "keras/MobileNet", "keras/MobileNetV2",
            "keras/MobileNetV3Small", "keras/NASNetMobile", "keras/RegNetX002", "keras/RegNetY002",
            "keras/ResNet50", "keras/ResNet50V2", "keras/ResNetRS50", "keras/VGG16", "keras/Xception")
# The six networks issue 32 was reported on: what plans by default.
PLANNED = ("slim/resnet_v1_50", "slim/inception_v3", "slim/vgg_16", "keras/ResNet50", "keras/MobileNetV2",
           "keras/DenseNet121")
TINY = "keras/VGG16"
UNCAPPED = 16 * 2**30
STEPS = 2          # timed steps per testbed run (after one warm-up): three updates before values are compared
SIM_TOLERANCE = 0.10


class _PeakRss:
    """The largest resident set of this process while the block runs, sampled every 50 ms (Linux)."""

    def __enter__(self) -> _PeakRss:
        self.peak = self.start = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self._rss())

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def load_row(entry: zoo.Entry, runs: int = 2) -> tuple[dict[str, Any], Any, Any]:
    """The load stage of one network: its row, the built step and vanilla's uncapped run (None when it failed)."""
    row: dict[str, Any] = {"model": entry.name, "size": entry.size, "batch": entry.batch}
    started = time.perf_counter()
    try:
        built = entry.build()
    except Exception as e:   # a network that does not build at this size is the zoo's limit, not tfmem's
        return {**row, "error": f"does not build: {type(e).__name__}: {str(e).splitlines()[0][:200]}"}, None, None
    row.update(build_s=round(time.perf_counter() - started, 1), ops=len(built.graph.as_graph_def().node),
               params=built.params)
    started = time.perf_counter()
    try:
        profile = tfmem.unoptimized_profile(built.graph, built.fetches, device=DEVICE, host=HOST)
        row.update(simulated_bytes=profile.peak_bytes, simulate_s=round(time.perf_counter() - started, 1),
                   # function calls (tf_keras compiles grouped convolutions with XLA) whose memory is not modelled
                   opaque_ops=sum(n.startswith("opaque op") for n in profile.notes))
    except TfmemError as e:
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    vanilla = testbed_run(UNCAPPED, built.graph, built, steps=STEPS, step_timeout_s=900)
    row["vanilla"] = run_record(vanilla, vanilla)
    if not vanilla.device_peak_bytes:
        return row, built, None
    # A second run: is vanilla reproducible (Grappler's AddN sums in arrival order), and how far does its peak
    # move? With two inter-op threads it is a draw: NASNetMobile peaked at 74 MiB in 1 run of 5, 95.5 in the rest.
    more = [testbed_run(UNCAPPED, built.graph, built, steps=STEPS, step_timeout_s=900) for _ in range(runs - 1)]
    row["vanilla_again"] = run_record(more[0], vanilla)
    row["more_peaks"] = [r.device_peak_bytes for r in more[1:]]
    row["vanilla_deterministic"] = all(run_record(r, vanilla)["outputs_equal_vanilla"] for r in more)
    row["measured_peak_bytes"] = max([vanilla.device_peak_bytes] + [r.device_peak_bytes or 0 for r in more])
    if "simulated_bytes" in row:
        row["sim_over_measured"] = round(row["simulated_bytes"] / row["measured_peak_bytes"], 4)
    return row, built, vanilla


def plan_rows(name: str, built: Any, vanilla: Any, measured_peak: int, fractions: list[float],
              deterministic: bool | None) -> list[dict[str, Any]]:
    rows = []
    for fraction in fractions:
        budget = budget_at(measured_peak, fraction)
        row: dict[str, Any] = {"model": name, "fraction": fraction, "budget_bytes": budget,
                               "vanilla_at_budget": testbed_run(budget, built.graph, built, steps=1).ending}
        started = time.perf_counter()
        with _PeakRss() as rss, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                opt = tfmem.optimize(built.graph, built.fetches, budget=budget, device=DEVICE, host=HOST)
            except InfeasibleBudgetError as e:
                opt, row["refused"] = None, {"lower_bound_bytes": e.lower_bound_bytes,
                                             "best_peak_bytes": e.best_peak_bytes, "why": str(e).splitlines()[0]}
            except TfmemError as e:
                opt, row["error"] = None, f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        row.update(optimize_s=round(time.perf_counter() - started, 1),
                   optimize_rss_bytes=rss.peak - rss.start,
                   warnings=[str(w.message)[:300] for w in caught if issubclass(w.category, UserWarning)])
        if opt is not None:
            row.update(accepted=True, plan_peak_bytes=opt.report.after.peak_bytes,
                       search=opt.report.search.summary() if opt.report.search else None,
                       notes=list(opt.report.notes))
            planned = testbed_run(budget, opt.graph, built, steps=STEPS, step_timeout_s=900, config=opt.config)
            row["planned"] = run_record(planned, vanilla)
            row["values"] = _values(row, deterministic)
        else:
            row["accepted"] = False
        rows.append(row)
        print(f"  {name} {fraction}x: {outcome(row)}", flush=True)
    return rows


def _values(row: dict[str, Any], deterministic: bool | None) -> str:
    same = row["planned"]["outputs_equal_vanilla"]
    if same is None:
        return "-"
    if same:
        return "identical"
    said = [n for n in row.get("notes", []) if "may differ" in n]
    if said:
        return "differs (the report says which may: " + said[0][:160] + ")"
    if deterministic is False:
        return "differs (vanilla differs from itself)"
    return "differs, SILENT"


def outcome(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"error: {r['error']}"
    if not r["accepted"]:
        return f"refused (lower bound {format_bytes(r['refused']['lower_bound_bytes'] or 0)})"
    return f"accepted, measured {fmt_run(r['planned'])}"


def _measured(r: dict[str, Any]) -> str:
    """Both runs' peaks (rows from before the second run was recorded have one)."""
    again = r.get("vanilla_again")
    more = "".join(f", {format_bytes(p)}" if p else ", -" for p in r.get("more_peaks", []))
    return fmt_run(r["vanilla"]) + (f", {fmt_run(again)}" if again else "") + more


def markdown(result: dict[str, Any]) -> str:
    runs = sorted({(r.get("date", "?"), r.get("command", "?")) for r in result["load"] + result["plan"]})
    lines = ["# The model zoos as a new user meets them", "",
             "Commands: " + "; ".join(f"`{c}` ({d})" for d, c in runs) + f" ({result['machine']['cpus']} CPUs, load "
             f"average {result['load_average']['1m']} at the end of the last). Each network is a training step as its "
             "zoo builds it (`models/zoo.py`: fused batch norm; TF-Slim's TF1 loss, `create_train_op` and Momentum; "
             "tf_keras' loss and Adam). Measured peaks are the testbed's; simulated ones tfmem's simulator "
             "(`tfmem.unoptimized_profile`, what `tfmem analyze` prints).", "",
             "## Load and simulate", "",
             "| network | image, batch | ops | simulated | measured (testbed, each run) | sim / largest measured | "
             "opaque calls | "
             "vanilla repeats itself |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in result["load"]:
        if "ops" not in r or "simulated_bytes" not in r:
            lines.append(f"| {r['model']} | {r['size']}, {r['batch']} | {r.get('ops', '-')} | {r.get('error')} | "
                         f"{fmt_run(r.get('vanilla'))} | | | |")
            continue
        ratio = r.get("sim_over_measured")
        flag = "" if ratio is None or abs(ratio - 1) <= SIM_TOLERANCE else " (outside ±10%)"
        det = {True: "yes", False: "no", None: "-"}[r.get("vanilla_deterministic")]
        lines.append(f"| {r['model']} | {r['size']}, {r['batch']} | {r['ops']} | "
                     f"{format_bytes(r['simulated_bytes'])} | {_measured(r)} | "
                     f"{ratio if ratio is not None else '-'}{flag} | {r.get('opaque_ops', '-')} | {det} |")
    within = [r for r in result["load"] if r.get("sim_over_measured") is not None]
    ok = sum(abs(r["sim_over_measured"] - 1) <= SIM_TOLERANCE for r in within)
    lines += ["", f"{ok} of {len(within)} simulated peaks within ±10% of the measured one; "
              f"{sum('error' in r for r in result['load'])} networks stopped with an error.", "",
              "## Planned at fractions of the measured peak", "",
              "| network | budget | vanilla at the budget | tfmem | optimize time, memory | step vs vanilla | "
              "values |", "|---|---|---|---|---:|---:|---|"]
    for r in result["plan"]:
        step = (r.get("planned") or {}).get("step_vs_vanilla")
        lines.append(f"| {r['model']} | {r['fraction']}x ({format_bytes(r['budget_bytes'])}) | "
                     f"{r['vanilla_at_budget']} | {outcome(r)} | {r['optimize_s']} s, "
                     f"{format_bytes(r['optimize_rss_bytes'])} | {f'{step:.2f}x' if step else '-'} | "
                     f"{r.get('values', '-')} |")
    accepted = [r for r in result["plan"] if r.get("accepted")]
    ooms = [r for r in accepted if (r.get("planned") or {}).get("oom")]
    named = ", ".join(f"{r['model']} {r['fraction']}x" for r in ooms)
    failed = [r for r in accepted if (r.get("planned") or {}).get("ending") not in ("ran", "oom")]
    networks = len({r["model"] for r in result["plan"]})
    lines += ["", f"{networks} networks planned: {len(accepted)} accepted plans, {len(ooms)} of them out of memory "
              f"on the testbed" + (f" ({named})" if ooms else "") + f", {len(failed)} failed otherwise"
              + "".join(f" ({r['model']} {r['fraction']}x)" for r in failed) + "; "
              f"{sum(not r.get('accepted') for r in result['plan'])} refused."]
    medians = []
    for fraction in sorted({r["fraction"] for r in accepted}, reverse=True):
        steps = sorted(r["planned"]["step_vs_vanilla"] for r in accepted
                       if r["fraction"] == fraction and (r.get("planned") or {}).get("step_vs_vanilla"))
        if steps:
            medians.append(f"{fraction}x: {statistics.median(steps):.2f}x over {len(steps)}")
    if medians:
        lines += ["", "Step time against vanilla's, median over the accepted plans that ran: " + "; ".join(medians)
                  + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.model_zoo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", help="load only these networks (repeatable; see --list)")
    parser.add_argument("--families", action="store_true", help="load one network per family (25), not all")
    parser.add_argument("--plan", action="append", help="plan these networks (repeatable; default: the issue's 6)")
    parser.add_argument("--no-plan", action="store_true", help="the load stage only")
    parser.add_argument("--runs", type=int, default=2,
                        help="testbed runs per network in the load stage (at least 2); the largest peak counts")
    parser.add_argument("--resume", action="store_true",
                        help="load only the networks that have no row in the results file yet (after a cut-short run)")
    parser.add_argument("--fractions", default="0.7,0.5,0.35", help="budgets as fractions of the measured peak")
    parser.add_argument("--list", action="store_true", help="print the networks and exit")
    parser.add_argument("--tiny", action="store_true", help=f"{TINY}: loads, and plans at 0.7x")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    if not zoo.available():
        parser.error("tf_slim and tf_keras are not installed: `make` installs them (requirements-zoo.lock)")
    catalog = zoo.catalog()
    if args.list:
        print("\n".join(f"{e.name} ({e.size}x{e.size}, batch {e.batch})" for e in catalog.values()))
        return 0
    if args.tiny:
        loads, plans, fractions = [TINY], [TINY], [0.7]
    else:
        plans = [] if args.no_plan else (args.plan or list(PLANNED))
        loads = list(dict.fromkeys((args.model or (list(FAMILIES) if args.families else list(catalog))) + plans))
        fractions = [float(f) for f in args.fractions.split(",")]
    previous = Path(args.out) / f"{'model_zoo_tiny' if args.tiny else 'model_zoo'}.json"
    old = json.loads(previous.read_text()) if previous.exists() else {"load": [], "plan": []}
    if args.resume:
        done = {r["model"] for r in old["load"]}
        loads = [m for m in loads if m not in done or m in plans]
    if args.runs < 2:
        parser.error(f"--runs must be at least 2 (one more run tells whether vanilla repeats itself), got {args.runs}")
    unknown = [m for m in loads if m not in catalog]
    if unknown:
        parser.error(f"unknown network(s) {', '.join(unknown)}: --list names them")
    name = "model_zoo_tiny" if args.tiny else "model_zoo"
    # each budget search's attempts as they end: on the large networks a search takes many minutes
    progress = logging.StreamHandler()
    progress.setFormatter(logging.Formatter("    %(asctime)s %(message)s", "%H:%M:%S"))
    logging.getLogger("tfmem.search").addHandler(progress)
    logging.getLogger("tfmem.search").setLevel(logging.INFO)
    run = provenance(argv)
    stamp = {"command": run["command"], "date": run["date"]}
    # A run replaces a network's rows once it has redone them (so a run cut short keeps the old rows of the
    # networks it did not reach), and only the plan rows of the budgets it runs.
    load, plan = list(old["load"]), list(old["plan"])
    for model in loads:
        row, built, vanilla = load_row(catalog[model], args.runs)
        load = [r for r in load if r["model"] != model] + [{**row, **stamp}]
        if model in plans:
            plan = [r for r in plan if r["model"] != model or r["fraction"] not in fractions]
        print(f"{model}: {row.get('ops', '-')} ops, sim/measured {row.get('sim_over_measured', '-')}"
              f"{', ' + row['error'] if 'error' in row else ''}", flush=True)
        if model in plans and vanilla is not None:
            plan += [{**r, **stamp} for r in plan_rows(model, built, vanilla, row["measured_peak_bytes"], fractions,
                                                       row.get("vanilla_deterministic"))]
        order = list(catalog)
        load.sort(key=lambda r: order.index(r["model"]))
        plan.sort(key=lambda r: (order.index(r["model"]), -r["fraction"]))
        result = provenance(argv, load_average=load_average(), load=load, plan=plan)
        paths = write(name, result, markdown(result), Path(args.out))
    print(f"wrote {paths[0]} and {paths[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
