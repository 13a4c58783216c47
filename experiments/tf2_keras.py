"""Keras 3 ``fit`` on the testbed, plain and with ``tfmem.keras.MemoryBudget`` (issue 33).

For each model of ``models/keras3.py`` (the mixture of experts with its experts created in the testbed's host
memory, ``tfmem.on_host``), each measurement in a process of its own (a process joins one testbed's
cluster: ``tfmem.testbed.eager``):

1. plain ``fit`` on a roomy device (``--runs`` times): the measured device peak, and the simulator's peak of the
   same traced step (two inter-op threads, the device server's pool here);
2. twins on one roomy device, plain ``fit`` and ``fit`` with ``MemoryBudget`` at the roomy budget, an epoch of
   each in turn (``OVERHEAD_ROUNDS``): the ratio of their median step times, and whether they end identical;
3. at ``--fraction`` of the largest plain peak (0.7; after a refusal 0.8, then 0.9): plain ``fit``
   (out of memory?) and ``fit`` with ``MemoryBudget`` at that budget: its measured peak, and whether history and
   every weight and optimizer slot are bit-identical to plain ``fit`` on the roomy device.

Every ``fit`` is a one-batch warm-up, then ``--repeats`` epochs of three batches, measured.

    python -m experiments.tf2_keras                        # mlp, conv, attention, lstm, moe; 2 runs; 0.7x (0.8x, 0.9x)
    python -m experiments.tf2_keras --model conv --fraction 0.5
    python -m experiments.tf2_keras --tiny                 # CI smoke: the MLP, roomy only, one run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")   # the testbed's client must match its servers

from experiments._common import RESULTS, code_state, load_average, provenance, write
from tfmem.demo_keras import state_digest

MiB = 2**20
DEFAULT_FRACTIONS = [0.7, 0.8, 0.9]
ROOMY_MIB = 1024
CHILD_TIMEOUT_S = 900
OVERHEAD_ROUNDS = 11   # rounds of an epoch of each twin, for the step-time ratio at a roomy budget
OVERHEAD_BATCHES = 12   # steps in each of those epochs
# TensorFlow's own log lines (and the remote-function line it logs as a connected process exits): not the error
TF_LOG_PREFIXES = ("E0000", "W0000", "I0000", "WARNING", "This could happen")


def measure(model_name: str, mode: str, cap_mib: int, repeats: int) -> dict[str, Any]:
    """One measurement (run in a child process) on a testbed of ``cap_mib``: ``fit`` of ``model_name`` (``mode``
    ``plain`` or ``planned``: with ``MemoryBudget``), or a custom training loop (``plain-function``: the step a
    ``tf.function``, ``planned-function``: a ``tfmem.function``)."""
    import tensorflow as tf

    import tfmem
    import tfmem.keras
    from models.keras3 import build
    from tfmem.testbed import Testbed, run_keras_steps_on
    from tfmem.traced import trace

    with Testbed(f"{cap_mib}MiB") as testbed:
        remote = testbed.connect()
        with tf.device(remote.device):
            model, x, y, batch = build(model_name, host=remote.host)
            model.optimizer.build(model.trainable_variables)
        row: dict[str, Any] = {"model": model_name, "mode": mode, "cap_mib": cap_mib}
        planned: Any = None   # the MemoryBudget callback, or the tfmem.function
        custom = mode.endswith("-function")
        if custom:
            step = custom_step(model)
            planned = tfmem.function(step, budget=f"{cap_mib}MiB", device=remote.device, host=remote.host) \
                if mode.startswith("planned") else None
            plain_step = tf.function(step, jit_compile=False)
            y = y.astype(np.int32)
        elif mode == "planned":
            planned = tfmem.keras.MemoryBudget(f"{cap_mib}MiB", device=remote.device, host=remote.host)
        else:
            run_keras_steps_on(model, remote.device)
        if planned is None:   # traced outside any device scope: reads of host variables stay beside them
            concrete = (tf.function(step, jit_compile=False).get_concrete_function(
                tf.constant(x[:batch]), tf.constant(y[:batch])) if custom
                else tf.function(lambda data: model.train_step(data), jit_compile=False)
                .get_concrete_function((tf.constant(x[:batch]), tf.constant(y[:batch]))))
            traced = trace(concrete)
            row["simulated_bytes"] = tfmem.unoptimized_profile(
                traced.graph_def, traced.fetches, device=remote.device, host=remote.host, inter_op_threads=2).peak_bytes
        history: list[list[float]] = []

        def epoch(rows: int) -> None:
            if not custom:
                h = model.fit(x[:rows], y[:rows], batch_size=batch, epochs=1, shuffle=False, verbose=0,
                              callbacks=[planned] if planned is not None else [])
                history.append(h.history["loss"])
                return
            losses = []
            for i in range(0, rows, batch):
                xb, yb = tf.constant(x[i:i + batch]), tf.constant(y[i:i + batch])
                if planned is not None:
                    losses.append(float(planned(xb, yb)))
                else:
                    with tf.device(remote.device):
                        losses.append(float(plain_step(xb, yb)))
            history.append(losses)

        row["resident_bytes"] = remote.in_use()
        result = remote.measure(lambda: epoch(len(x)), warmup=lambda: epoch(batch), repeats=repeats)
        row.update(ending=result.ending, error=result.error, peak_bytes=result.device_peak_bytes,
                   host_peak_bytes=result.host_peak_bytes,
                   step_time_s=result.step_time_s / (len(x) // batch) if result.step_time_s else None,
                   history=history, state=None if result.oom else state_digest(model))   # OOM: servers stopped
        function = planned.step if isinstance(planned, tfmem.keras.MemoryBudget) else planned
        if function is not None and function.plans:
            report = function.report
            row.update(before_bytes=report.before.peak_bytes, after_bytes=report.after.peak_bytes,
                       passes=[p.name for p in report.passes if p.changed])
            # Near the cap the BFC hands out free chunks whole (a 24.5 MiB scratch request can take a 39.7 MiB
            # chunk), so the testbed's peak is compared with the replay on the testbed's capacity too.
            plan = next(iter(function.plans.values()))
            row["after_at_cap_bytes"] = tfmem.simulate(
                plan.optimized.graph_def, plan.traced.fetches, device=remote.device, host=remote.host,
                inter_op_threads=2, device_memory=cap_mib * MiB, config=plan.optimized.config).peak_bytes
    return row


def custom_step(model: Any) -> Any:
    """A custom training step of ``model`` (its compiled loss and optimizer): what a user writes instead of fit."""
    import tensorflow as tf

    def step(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = model.loss(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        model.optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    return step


def overhead(model_name: str, rounds: int) -> dict[str, Any]:
    """Twins on one roomy testbed (run in a child process): plain ``fit`` and ``fit`` with ``MemoryBudget`` at the
    roomy budget, an epoch of each in turn for ``rounds`` rounds after a one-batch warm-up of each."""
    import tensorflow as tf

    import tfmem.keras
    from models.keras3 import build
    from tfmem.testbed import Testbed, run_keras_steps_on

    with Testbed(f"{ROOMY_MIB}MiB") as testbed:
        remote = testbed.connect()
        twins = []
        for _ in range(2):
            with tf.device(remote.device):
                model, x, y, batch = build(model_name, host=remote.host)
                model.optimizer.build(model.trainable_variables)
            twins.append(model)
        run_keras_steps_on(twins[0], remote.device)
        # An epoch of OVERHEAD_BATCHES steps per twin and round: a burst of other work on this shared machine
        # then weighs on a few of its steps, not on the round's whole ratio.
        x, y = np.concatenate([x] * (OVERHEAD_BATCHES * batch // len(x))), np.concatenate(
            [y] * (OVERHEAD_BATCHES * batch // len(y)))
        callbacks: list[list[Any]] = [[], [tfmem.keras.MemoryBudget(f"{ROOMY_MIB}MiB", device=remote.device,
                                                                     host=remote.host)]]
        times: list[list[float]] = [[], []]
        for model, cb in zip(twins, callbacks, strict=True):
            model.fit(x[:batch], y[:batch], batch_size=batch, verbose=0, callbacks=cb)
        for k in range(rounds):
            # Each round times both twins back to back, in alternating order (plain first in even rounds): the
            # ratio is the median of the rounds' own ratios, so the machine's slow drifts cancel.
            for i in ((0, 1) if k % 2 == 0 else (1, 0)):
                remote.sync()
                start = time.perf_counter()
                twins[i].fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=callbacks[i])
                remote.sync()
                times[i].append((time.perf_counter() - start) / (len(x) // batch))
        states = [state_digest(m) for m in twins]
        passes = [p.name for p in callbacks[1][0].report.passes if p.changed]
    ratios = sorted(planned / plain for plain, planned in zip(times[0], times[1], strict=True))
    return {"model": model_name, "mode": "overhead", "plain_step_s": times[0], "planned_step_s": times[1],
            "ratio": statistics.median(ratios), "ratio_quartiles": statistics.quantiles(ratios, n=4)[::2] if len(ratios) > 1 else ratios * 2,
            "identical": states[0] == states[1], "passes": passes}


def _child(model_name: str, mode: str, cap_mib: int, repeats: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "experiments.tf2_keras", "--child", model_name, mode, str(cap_mib), str(repeats)]
    done = subprocess.run(cmd, cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True,
                          timeout=CHILD_TIMEOUT_S)
    if done.returncode != 0:
        said = [ln for ln in done.stderr.splitlines() if ln.strip() and not ln.startswith(TF_LOG_PREFIXES)]
        return {"model": model_name, "mode": mode, "cap_mib": cap_mib, "ending": "failed",
                "error": said[-1][:300] if said else f"exit {done.returncode}"}
    row: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return row


def run_model(model_name: str, runs: int, fractions: list[float], repeats: int, tiny: bool,
              loop: str = "") -> dict[str, Any]:
    """Plain, overhead (for fit) and capped measurements of one model; ``loop`` is "" for fit, "-function" for
    the custom training loop."""
    plain = [_child(model_name, "plain" + loop, ROOMY_MIB, repeats) for _ in range(runs)]
    entry: dict[str, Any] = {"model": model_name, "plain_roomy": plain, "overhead": {} if loop else _child(
        model_name, "overhead", ROOMY_MIB, 1 if tiny else OVERHEAD_ROUNDS)}
    peaks = [r["peak_bytes"] for r in plain if r.get("peak_bytes")]
    if tiny or not peaks:
        return entry
    # The tightest of ``fractions`` (ascending) where plain fit runs out of memory and the planned one runs:
    # a planned run that does not run (refused, out of memory) tries the next, while plain fit still runs out
    # of memory there. The row shows the last budget tried where plain fit ran out of memory.
    entry["tried"] = []
    for fraction in fractions:
        cap = int(max(peaks) * fraction) // MiB
        attempt: dict[str, Any] = {"fraction": fraction, "cap_mib": cap,
                                   "plain_cap": _child(model_name, "plain" + loop, cap, repeats)}
        entry["tried"].append(attempt)
        if attempt["plain_cap"].get("ending") != "oom" and "planned_cap" in entry:
            break
        entry.update(attempt)
        if attempt["plain_cap"].get("ending") != "oom":
            break
        attempt["planned_cap"] = entry["planned_cap"] = _child(model_name, "planned" + loop, cap, repeats)
        if attempt["planned_cap"].get("ending") == "ran":
            break
    return entry


def summary(entry: dict[str, Any]) -> dict[str, Any]:
    """The table's row of one model."""
    plain = [r for r in entry["plain_roomy"] if r.get("peak_bytes")]
    peaks = [r["peak_bytes"] for r in plain]
    simulated = plain[0]["simulated_bytes"] if plain else None
    twins = entry["overhead"]
    row: dict[str, Any] = {
        "model": entry["model"], "plain_peaks_mib": [round(p / MiB, 2) for p in peaks],
        "simulated_mib": round(simulated / MiB, 2) if simulated else None,
        "simulated_over_measured": round(simulated / max(peaks), 3) if simulated and peaks else None,
        "roomy_time_ratio": round(twins["ratio"], 3) if twins.get("ratio") else None,
        "roomy_time_ratio_quartiles": [round(q, 3) for q in twins.get("ratio_quartiles", ())],
        "roomy_identical": bool(twins.get("identical"))}
    if "cap_mib" in entry:
        capped = entry.get("planned_cap", {})
        row.update(fraction=entry["fraction"], cap_mib=entry["cap_mib"], plain_at_cap=entry["plain_cap"].get("ending"),
                   planned_at_cap="refused" if "InfeasibleBudgetError" in (capped.get("error") or "")
                   else capped.get("ending"),
                   planned_peak_mib=round(capped["peak_bytes"] / MiB, 2) if capped.get("peak_bytes") else None,
                   planned_simulated_mib=round(capped["after_bytes"] / MiB, 2) if capped.get("after_bytes") else None,
                   planned_simulated_at_cap_mib=round(capped["after_at_cap_bytes"] / MiB, 2)
                   if capped.get("after_at_cap_bytes") else None,
                   identical_to_roomy_plain=bool(plain) and capped.get("state") == plain[0]["state"]
                   and capped.get("history") == plain[0]["history"],
                   capped_time_ratio=round(capped["step_time_s"] / statistics.median(r["step_time_s"] for r in plain),
                                           3) if plain and capped.get("step_time_s") else None)
    return row


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any], step: str = "fit") -> str:
    title = ("Keras 3 fit on the testbed, plain and with MemoryBudget" if step == "fit" else
             "A custom training loop of Keras 3 models on the testbed, a tf.function and a tfmem.function")
    lines = [f"# {title}\n\n`{meta['command']}` ({meta['date']}, "
             f"load before {meta['load_before']}, after {meta['load_after']})\n",
             "| model | plain peaks (MiB) | simulated (MiB) | sim / measured | roomy: time ratio (quartiles), identical | "
             "budget: fraction, cap (MiB) | plain at cap | planned at cap | planned peak (MiB) | planned simulated (MiB) | "
             "planned simulated on the cap (MiB) | identical | time ratio |", "|" + "---|" * 13]
    for r in rows:
        lines.append(f"| {r['model']} | {', '.join(map(str, r['plain_peaks_mib']))} | {r['simulated_mib']} | "
                     f"{r['simulated_over_measured']} | "
                     + (f"{r['roomy_time_ratio']}x ({'-'.join(map(str, r['roomy_time_ratio_quartiles']))}), "
                        f"{r['roomy_identical']} | " if r["roomy_time_ratio"] is not None else "– | ") +
                     f"{r.get('fraction', '')}, {r.get('cap_mib', '')} | {r.get('plain_at_cap', '')} | {r.get('planned_at_cap', '')} | "
                     f"{r.get('planned_peak_mib', '')} | {r.get('planned_simulated_mib', '')} | "
                     f"{r.get('planned_simulated_at_cap_mib', '')} | {r.get('identical_to_roomy_plain', '')} | {r.get('capped_time_ratio', '')} |")
    lines.append("\nPeaks are the device server's allocator (testbed); simulated peaks are the simulator's for the "
                 "same traced step with two inter-op threads; on the cap: the replay on a device of the cap's size, where the "
                 "allocator hands out free chunks whole as the testbed's does. Roomy time ratio: the median (and quartiles) over "
                 f"{OVERHEAD_ROUNDS} rounds of one round's planned over plain step time (an epoch of {OVERHEAD_BATCHES} steps "
                 "each, fitted in turn, "
                 "the order alternating) "
                 "in one process; at the cap: the planned fit's median step over plain fit's on the roomy device, "
                 "measured in other processes on this shared machine (see the loads).")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from models.keras3 import BUILDERS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", choices=sorted(BUILDERS), help="repeatable; default: all")
    parser.add_argument("--runs", type=int, default=2, help="plain runs on the roomy device")
    parser.add_argument("--fraction", type=float, action="append",
                        help="the budget, of the largest plain peak; repeatable: after a refusal the next larger one "
                             "is tried while plain fit still runs out of memory (default: 0.7, then 0.8, 0.9)")
    parser.add_argument("--repeats", type=int, default=2, help="measured epochs per fit")
    parser.add_argument("--step", choices=["fit", "function"], default="fit",
                        help="fit (plain, and with MemoryBudget) or a custom training loop (tf.function, and "
                             "tfmem.function); results in tf2_keras.md or tf2_function.md")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        name, mode, cap, repeats = args.child
        print(json.dumps(overhead(name, int(repeats)) if mode == "overhead" else measure(name, mode, int(cap),
                                                                                          int(repeats))))
        return 0
    names = ["mlp"] if args.tiny else (args.model or list(BUILDERS))
    runs, repeats = (1, 1) if args.tiny else (args.runs, args.repeats)
    fractions = sorted(args.fraction or DEFAULT_FRACTIONS)
    load_before = load_average()
    entries = []
    for name in names:
        print(f"tf2_keras: {name}", file=sys.stderr, flush=True)
        entries.append(run_model(name, runs, fractions, repeats, args.tiny, "-function" if args.step == "function"
                                 else ""))
    rows = [summary(e) for e in entries]
    meta = provenance(argv, load_before=load_before, load_after=load_average(), fractions=fractions,
                      code=code_state())
    out = ("tf2_keras" if args.step == "fit" else "tf2_function") + ("_tiny" if args.tiny else "")
    write(out, {**meta, "rows": rows, "runs": entries}, markdown(rows, meta, args.step), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
