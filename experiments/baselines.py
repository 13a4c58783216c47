"""Table: TensorFlow's own memory optimizer vs tfmem auto, per model, under the same budgets (issue 6).

The graphs and budgets are those of ``experiments.peak_memory``: each benchmark model at its small size, vanilla
measured on a roomy testbed (peak ``P``, step time, fetched values), budget ``B = --fraction x P``. Under a
testbed capped at ``B`` the unchanged graph runs with each of Grappler's ``RewriterConfig.memory_optimization``
settings (default, SWAPPING_HEURISTICS, RECOMPUTATION_HEURISTICS, SCHEDULING_HEURISTICS, HEURISTICS), and
tfmem's ``optimize(passes="auto", budget=B)`` graph runs too. A row records OOM or not, the measured peak, the
step time and its ratio to vanilla's, and whether the fetched values equal vanilla's. Each TF setting also runs
on the roomy testbed, so that its own peak shows even where it does not fit ``B``. The cost model's step time
on a named GPU + link is given for vanilla and tfmem; TF's settings rewrite the graph inside the session, where
the cost model does not see it.

    python -m experiments.baselines              # full run (10-15 minutes on 2 shared cores)
    python -m experiments.baselines --tiny       # CI smoke run (one small graph)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tqdm import tqdm

from experiments._common import (
    DEFAULT_FRACTION,
    FRACTIONS,
    NAMED_GPU,
    RESULTS,
    budget_at,
    code_state,
    fmt_run,
    fmt_same,
    fraction_for,
    load_average,
    provenance,
    run_on,
    run_record,
    table_models,
    write,
)
from experiments.peak_memory import ROOMY, gpu_step, optimize_row
from tfmem.testbed import Testbed
from tfmem.units import format_bytes

_RC = rewriter_config_pb2.RewriterConfig
TF_SETTINGS: dict[str, int] = {
    "TF default (= vanilla)": _RC.DEFAULT_MEM_OPT,
    "TF SWAPPING_HEURISTICS": _RC.SWAPPING_HEURISTICS,
    "TF RECOMPUTATION_HEURISTICS": _RC.RECOMPUTATION_HEURISTICS,
    "TF SCHEDULING_HEURISTICS": _RC.SCHEDULING_HEURISTICS,
    "TF HEURISTICS": _RC.HEURISTICS,
}
TFMEM = "tfmem auto"


def tf_memory_optimizer(mode: int) -> config_pb2.ConfigProto:
    """A session config with Grappler's memory optimizer set to ``mode`` (everything else default)."""
    config = config_pb2.ConfigProto()
    config.graph_options.rewrite_options.memory_optimization = mode
    return config


def budgets_from(path: Path, fraction: float | None) -> dict[str, int]:
    """The per-model budgets an ``experiments.peak_memory`` results file used where it used the same fractions."""
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return {name: m["budget_bytes"] for name, m in data.get("models", {}).items()
            if "budget_bytes" in m and m.get("fraction") == fraction_for(name, fraction)}


def run_model(name: str, built: Any, fraction: float, steps: int, progress: Any,
              budget: int | None = None, roomy_settings: bool = True) -> dict[str, Any]:
    """Every TF setting on a roomy testbed and under ``budget`` (default ``fraction`` x vanilla's peak), and
    tfmem auto under it."""
    start = time.perf_counter()
    progress.set_postfix_str(f"{name}: roomy")
    roomy: dict[str, Any] = {}
    with Testbed(ROOMY, step_timeout_s=120.0) as tb:
        vanilla = run_on(tb, built.graph, built, steps)
        if not vanilla.ran:
            return {"error": f"vanilla failed on a {ROOMY} testbed: {vanilla.error}"}
        for label, mode in TF_SETTINGS.items():
            if mode == _RC.DEFAULT_MEM_OPT or roomy_settings:
                run = vanilla if mode == _RC.DEFAULT_MEM_OPT else run_on(
                    tb, built.graph, built, steps, tf_memory_optimizer(mode))
                roomy[label] = run_record(run, vanilla)
    source = "peak_memory results" if budget else f"{fraction} x this run's vanilla peak"
    budget = budget or budget_at(vanilla.device_peak_bytes, fraction)
    progress.set_postfix_str(f"{name}: optimize for {format_bytes(budget)}")
    opt, rows_tfmem = optimize_row(built, budget, "auto")
    rows: dict[str, dict[str, Any]] = {}
    progress.set_postfix_str(f"{name}: testbed at {format_bytes(budget)}")
    with Testbed(budget, step_timeout_s=120.0) as tb:
        for label, mode in TF_SETTINGS.items():
            rows[label] = run_record(run_on(tb, built.graph, built, steps, tf_memory_optimizer(mode)), vanilla)
            if label in roomy:
                rows[label]["roomy"] = roomy[label]
        if opt is not None:
            rows_tfmem.update(run_record(run_on(tb, opt.graph, built, steps, opt.config), vanilla))
            rows_tfmem["gpu_estimate"] = gpu_step(opt.graph, built)
    rows[TFMEM] = rows_tfmem
    return {"nodes": len(built.graph.as_graph_def().node), "fraction": fraction, "budget_bytes": budget,
            "budget_source": source,
            "vanilla_roomy": {**run_record(vanilla, vanilla), "gpu_estimate": gpu_step(built.graph, built)},
            "rows": rows, "load_after": load_average(), "elapsed_s": time.perf_counter() - start}


def _gpu(est: dict[str, Any] | None) -> str:
    return f"{est['low_s'] * 1e3:.2f}–{est['high_s'] * 1e3:.2f} ms" if est else "n/a"


