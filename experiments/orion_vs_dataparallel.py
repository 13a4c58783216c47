"""orion_par 2D (DSGD, no conflicts) vs data-parallel SGD on the parameter server: epochs and time to target RMSEs.

The same ratings, initial factors, learning rate and regularisation for every method, all per-rating SGD.
``serial``: the serial loop (``sgd_serial_numba`` over the ratings in data order), the yardstick that
defines the targets.  ``orion_par 2D``: the serial loop body under ``@parallel_for`` (2D plan), ``w``
worker threads, one epoch per ``run``.  ``data-parallel s=k``: the standard SSP data-parallel SGD of
``ssp_vs_bsp`` on ``orion_par.ps`` (``w`` workers, each owning a random ``1/w`` of the ratings; each clock
one mini-batch of it, read from the server, SGD on the worker's copy, the changes sent as increments;
staleness ``k``; real compute, no straggler, no bandwidth limit).  Each worker count ``w`` in
``--workers`` is a separate comparison; workers are threads, and epochs to a target do not depend on
how many cores run them (orion_par's run equals a serial run; data-parallel's updates depend on the
clock and staleness bound, though which stale copy an SSP worker reads can depend on thread timing).

Targets are chosen from the serial run, not tuned: the training RMSE serial SGD reaches after ``N``
epochs, for each ``N`` in ``TARGET_EPOCHS``.  Epochs to a target are whole epochs for every method (a
data-parallel run is looked at after its last clock of each epoch).  Two learning rates: 0.01 (as in
``ssp_vs_bsp``; serial SGD still descends at 15 epochs) and 0.03 (serial SGD reaches its noise floor in
about 4 epochs, so later targets differ from each other by less than the plateau's order-dependent noise).

Order noise.  Every method visits the ratings in its own order: orion_par 2D in its block order (its
run equals ``sgd_serial_numba`` over ``schedule(w).serial_order(epochs)``, checked here every run and
recorded as ``orion_vs_serial_on_its_order``), data-parallel user by user inside each mini-batch chunk.
Serial SGD over ``--orders`` random orders of the same ratings (``serial, other orders``: min-max) shows
how far the order alone moves the epochs to a target; ``orion_par 2D, other orders`` is orion_par's
block order built from each of those same orders, and ``orion_par 2D, other stratum seeds`` its block
order with stratum seeds 1 to ``--orders`` (the serial loop over each, which is what the run computes).

Stratum order.  orion_par 2D runs each epoch's strata in a random order (``parallel_for(...,
stratum_seed=0)``, the default, as in DSGD); ``orion_par 2D, fixed rotation`` is a real run with
``stratum_seed=None``, the same rotation every epoch (the default before).  At lr 0.01 the fixed rotation
crosses the targets from N=6 on later than random orders do (every block pairs ``1/w`` of the users
with ``1/(2w)`` of the items, in the same sequence every epoch); random strata cross them sooner, though
with 8 workers stratum seed 0 still trails serial's data order by about half an epoch at N=8 (other
seeds: the ``other stratum seeds`` band).  Both runs match the serial loop over their block order
exactly (difference 0), so the difference is the visiting order, not the executor.
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
WORKERS = {"full": (2, 8), "tiny": (2,)}
ORDERS = {"full": 8, "tiny": 1}


def serial_curve(problem: dict[str, Any], cfg: dict[str, Any], order: np.ndarray | None = None
                 ) -> dict[str, list[float]]:
    """The serial loop over the ratings in ``order`` (default: data order).

    ``order`` is one epoch's order, repeated every epoch, or all epochs' orders one after another.
    """
    W, H = problem["init"]["W"].copy(), problem["init"]["H"].copy()
    n = problem["keys"].shape[0]
    idx = np.arange(n) if order is None else order
    per_epoch = idx.size != n
    if per_epoch and idx.size != n * cfg["epochs"]:
        raise ValueError(f"order has {idx.size} indices: neither one epoch ({n}) nor {cfg['epochs']} epochs")
    keys, values = np.ascontiguousarray(problem["keys"][idx]), np.ascontiguousarray(problem["values"][idx])
    sgd_serial_numba(keys[:1], values[:1], W.copy(), H.copy(), cfg["lr"], cfg["reg"])  # compile before timing
    curve: dict[str, list[float]] = {"epoch": [0], "time_s": [0.0], "loss": [problem["loss"]({"W": W, "H": H})]}
    spent = 0.0
    for e in range(cfg["epochs"]):
        part = slice(e * n, (e + 1) * n) if per_epoch else slice(0, n)
        t0 = time.perf_counter()
        sgd_serial_numba(keys[part], values[part], W, H, cfg["lr"], cfg["reg"])
        spent += time.perf_counter() - t0
        curve["epoch"].append(e + 1)
        curve["time_s"].append(round(spent, 4))
        curve["loss"].append(problem["loss"]({"W": W, "H": H}))
    return curve


def orion_curve(problem: dict[str, Any], cfg: dict[str, Any], stratum_seed: int | None = 0
                ) -> tuple[dict[str, list[float]], np.ndarray]:
    """orion_par 2D's curve, and the record order of the serial run it equals (all epochs)."""
    W = DistArray(problem["init"]["W"].copy())
    H = DistArray(problem["init"]["H"].copy())
    ratings = DistArray.from_coo(problem["keys"], problem["values"])
    sgd = parallel_sgd(ratings, W, H, lr=cfg["lr"], reg=cfg["reg"])
    sgd.stratum_seed = stratum_seed
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
    return curve, sgd.schedule(cfg["workers"]).serial_order(cfg["epochs"])


