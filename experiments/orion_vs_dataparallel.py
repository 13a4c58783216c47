"""orion_par 2D (DSGD, no conflicts) vs data-parallel SGD on the parameter server: epochs and time to target RMSEs.

The same ratings, initial factors, learning rate and regularisation for every method, all per-rating SGD.
``serial``: the serial loop (``sgd_serial_numba`` over the ratings in data order), the yardstick that
defines the targets.  ``orion_par 2D``: the serial loop body under ``@parallel_for`` (2D plan), 2 worker
threads, one epoch per ``run``.  ``data-parallel s=k``: the standard SSP data-parallel SGD of
``ssp_vs_bsp`` on ``orion_par.ps`` (2 workers, each owning a random half of the ratings; each clock one
mini-batch of it, read from the server, SGD on the worker's copy, the changes sent as increments;
staleness ``k``; real compute, no straggler, no bandwidth limit).

Targets are chosen from the serial run, not tuned: the training RMSE serial SGD reaches after ``N``
epochs, for each ``N`` in ``TARGET_EPOCHS``.  Epochs to a target are whole epochs for every method (a
data-parallel run is looked at after its last clock of each epoch).  Two learning rates: 0.01 (as in
``ssp_vs_bsp``; serial SGD still descends at 15 epochs) and 0.03 (serial SGD reaches its noise floor in
about 4 epochs, so later targets differ from each other by less than the plateau's order-dependent noise).
Run: ``python -m experiments.orion_vs_dataparallel`` or ``--tiny``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from experiments.ssp_vs_bsp import MF_FULL, MF_TINY, machine, mf_problem, run_setting, versions, write
from models.mf import parallel_sgd, sgd_serial_numba
from orion_par import DistArray
from orion_par.ps import ClientOptions

TARGET_EPOCHS = {"full": (2, 4, 6, 8, 10, 12), "tiny": (1, 2, 3)}
LRS = {"full": (0.01, 0.03), "tiny": (0.03,)}


def serial_curve(problem: dict[str, Any], cfg: dict[str, Any]) -> dict[str, list[float]]:
    W, H = problem["init"]["W"].copy(), problem["init"]["H"].copy()
    keys, values = np.ascontiguousarray(problem["keys"]), np.ascontiguousarray(problem["values"])
    sgd_serial_numba(keys[:1], values[:1], W.copy(), H.copy(), cfg["lr"], cfg["reg"])  # compile before timing
    curve: dict[str, list[float]] = {"epoch": [0], "time_s": [0.0], "loss": [problem["loss"]({"W": W, "H": H})]}
    spent = 0.0
    for e in range(cfg["epochs"]):
        t0 = time.perf_counter()
        sgd_serial_numba(keys, values, W, H, cfg["lr"], cfg["reg"])
        spent += time.perf_counter() - t0
        curve["epoch"].append(e + 1)
        curve["time_s"].append(round(spent, 4))
        curve["loss"].append(problem["loss"]({"W": W, "H": H}))
    return curve


def orion_curve(problem: dict[str, Any], cfg: dict[str, Any]) -> dict[str, list[float]]:
    W = DistArray(problem["init"]["W"].copy())
    H = DistArray(problem["init"]["H"].copy())
    from models.mf import synthetic_ratings

    ratings = synthetic_ratings(cfg["users"], cfg["items"], cfg["ratings"], cfg["rank"], seed=0).ratings
    sgd = parallel_sgd(ratings, W, H, lr=cfg["lr"], reg=cfg["reg"])
    sgd.run(workers=cfg["workers"], epochs=0)  # compile before timing
    curve: dict[str, list[float]] = {"epoch": [0], "time_s": [0.0], "loss": [problem["loss"]({"W": W, "H": H})]}
    spent = 0.0
    for e in range(cfg["epochs"]):
        t0 = time.perf_counter()
        sgd.run(workers=cfg["workers"], epochs=1)
        spent += time.perf_counter() - t0
        curve["epoch"].append(e + 1)
        curve["time_s"].append(round(spent, 4))
        curve["loss"].append(problem["loss"]({"W": W, "H": H}))
    return curve


def dp_curve(problem: dict[str, Any], cfg: dict[str, Any], staleness: int) -> dict[str, list[float]]:
    run = run_setting(problem, staleness, ClientOptions(), "none")
    # Whole epochs only, as for orion_par (a run there is at least one epoch), so epochs compare like for like.
    keep = [i for i, c in enumerate(run["clock"]) if c % cfg["batches"] == 0]
    return {"epoch": [run["clock"][i] // cfg["batches"] for i in keep], "time_s": [run["time_s"][i] for i in keep],
            "loss": [run["loss"][i] for i in keep]}


def first(curve: dict[str, list[float]], target: float, key: str) -> float | None:
    for x, loss in zip(curve[key], curve["loss"], strict=True):
        if loss <= target:
            return float(x)
    return None


def crossing(curve: dict[str, list[float]], target: float) -> float | None:
    """Fractional epochs to ``target``, interpolating linearly between the epochs around its first crossing.

    Whole epochs turn a 0.1% difference into a whole epoch; this says by how much a method is early or late.

    >>> crossing({"epoch": [0, 1, 2], "loss": [1.0, 0.6, 0.2]}, 0.5)
    1.25
    """
    xs, ys = curve["epoch"], curve["loss"]
    for i, loss in enumerate(ys):
        if loss <= target:
            if i == 0:
                return float(xs[0])
            return float(xs[i - 1] + (ys[i - 1] - target) / (ys[i - 1] - loss) * (xs[i] - xs[i - 1]))
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.orion_vs_dataparallel", description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--lr", type=float, default=None, help="one SGD learning rate (default: 0.01 and 0.03)")
    args = ap.parse_args(argv)
    size = "tiny" if args.tiny else "full"
    base = dict(MF_TINY if args.tiny else MF_FULL, workers=2, clock_s=None, epochs=4 if args.tiny else 15)
    record: dict[str, Any] = {"command": "python -m experiments.orion_vs_dataparallel " + " ".join(argv or sys.argv[1:]),
                              "date": datetime.datetime.now().isoformat(timespec="seconds"), "versions": versions(),
                              "machine": machine(), "tiny": args.tiny, "parameters": base, "runs": {}}
    lrs = (args.lr,) if args.lr else LRS[size]
    with tqdm(total=4 * len(lrs), desc="orion_vs_dataparallel", disable=None) as bar:
        for lr in lrs:
            record["runs"][str(lr)] = compare(dict(base, lr=lr), TARGET_EPOCHS[size], bar)
    record["machine"]["loadavg_end"] = os.getloadavg()
    write(Path(args.out), "orion_vs_dataparallel", record, markdown(record))
    return 0


def compare(cfg: dict[str, Any], target_epochs: tuple[int, ...], bar: Any) -> dict[str, Any]:
    problem = mf_problem(cfg)
    run_setting(dict(problem, cfg=dict(cfg, epochs=1)), 0, ClientOptions(), "none")  # compile first
    methods = {"serial": lambda: serial_curve(problem, cfg), "orion_par 2D": lambda: orion_curve(problem, cfg),
               "data-parallel s=0": lambda: dp_curve(problem, cfg, 0),
               "data-parallel s=2": lambda: dp_curve(problem, cfg, 2)}
    curves = {}
    for label, fn in methods.items():
        curves[label] = fn()
        bar.update(1)
    targets = {n: curves["serial"]["loss"][n] for n in target_epochs if n < len(curves["serial"]["loss"])}
    table = {k: {"epochs_to_target": {str(n): first(c, t, "epoch") for n, t in targets.items()},
                 "interpolated_epochs": {str(n): crossing(c, t) for n, t in targets.items()},
                 "time_to_target_s": {str(n): first(c, t, "time_s") for n, t in targets.items()},
                 "final_rmse": c["loss"][-1]} for k, c in curves.items()}
    return {"lr": cfg["lr"], "targets": {str(n): t for n, t in targets.items()}, "table": table, "curves": curves}


def markdown(rec: dict[str, Any]) -> str:
    p = rec["parameters"]
    lines = ["# orion_vs_dataparallel", "", f"`{rec['command']}` on {rec['date']}, {rec['machine']['cpus']} CPUs "
             f"(load {rec['machine']['loadavg_start'][0]:.1f} at start); {rec['versions']}.", "",
             f"MF ({p['ratings']} ratings requested, {p['users']} users x {p['items']} items, rank {p['rank']}), "
             f"{p['workers']} workers, reg {p['reg']}, {p['epochs']} epochs; data-parallel: {p['batches']} clocks per "
             "epoch. Target N = the training RMSE serial SGD reaches after N epochs; epochs are whole epochs for "
             "every method, with the crossing interpolated between epochs in brackets; 'not reached' = not within "
             "the run's epochs. Seconds: compute of the run up to that epoch, loss evaluation excluded.", ""]
    for lr, run in rec["runs"].items():
        targets = run["targets"]
        lines += [f"## lr {lr}: epochs to target", "",
                  "| method | " + " | ".join(f"N={n} (RMSE {t:.4f})" for n, t in targets.items()) + " | final RMSE |",
                  "|---|" + "---|" * (len(targets) + 1)]
        for label, row in run["table"].items():
            cells = [_cell(row["epochs_to_target"][n], "g") + ("" if row["interpolated_epochs"][n] is None else
                                                             f" ({row['interpolated_epochs'][n]:.2f})")
                     for n in targets]
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {row['final_rmse']:.4f} |")
        lines += ["", f"## lr {lr}: seconds to target", "",
                  "| method | " + " | ".join(f"N={n}" for n in targets) + " |", "|---|" + "---|" * len(targets)]
        for label, row in run["table"].items():
            lines.append(f"| {label} | " + " | ".join(_cell(row["time_to_target_s"][n], ".2f") for n in targets) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"


def _cell(x: float | None, fmt: str) -> str:
    return "not reached" if x is None else format(x, fmt)


if __name__ == "__main__":
    raise SystemExit(main())
