"""Benchmark: the most experts per MoE layer that train on M machines at a fixed per-device budget.

The model is ``models.distributed_moe`` (experts split evenly over the machines, the dense layers data-parallel
with their variables on machine 0), trained on the multi-machine testbed (``Testbed(budget, machines=M)``: each
machine a device capped at ``--budget`` and an uncapped host). For each system and machine count, the largest
number of experts per machine that runs a warm-up and ``--steps`` steps without any device running out of
memory is found by galloping then bisection (``experiments.max_size.search_largest``); the table gives experts
per MoE layer, parameters, each device's measured peak and the step time at that size, and each device's
simulated peak for the same graph (``tfmem.simulate`` with that device and its machine's host, on a device of
the cap's size, as the testbed measures it; the simulator runs every machine's ops in one executor).

Systems (``--system``, repeatable): ``tf`` (the graph as built: plain TensorFlow) and ``tfmem`` (the graph planned
by ``tfmem.optimize(devices={device: its machine's host})`` for the budget; a refusal counts as not fitting, and
where the graph as built fits too, the loss of both is compared), with each ``--dispatch`` given (dense, sparse or
both). A tfmem row's simulated peaks are the plan's own (``report.devices``).

    python -m experiments.distributed_moe                      # plain TF on 4 and 8 machines, dense dispatch
    python -m experiments.distributed_moe --system tfmem --machines 4 --dispatch sparse --start 21
    python -m experiments.distributed_moe --machines 4 --dispatch dense --dispatch sparse
    python -m experiments.distributed_moe --tiny               # smoke run: 2 machines, a small model
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

import tfmem
from experiments._common import RESULTS, load_average, provenance, write
from experiments.max_size import search_largest
from models import distributed_moe
from tfmem.errors import InfeasibleBudgetError, TestbedError
from tfmem.sim.cluster import NETWORKS, cluster_step_s
from tfmem.sim.costmodel import DEVICES
from tfmem.testbed import RunResult, Testbed
from tfmem.testbed.graph import device_name

MiB = 2**20
SYSTEMS = ("tf", "tfmem")
GPU, NETWORK = "V100+PCIe3", "100GbE"   # the cost model's named hardware (tfmem.sim.cluster)
MODEL = {"layers": 2, "moe_every": 2, "d_model": 128, "d_ff": 1024, "heads": 4, "seq": 32, "batch": 16,
         "vocab": 256, "top_k": 2}
TINY = {"layers": 2, "moe_every": 2, "d_model": 64, "d_ff": 512, "heads": 2, "seq": 8, "batch": 4, "vocab": 32,
        "top_k": 2}   # about 1 MiB per expert with its gradient and Adam's slots: 16 MiB devices fill below 32


def probe(tb: Testbed, system: str, machines: int, per_machine: int, dispatch: str, model: dict[str, Any],
          steps: int, budget: int) -> dict[str, Any]:
    """One run of the model with ``per_machine`` experts on each machine: its ending, peaks and step time. For
    ``system="tfmem"`` the graph is first planned with ``tfmem.optimize(devices=...)`` for ``budget`` (a refusal
    ends the probe), and the loss is compared with the graph's own where that fits too."""
    experts = machines * per_machine
    started = time.monotonic()
    built = distributed_moe.build(machines=machines, experts=experts, dispatch=dispatch, **model)
    build_s = time.monotonic() - started
    row: dict[str, Any] = {"system": system, "machines": machines, "experts": experts, "per_machine": per_machine,
                           "params": built.params, "ops": len(built.graph.get_operations()),
                           "build_s": round(build_s, 2)}
    graph, config = built.graph, None
    pairs = {device_name(m): device_name(m, "host") for m in range(machines)}
    if system == "tfmem":
        started = time.monotonic()
        try:
            opt = tfmem.optimize(built.graph, built.fetches, budget=budget, feed_shapes=built.feed_shapes,
                                 devices=pairs)
        except InfeasibleBudgetError as e:
            return {**row, "ending": "refused", "optimize_s": round(time.monotonic() - started, 1),
                    "error": str(e)[:300], "oom_device": None, "step_s": None, "device_peaks_mib": {}}
        row["optimize_s"] = round(time.monotonic() - started, 1)
        row["simulated_mib"] = {d: round(r.after.peak_bytes / MiB, 2) for d, r in opt.report.devices.items()}
        graph, config = opt.graph, opt.config
    try:
        r = tb.run(graph, built.fetches, built.feeds, steps=steps, config=config)
    except TestbedError as e:
        r = RunResult.failed(e)
    row.update({"ending": r.ending, "oom_device": r.oom_device, "error": (r.error or "")[:300],
                "step_s": r.step_time_s,
                "device_peaks_mib": {d: round(b / MiB, 2) for d, b in sorted(r.device_peaks.items())}})
    if r.ran:   # what the same graph would take on the named hardware
        row["estimated_step_s"] = cluster_step_s(graph, built.fetches, pairs, DEVICES[GPU], NETWORKS[NETWORK],
                                                 built.feed_shapes)
    if system == "tfmem" and r.ran:
        try:
            plain = tb.run(built.graph, built.fetches, built.feeds, steps=steps)
        except TestbedError as e:
            plain = RunResult.failed(e)
        row["identical"] = (bool(all(np.array_equal(plain.outputs[k], r.outputs[k]) for k in plain.outputs))
                            if plain.ran else None)   # None: the graph as built does not fit to compare
    return row