def block_order(problem: dict[str, Any], cfg: dict[str, Any], workers: int, perm: np.ndarray,
                stratum_seed: int | None = 0) -> np.ndarray:
    """orion_par 2D's serial order over all epochs (indices into ``perm``) when the ratings come in order ``perm``."""
    ratings = DistArray.from_coo(problem["keys"][perm], problem["values"][perm])
    W, H = DistArray(problem["init"]["W"].copy()), DistArray(problem["init"]["H"].copy())
    sgd = parallel_sgd(ratings, W, H, lr=cfg["lr"], reg=cfg["reg"])
    sgd.stratum_seed = stratum_seed
    return sgd.schedule(workers).serial_order(cfg["epochs"])


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
    ap.add_argument("--workers", type=int, nargs="+", default=None,
                    help="worker counts, one comparison each (default: 2 8; threads, any number of cores)")
    ap.add_argument("--orders", type=int, default=None,
                    help="random rating orders for the serial order-noise row (default: 8, tiny 1)")
    args = ap.parse_args(argv)
    size = "tiny" if args.tiny else "full"
    workers = tuple(args.workers or WORKERS[size])
    orders = ORDERS[size] if args.orders is None else args.orders
    base = dict(MF_TINY if args.tiny else MF_FULL, clock_s=None, epochs=4 if args.tiny else 15)
    base.pop("workers")
    record: dict[str, Any] = {"command": "python -m experiments.orion_vs_dataparallel " + " ".join(argv or sys.argv[1:]),
                              "date": datetime.datetime.now().isoformat(timespec="seconds"), "versions": versions(),
                              "machine": machine(), "tiny": args.tiny,
                              "parameters": dict(base, workers=list(workers), orders=orders), "runs": {}}
    lrs = (args.lr,) if args.lr else LRS[size]
    with tqdm(total=len(lrs) * (1 + orders + 4 * len(workers)), desc="orion_vs_dataparallel", disable=None) as bar:
        for lr in lrs:
            record["runs"][str(lr)] = compare(dict(base, lr=lr), workers, orders, TARGET_EPOCHS[size], bar)
    record["machine"]["loadavg_end"] = os.getloadavg()
    write(Path(args.out), "orion_vs_dataparallel", record, markdown(record))
    return 0