def _step(r: dict[str, Any]) -> str:
    if not r.get("step_s"):
        return "-"
    return f"{r['step_s'] * 1e3:.1f} ms ({r['step_vs_vanilla']:.2f}x)"


def markdown(result: dict[str, Any]) -> str:
    prov = result["provenance"]
    lines = [
        "# Baselines: TensorFlow's memory optimizer vs tfmem auto",
        "",
        f"Command: `{prov['command']}` ({prov['date']}; TF {prov['versions']['tensorflow']}; "
        f"{prov['machine']['cpus']} cores, load average {prov['load_before']} before the run, shared with other "
        "agents' jobs, so step times are noisy). Code: commit "
        f"{(prov['code']['commit'] or '?')[:10]}"
        + (f", with uncommitted changes to {', '.join(prov['code']['uncommitted'])}" if prov["code"]["uncommitted"]
           else "") + ".",
        "",
        "Same graphs and budgets as `experiments.peak_memory`: budget = the stated fraction of vanilla's measured "
        f"testbed peak ({result['fraction']}), rounded down to whole MiB"
        + (f" (taken from `{Path(result['budgets_from']).name}`)" if result.get("budgets_from") else
           " (measured in this run)") + ". 'at budget': run on a testbed whose device allocator is capped "
        "at the budget; 'roomy': the same setting under a 1 GiB cap (its own peak, whether or not it fits the "
        f"budget). Step: median of {result['steps']} timed steps, and its ratio to vanilla's (roomy). "
        f"{NAMED_GPU}: the cost model's step time (transfers overlapped – not), an estimate; n/a for TF's settings, "
        "which rewrite the graph inside the session. 'same outputs': bit-identical to vanilla's (roomy).",
        "",
        "| model (budget) | setting | at budget | step | same outputs | roomy peak | roomy step "
        f"| {NAMED_GPU} (est.) |",
        "|---|---|---|---:|---|---:|---:|---|",
    ]
    for name, m in result["models"].items():
        if "error" in m:
            lines.append(f"| {name} | {m['error']} | | | | | | |")
            continue
        head = f"{name} ({format_bytes(m['budget_bytes'])}, {m['fraction']}x)"
        v = m["vanilla_roomy"]
        lines.append(f"| {head} | vanilla, roomy | {format_bytes(v['peak_bytes'])} | {_step(v)} | - | | "
                     f"| {_gpu(v.get('gpu_estimate'))} |")
        for label, r in m["rows"].items():
            if "refused" in r:
                lines.append(f"| | {label} | refused (lower bound {format_bytes(r['lower_bound_bytes'])}, best "
                             f"{format_bytes(r['best_peak_bytes'])} sim) | | | | | |")
                continue
            rm = r.get("roomy")
            lines.append(f"| | {label} | {fmt_run(r)} | {_step(r)} | {fmt_same(r)} "
                         f"| {fmt_run(rm) if rm else ''} | {_step(rm) if rm else ''} "
                         f"| {_gpu(r.get('gpu_estimate')) if label == TFMEM else 'n/a'} |")
    lines += ["", "Summary: which settings ran within the budget", ""]
    for name, m in result["models"].items():
        if "rows" in m:
            ran = [k for k, r in m["rows"].items() if "refused" not in r and not r.get("oom")]
            lines.append(f"- {name}: {', '.join(ran) if ran else 'none'}")
    lines += ["", "Errors (OOM messages and refusals):", ""]
    for name, m in result["models"].items():
        for label, r in m.get("rows", {}).items():
            if r.get("error") or "refused" in r:
                lines.append(f"- {name} {label}: {(r.get('error') or r.get('refused'))[:300]}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true",
                        help="one small graph; TF's settings run under the budget only, not also roomy (CI smoke)")
    parser.add_argument("--fraction", type=float, default=None,
                        help=f"budget as a fraction of vanilla's peak (default {DEFAULT_FRACTION}; {FRACTIONS})")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per testbed run")
    parser.add_argument("--budgets-from", default=None,
                        help="an experiments.peak_memory results file whose per-model budgets to use (default: "
                             "results/peak_memory.json when it exists and used the same --fraction; --tiny: none)")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    if args.fraction is not None and not 0 < args.fraction < 1:
        parser.error("--fraction must be in (0, 1)")
    start = time.perf_counter()
    result: dict[str, Any] = {
        "provenance": provenance(argv, load_before=load_average(), code=code_state()), "steps": args.steps,
        "fraction": args.fraction if args.fraction is not None else {"default": DEFAULT_FRACTION, **FRACTIONS},
        "testbed_budget": "a fraction (models.*.fraction) of vanilla's measured peak per model, rounded down to "
                          "whole MiB (models.*.budget_bytes), as in peak_memory",
        "settings": {k: _RC.MemOptType.Name(v) for k, v in TF_SETTINGS.items()}, "models": {}}
    source = Path(args.budgets_from) if args.budgets_from else None if args.tiny else RESULTS / "peak_memory.json"
    budgets = budgets_from(source, args.fraction) if source else {}
    result["budgets_from"] = str(source) if budgets else None
    progress = tqdm(table_models(args.tiny).items(), desc="models", unit="model")
    for name, built in progress:
        result["models"][name] = run_model(name, built, fraction_for(name, args.fraction), args.steps, progress,
                                           budgets.get(name), roomy_settings=not args.tiny)
    result["elapsed_s"] = time.perf_counter() - start
    result["provenance"]["load_after"] = load_average()
    name = "baselines_tiny" if args.tiny else "baselines"
    paths = write(name, result, markdown(result), Path(args.out))
    print(markdown(result))
    print("wrote", *paths)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