def largest(system: str, machines: int, dispatch: str, budget: int, model: dict[str, Any], steps: int, start: int,
            maximum: int) -> dict[str, Any]:
    """The most experts per machine that fit, with every probe on the way."""
    probes: dict[int, dict[str, Any]] = {}
    with Testbed(budget, machines=machines) as tb:
        def fits(per_machine: int) -> bool:
            probes[per_machine] = probe(tb, system, machines, per_machine, dispatch, model, steps, budget)
            print(json.dumps(probes[per_machine]), flush=True)
            return bool(probes[per_machine]["ending"] == "ran")

        best, failed = search_largest(fits, start=min(start, maximum), minimum=1, maximum=maximum)
    at_best = probes.get(best) if best else None
    if system == "tfmem":
        simulated = (at_best or {}).get("simulated_mib", {})
    else:
        simulated = simulated_peaks(machines, best, dispatch, budget, model) if best else {}
    return {"system": system, "dispatch": dispatch, "machines": machines, "per_machine": best,
            "experts": best * machines if best else 0, "first_failing_per_machine": failed,
            "at_best": at_best, "simulated_mib": simulated,
            "probes": [probes[k] for k in sorted(probes)]}


def simulated_peaks(machines: int, per_machine: int, dispatch: str, budget: int,
                    model: dict[str, Any]) -> dict[str, float]:
    """Each device's simulated peak for the graph of ``per_machine`` experts a machine, on a device of
    ``budget`` bytes (its machine's host as the host; the other machines' ops count toward neither)."""
    built = distributed_moe.build(machines=machines, experts=machines * per_machine, dispatch=dispatch, **model)
    peaks = {}
    for m in range(machines):
        profile = tfmem.simulate(built.graph, built.fetches, feed_shapes=built.feed_shapes, device=device_name(m),
                                 host=device_name(m, "host"), inter_op_threads=os.cpu_count() or 1,
                                 device_memory=budget)
        peaks[device_name(m)] = round(profile.peak_bytes / MiB, 2)
    return peaks


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def _identical(row: dict[str, Any]) -> str:
    """Over the probes whose plan ran and whose graph as built fit too: how many gave the same loss."""
    if row["system"] != "tfmem":
        return "(itself)"
    compared = [p["identical"] for p in row["probes"] if p.get("identical") is not None]
    return f"{sum(compared)} of {len(compared)} probes" if compared else "no probe where both fit"


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Distributed MoE: the most experts per MoE layer at a fixed per-device budget",
        "",
        f"Command: `{result['command']}` ({result['date']}; {result['machine']['cpus']} CPUs, load average "
        f"{result['load_average']['1m']} at the end). Instrument: the multi-machine testbed, each device capped at "
        f"{result['budget_mib']} MiB, one warm-up and {result['steps']} step(s) per probe. Model: "
        f"`models.distributed_moe` with {json.dumps(result['model'])}; experts split evenly over the machines. "
        f"Cost model's step: `tfmem.sim.cluster.cluster_step_s` for the graph that ran, each device a "
        f"{DEVICES[GPU].name}, machines joined by {NETWORKS[NETWORK].name}.",
        "",
        "| system | dispatch | machines | experts per MoE layer | parameters | per-device peaks at that size (MiB) "
        "| simulated / measured, per device | step (s) | cost model's step (ms) | first size that did not fit "
        "(experts) | loss identical to the graph's own |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        best = row["at_best"] or {}
        peaks = ", ".join(str(v) for v in best.get("device_peaks_mib", {}).values()) or "-"
        failing = row["first_failing_per_machine"]
        step = best.get("step_s")
        measured = best.get("device_peaks_mib", {})
        ratios = ", ".join(f"{row['simulated_mib'][d] / v:.3f}" for d, v in measured.items()
                           if v and d in row["simulated_mib"]) or "-"
        lines.append(f"| {row['system']} | {row['dispatch']} | {row['machines']} | {row['experts']} | "
                     f"{best.get('params', '-')} | {peaks} | {ratios} | {'-' if step is None else round(step, 3)} | "
                     f"{_ms(best.get('estimated_step_s'))} | "
                     f"{'-' if failing is None else failing * row['machines']} | {_identical(row)} |")
    runs: dict[tuple[str, str], list[str]] = {}
    for row in result["rows"]:
        runs.setdefault((row.get("command", result["command"]), row.get("date", result["date"])), []).append(
            f"{row['system']} {row['dispatch']} on {row['machines']}")
    if len(runs) > 1:   # rows kept by --merge from earlier runs
        lines += ["", "Rows by run:", ""] + [f"- `{command}` ({date}): {', '.join(which)}"
                                           for (command, date), which in runs.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system", choices=SYSTEMS, action="append", help="repeatable; default tf")
    parser.add_argument("--machines", type=int, action="append", help="repeatable; default 4 and 8")
    parser.add_argument("--dispatch", choices=distributed_moe.DISPATCHES, action="append",
                        help="repeatable; default dense")
    parser.add_argument("--budget", type=int, default=48, help="each device's cap, MiB")
    parser.add_argument("--steps", type=int, default=1, help="timed steps per probe (after one warm-up)")
    parser.add_argument("--start", type=int, default=4, help="experts per machine of the first probe")
    parser.add_argument("--max-per-machine", type=int, default=None,
                        help="the search's cap, experts per machine (default 64; 32 with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="2 machines, a small model, 16 MiB devices")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default experiments/results)")
    parser.add_argument("--merge", action="store_true",
                        help="keep the results file's rows of other systems, dispatches and machine counts (each "
                             "row keeps the command and date of its run); the model and budget must match")
    args = parser.parse_args(argv)
    machines = args.machines or ([2] if args.tiny else [4, 8])
    maximum = args.max_per_machine or (32 if args.tiny else 64)
    if min(machines) < 1 or args.budget < 1 or args.steps < 1 or not 1 <= args.start <= maximum:
        parser.error("--machines, --budget and --steps must be at least 1, and 1 <= --start <= --max-per-machine")
    model = TINY if args.tiny else MODEL
    budget = (16 if args.tiny else args.budget) * MiB
    name = "distributed_moe_tiny" if args.tiny else "distributed_moe"
    out = args.out or RESULTS
    kept = merged_rows(out / f"{name}.json", model, budget // MiB, args.steps) if args.merge else []
    run = provenance(argv)
    rows = [{**largest(system, m, dispatch, budget, model, args.steps, args.start, maximum),
             "command": run["command"], "date": run["date"]}
            for system in args.system or ["tf"] for dispatch in args.dispatch or ["dense"] for m in machines]
    ran = {_key(r) for r in rows}
    rows = sorted([r for r in kept if _key(r) not in ran] + rows, key=_key)
    for row in rows:   # a plain row kept from before the cost model's column: its estimate is the graph's
        best = row["at_best"]
        if row["system"] == "tf" and best and best["ending"] == "ran" and best.get("estimated_step_s") is None:
            best["estimated_step_s"] = estimated_step_s(row["machines"], row["per_machine"], row["dispatch"], model)
    result = {**run, "load_average": load_average(), "budget_mib": budget // MiB, "steps": args.steps,
              "model": model, "rows": rows}
    write(name, result, markdown(result), out)
    return 0


def estimated_step_s(machines: int, per_machine: int, dispatch: str, model: dict[str, Any]) -> float:
    """The cost model's step for the graph as built (a plain row's; every tfmem probe records its plan's)."""
    built = distributed_moe.build(machines=machines, experts=machines * per_machine, dispatch=dispatch, **model)
    pairs = {device_name(m): device_name(m, "host") for m in range(machines)}
    return cluster_step_s(built.graph, built.fetches, pairs, DEVICES[GPU], NETWORKS[NETWORK], built.feed_shapes)


def _key(row: dict[str, Any]) -> tuple[int, str, int]:
    return SYSTEMS.index(row["system"]), row["dispatch"], row["machines"]


def merged_rows(path: Path, model: dict[str, Any], budget_mib: int, steps: int) -> list[dict[str, Any]]:
    """The rows of an earlier results file to keep beside this run's (``--merge``), each with its own command and
    date; none when there is no file, and ``SystemExit`` when its model, budget or steps differ from this run's."""
    if not path.exists():
        return []
    earlier = json.loads(path.read_text())
    if (earlier["model"], earlier["budget_mib"], earlier["steps"]) != (model, budget_mib, steps):
        raise SystemExit(f"--merge: {path} was run with another model, budget or step count; run without --merge")
    return [{"command": earlier["command"], "date": earlier["date"], **r} for r in earlier["rows"]]


if __name__ == "__main__":
    sys.exit(main())