def compare(cfg: dict[str, Any], workers: tuple[int, ...], orders: int, target_epochs: tuple[int, ...],
            bar: Any) -> dict[str, Any]:
    """One learning rate: the serial yardstick and order-noise band, then one comparison per worker count."""
    problem = mf_problem(dict(cfg, workers=1))
    serial = serial_curve(problem, cfg)
    bar.update(1)
    targets = {n: serial["loss"][n] for n in target_epochs if n < len(serial["loss"])}
    n_ratings = problem["keys"].shape[0]
    perms = [np.random.default_rng(1000 + k).permutation(n_ratings) for k in range(orders)]
    spread: dict[str, list[float | None]] = {str(n): [] for n in targets}
    for perm in perms:
        other = serial_curve(problem, cfg, perm)
        for n, t in targets.items():
            spread[str(n)].append(crossing(other, t))
        bar.update(1)
    out: dict[str, Any] = {"lr": cfg["lr"], "targets": {str(n): t for n, t in targets.items()},
                           "serial_other_orders": spread, "by_workers": {}}
    for w in workers:
        wcfg = dict(cfg, workers=w)
        wproblem = mf_problem(wcfg)  # the same ratings and initial factors; its data-parallel program has w workers
        run_setting(dict(wproblem, cfg=dict(wcfg, epochs=1)), 0, ClientOptions(), "none")  # compile first
        orion, order = orion_curve(wproblem, wcfg)
        same = serial_curve(wproblem, wcfg, order)
        bar.update(1)
        rotation, rotation_order = orion_curve(wproblem, wcfg, stratum_seed=None)
        rotation_same = serial_curve(wproblem, wcfg, rotation_order)
        bar.update(1)
        # orion_par 2D's block order over the same random orders of the ratings, and with other stratum seeds
        # (its run equals the serial run over its block order)
        block_spread: dict[str, list[float | None]] = {str(n): [] for n in targets}
        seed_spread: dict[str, list[float | None]] = {str(n): [] for n in targets}
        data_order = np.arange(n_ratings)
        for k, perm in enumerate(perms):
            other = serial_curve(problem, cfg, perm[block_order(problem, cfg, w, perm)])
            seeded = serial_curve(problem, cfg, block_order(problem, cfg, w, data_order, stratum_seed=k + 1))
            for n, t in targets.items():
                block_spread[str(n)].append(crossing(other, t))
                seed_spread[str(n)].append(crossing(seeded, t))
        curves = {"serial": serial, "orion_par 2D": orion, "orion_par 2D, fixed rotation": rotation}
        for s in (0, 2):
            curves[f"data-parallel s={s}"] = dp_curve(wproblem, wcfg, s)
            bar.update(1)
        table = {k: {"epochs_to_target": {str(n): first(c, t, "epoch") for n, t in targets.items()},
                     "interpolated_epochs": {str(n): crossing(c, t) for n, t in targets.items()},
                     "time_to_target_s": {str(n): first(c, t, "time_s") for n, t in targets.items()},
                     "final_rmse": c["loss"][-1]} for k, c in curves.items()}
        out["by_workers"][str(w)] = {
            "workers": w, "table": table, "curves": curves, "orion_block_order_other_orders": block_spread,
            "orion_other_stratum_seeds": seed_spread,
            "orion_vs_serial_on_its_order": max(abs(a - b) for a, b in zip(orion["loss"], same["loss"], strict=True)),
            "rotation_vs_serial_on_its_order": max(abs(a - b) for a, b in
                                                   zip(rotation["loss"], rotation_same["loss"], strict=True))}
    return out


def markdown(rec: dict[str, Any]) -> str:
    p = rec["parameters"]
    lines = ["# orion_vs_dataparallel", "", f"`{rec['command']}` on {rec['date']}, {rec['machine']['cpus']} CPUs "
             f"(load {rec['machine']['loadavg_start'][0]:.1f} at start); {rec['versions']}.", "",
             f"MF ({p['ratings']} ratings requested, {p['users']} users x {p['items']} items, rank {p['rank']}), "
             f"reg {p['reg']}, {p['epochs']} epochs, the same data, initial factors, lr and reg for every method; "
             f"data-parallel: {p['batches']} clocks per epoch. Workers are threads on {rec['machine']['cpus']} "
             "cores: epochs to a target do not depend on real parallelism (orion_par's run equals a serial run over "
             "its block order; data-parallel s=0 reads the server at each clock), but the seconds do, so read "
             "them as cost on this machine, not parallel speed. Data-parallel s=2 is not deterministic: which "
             "stale copy a worker reads depends on thread timing, so its row moves from run to run. Target N = "
             "the training RMSE serial SGD (data order) reaches after N epochs; epochs are whole epochs for every "
             "method, with the crossing interpolated between epochs in brackets; 'not reached' = not within the "
             f"run's epochs. 'serial, other orders' = the serial loop over {p['orders']} random orders of the same "
             "ratings (interpolated epochs, min-max; 'k/n reached' when some orders never reach it): how far the "
             "visiting order alone moves a crossing. 'orion_par 2D, other orders' = orion_par's block order built "
             "from each of those same orders, 'orion_par 2D, other stratum seeds' its block order with stratum "
             f"seeds 1 to {p['orders']} (the serial loop over each, which is what the run computes). orion_par 2D "
             "runs each epoch's strata in a random order (stratum seed 0, the default); 'fixed rotation' is a "
             "run with stratum_seed=None, the same rotation every epoch (the default before). Seconds: compute "
             "of the run up to that epoch, loss evaluation excluded.", ""]
    for lr, run in rec["runs"].items():
        targets = run["targets"]
        for w, res in run["by_workers"].items():
            lines += [f"## lr {lr}, {w} workers: epochs to target", "",
                      "| method | " + " | ".join(f"N={n} (RMSE {t:.4f})" for n, t in targets.items()) + " | final RMSE |",
                      "|---|" + "---|" * (len(targets) + 1)]
            for label, row in res["table"].items():
                cells = [_cell(row["epochs_to_target"][n], "g") + ("" if row["interpolated_epochs"][n] is None else
                                                                 f" ({row['interpolated_epochs'][n]:.2f})")
                         for n in targets]
                lines.append(f"| {label} | " + " | ".join(cells) + f" | {row['final_rmse']:.4f} |")
                if label == "serial" and p["orders"]:
                    lines.append("| serial, other orders | " + " | ".join(_band(run["serial_other_orders"][n])
                                                                         for n in targets) + " | |")
                if label == "orion_par 2D" and p["orders"]:
                    lines.append("| orion_par 2D, other stratum seeds | " + " | ".join(
                        _band(res["orion_other_stratum_seeds"][n]) for n in targets) + " | |")
                    lines.append("| orion_par 2D, other orders | " + " | ".join(
                        _band(res["orion_block_order_other_orders"][n]) for n in targets) + " | |")
            lines += ["", f"orion_par 2D vs the serial loop over its block order: max RMSE difference "
                      f"{res['orion_vs_serial_on_its_order']:.2g} (random strata), "
                      f"{res['rotation_vs_serial_on_its_order']:.2g} (fixed rotation).", "",
                      f"## lr {lr}, {w} workers: seconds to target", "",
                      "| method | " + " | ".join(f"N={n}" for n in targets) + " |", "|---|" + "---|" * len(targets)]
            for label, row in res["table"].items():
                lines.append(f"| {label} | " + " | ".join(_cell(row["time_to_target_s"][n], ".2f") for n in targets)
                             + " |")
            lines.append("")
    return "\n".join(lines) + "\n"


def _band(xs: list[float | None]) -> str:
    if any(x is None for x in xs):
        reached = [x for x in xs if x is not None]
        return f"{len(reached)}/{len(xs)} reached" + (f" ({min(reached):.2f}-{max(reached):.2f})" if reached else "")
    return f"{min(xs):.2f}-{max(xs):.2f}"  # type: ignore[type-var]


def _cell(x: float | None, fmt: str) -> str:
    return "not reached" if x is None else format(x, fmt)


if __name__ == "__main__":
    raise SystemExit(main())
