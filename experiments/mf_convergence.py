"""MF convergence: training RMSE vs epoch and vs time for serial SGD, orion_par and scikit-surprise.

Methods, all from the same synthetic ratings (rank-32 ground truth plus noise) and the same initial factors:

* ``serial``: the serial loop compiled by hand with numba (``models.mf.sgd_serial_numba``), data order;
* ``orion_par 1w`` / ``orion_par 2w``: the same loop body under ``@parallel_for`` (2D plan), local threads.
  With one worker the plan is one block in data order, so its run must equal the serial one bitwise
  (checked); with two, blocks (DSGD rotation) are cut into Latin-square chunks that keep data order and
  run in a seeded random step order, the same every epoch (``orion_par/schedule.py``);
* ``orion_par ray 2w``: the same plan on Ray actors (Ray started here, 2 CPUs);
* ``surprise SVD``: scikit-surprise's SVD (unbiased, same rank, learning rate and regularisation), which
  has no per-epoch hook, so it is refitted for a few epoch counts.

"Converges like serial" is checked on equal terms (the shuffle study): for several random orders of the
ratings, the serial loop and orion_par with 2 workers both start from that order (orion_par keeps it
inside each chunk, with a stratum seed of its own per order), and their per-epoch RMSE, averaged over the orders, is compared (``rmse_within_1pct[lr]``:
the gap of the mean curves <= 1% at every epoch).  Yardsticks for how much SGD's curve depends on the
order alone: the serial loop against itself on another order (one curve against one), and the mean serial
curve over as many other orders (a gap of means against a gap of means).  On two orders the serial loop
also runs in orion_par 2w's own visit order (``schedule(2).serial_order``), which must equal 2w bitwise:
then any difference from the serial loop comes from DSGD's visit order, not from running in parallel.

A throughput phase runs single epochs many times, 1 and 2 workers interleaved with two controls of what
the machine offers two threads right then: a compute-only kernel on 1 and 2 threads, and the hand-compiled
serial loop on two independent halves of the ratings (nothing shared) on 1 and 2 threads; it reports medians,
paired ratios (and bests) with the load average.  Targets from the issue:
>= 5M ratings/s per worker at rank 32, 2 workers >= 1.7x one worker, RMSE per epoch within 1% of serial.

Run: ``python -m experiments.mf_convergence`` (full, a few minutes) or ``--tiny`` (seconds);
``--throughput-only --repeats 31`` re-measures only the throughput (for a quiet moment on a shared machine;
``--quiet-gate 30`` waits up to 30 s before each repeat for the CPUs to be 90% idle, and records what it saw;
``--warm`` times each method's second of two back-to-back epochs, and reports the first ones too);
``--study-only --orders 64`` runs only the shuffle study at the main lr, over 64 orders (mf_shuffle_study.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from experiments._machine import machine_info, spin_seconds, versions, wait_for_quiet
from experiments._mf_report import format_load, markdown, markdown_study, markdown_throughput, plot
from models.mf import Ratings, init_factors, parallel_sgd, rmse, sgd_serial_numba, synthetic_ratings
from orion_par import DistArray

FULL = dict(users=10000, items=5000, ratings=2_000_000, rank=32, epochs=15, lr=0.03, reg=0.02, init=0.3,
            repeats=15, surprise_epochs=[1, 2, 4, 8, 15], gentle_lr=0.01, gentle_init=0.5, shuffles=16)
TINY = dict(users=400, items=300, ratings=20000, rank=32, epochs=3, lr=0.03, reg=0.02, init=0.3, repeats=2,
            surprise_epochs=[1, 3], gentle_lr=0.01, gentle_init=0.5, shuffles=2)


class Problem:
    """Data, the factors every method trains (reset between methods), and the decorated loop."""

    def __init__(self, cfg: dict[str, Any], data: Ratings | None = None) -> None:
        self.cfg = cfg
        self.data = data or synthetic_ratings(cfg["users"], cfg["items"], cfg["ratings"], cfg["rank"], seed=0)
        self.W, self.H = init_factors(cfg["users"], cfg["items"], cfg["rank"], seed=1, scale=cfg["init"])
        self.W0, self.H0 = self.W.copy(), self.H.copy()
        self.sgd = parallel_sgd(self.data.ratings, self.W, self.H, lr=cfg["lr"], reg=cfg["reg"])

    def reset(self) -> None:
        """Back to the initial factors, and to epoch 0 of orion_par's epoch count."""
        self.W[...] = self.W0
        self.H[...] = self.H0
        self.sgd.epochs_run = 0

    def serial_epoch(self) -> None:
        sgd_serial_numba(self.data.keys, self.data.values, np.asarray(self.W), np.asarray(self.H),
                         self.cfg["lr"], self.cfg["reg"])

    def rmse(self, W: np.ndarray | None = None, H: np.ndarray | None = None) -> float:
        return rmse(self.data.keys, self.data.values, self.W if W is None else W, self.H if H is None else H)


def _shuffled(data: Ratings, seed: int) -> Ratings:
    """The same ratings in another random order (what a user's shuffle before training gives)."""
    perm = np.random.default_rng(seed).permutation(data.keys.shape[0])
    ratings = DistArray.from_coo(data.keys[perm], data.values[perm])
    return Ratings(ratings, data.W_true, data.H_true, data.noise)


def _curve(p: Problem, label: str, step: Any) -> dict[str, list[float]]:
    """Run ``step()`` once per epoch; record RMSE and cumulative seconds (RMSE evaluation not timed)."""
    p.reset()
    out: dict[str, list[float]] = {"epoch": [0], "rmse": [p.rmse()], "time_s": [0.0]}
    total = 0.0
    for e in tqdm(range(1, p.cfg["epochs"] + 1), desc=label, leave=False):
        t0 = time.perf_counter()
        step()
        total += time.perf_counter() - t0
        out["epoch"].append(e)
        out["rmse"].append(p.rmse())
        out["time_s"].append(total)
    return out


def _surprise_curve(p: Problem) -> dict[str, Any]:
    try:
        from surprise import SVD, Trainset
    except ImportError as e:
        print(f"surprise SVD skipped: scikit-surprise is not installed ({e})")
        return {"skipped": str(e)}
    keys, vals = p.data.keys, p.data.values
    ur: dict[int, list[tuple[int, float]]] = {}
    ir: dict[int, list[tuple[int, float]]] = {}
    for (u, i), r in zip(keys.tolist(), vals.tolist(), strict=True):
        ur.setdefault(u, []).append((i, r))
        ir.setdefault(i, []).append((u, r))
    users, items = p.cfg["users"], p.cfg["items"]
    trainset = Trainset(ur, ir, users, items, len(vals), (float(vals.min()), float(vals.max())),
                        {u: u for u in range(users)}, {i: i for i in range(items)})  # inner id == our id
    out: dict[str, list[float]] = {"epoch": [], "rmse": [], "time_s": []}
    for n in tqdm(p.cfg["surprise_epochs"], desc="surprise SVD", leave=False):
        algo = SVD(n_factors=p.cfg["rank"], n_epochs=n, biased=False, lr_all=p.cfg["lr"], reg_all=p.cfg["reg"],
                   init_std_dev=p.cfg["init"], random_state=1)
        t0 = time.perf_counter()
        algo.fit(trainset)
        out["epoch"].append(n)
        out["time_s"].append(time.perf_counter() - t0)
        out["rmse"].append(p.rmse(algo.pu, algo.qi))
    return out


class _Halves:
    """A control without orion_par: the hand-compiled serial loop on each half of the ratings (users split in two
    as the 2D plan splits them), each half with its own copies of W and H, so that nothing is shared; run one
    half after the other on one thread, or both at once on two.  Their ratio is what two threads of this
    memory-bound kernel get from the machine (the compute-only control says what its cores offer)."""

    def __init__(self, p: Problem) -> None:
        keys, values = p.data.keys, p.data.values
        split = int(np.median(keys[:, 0]))
        halves = [np.flatnonzero(keys[:, 0] < split), np.flatnonzero(keys[:, 0] >= split)]
        self.keys = [np.ascontiguousarray(keys[h]) for h in halves]
        self.values = [np.ascontiguousarray(values[h]) for h in halves]
        self.W = [np.asarray(p.W).copy() for _ in halves]
        self.H = [np.asarray(p.H).copy() for _ in halves]
        self.lr, self.reg = p.cfg["lr"], p.cfg["reg"]

    def _half(self, h: int) -> None:
        sgd_serial_numba(self.keys[h], self.values[h], self.W[h], self.H[h], self.lr, self.reg)

    def seconds(self, threads: int) -> float:
        t0 = time.perf_counter()
        if threads == 1:
            self._half(0)
            self._half(1)
        else:
            pool = [threading.Thread(target=self._half, args=(h,)) for h in (0, 1)]
            for t in pool:
                t.start()
            for t in pool:
                t.join()
        return time.perf_counter() - t0


def _throughput(p: Problem, repeats: int, quiet_gate_s: float = 0.0, warm: bool = False) -> dict[str, Any]:
    """Single-epoch ratings/s of serial, orion_par 1 and 2 workers, ``repeats`` times, interleaved with a
    compute-only 1- and 2-thread control so that all see the same load; medians and bests.

    ``quiet_gate_s > 0``: before each repeat, wait up to that long for the shared machine's CPUs to be 90%
    idle over half a second (other users' jobs come and go); every repeat is kept either way, and the idle
    share seen before each is recorded.  ``warm``: each timed epoch directly follows an untimed one of the same
    method (both cores awake and busy, as in training); those first epochs' times are kept as ``cold``."""
    n = p.data.keys.shape[0]
    spin_seconds(1, 10)   # compile the spin kernel before timing
    times: dict[str, list[float]] = {"serial": [], "orion_par_1w": [], "orion_par_2w": [], "spin_1t": [], "spin_2t": [],
                                     "halves_1t": [], "halves_2t": []}
    halves = _Halves(p)
    cpu: dict[int, list[float]] = {1: [], 2: []}
    busy: dict[int, list[float]] = {1: [], 2: []}
    load = [os.getloadavg()[0]]
    idle_before: list[float | None] = []
    cold: dict[str, list[float]] = {"serial": [], "orion_par_1w": [], "orion_par_2w": []}
    for _ in tqdm(range(repeats), desc="throughput", leave=False):
        if quiet_gate_s > 0:
            idle_before.append(wait_for_quiet(quiet_gate_s)[0])
        if warm:
            t0 = time.perf_counter()
            p.serial_epoch()
            cold["serial"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        p.serial_epoch()
        times["serial"].append(time.perf_counter() - t0)
        for w in (1, 2):
            if warm:
                cold[f"orion_par_{w}w"].append(p.sgd.run(workers=w).elapsed_s)
            st = p.sgd.run(workers=w)
            times[f"orion_par_{w}w"].append(st.elapsed_s)
            cpu[w].append(sum(st.cpu_s))
            busy[w].append(max(st.busy_s))
        times["spin_1t"].append(spin_seconds(1))
        times["spin_2t"].append(spin_seconds(2))
        times["halves_1t"].append(halves.seconds(1))
        times["halves_2t"].append(halves.seconds(2))
        load.append(os.getloadavg()[0])
    res: dict[str, Any] = {"repeats": repeats, "loadavg_1min": load, "quiet_gate_s": quiet_gate_s, "warm": warm,
                           "idle_share_before_repeat": idle_before,
                           "spin_2thread_speedup_per_repeat": (2 * np.array(times["spin_1t"]) / np.array(times["spin_2t"])).tolist()}
    for name in ("serial", "orion_par_1w", "orion_par_2w"):
        t = np.array(times[name])
        w = 2 if name.endswith("2w") else 1
        res[name] = {"best_s": float(t.min()), "median_s": float(np.median(t)), "times_s": t.tolist(),
                     "ratings_per_s": n / float(np.median(t)), "ratings_per_s_best": n / float(t.min()),
                     "ratings_per_s_per_worker": n / float(np.median(t)) / w}
        if w in cpu and name != "serial":
            res[name]["cpu_s_median"] = float(np.median(cpu[w]))
            res[name]["busy_s_median"] = float(np.median(busy[w]))
    if warm:
        c1, c2, cs = (np.array(cold[k]) for k in ("orion_par_1w", "orion_par_2w", "serial"))
        res["cold"] = {"times_s": cold, "median_s": {k: float(np.median(v)) for k, v in cold.items()},
                       "speedup_2w_over_1w_median": float(np.median(c1) / np.median(c2)),
                       "speedup_2w_over_1w_paired_median": float(np.median(c1 / c2)),
                       "speedup_1w_over_serial_paired_median": float(np.median(cs / c1)),
                       "speedup_2w_over_serial_paired_median": float(np.median(cs / c2))}
    one, two = np.array(times["orion_par_1w"]), np.array(times["orion_par_2w"])
    res["speedup_2w_over_1w_median"] = float(np.median(one) / np.median(two))
    res["speedup_2w_over_1w_paired_median"] = float(np.median(one / two))  # each repeat's own ratio
    res["speedup_2w_over_1w_best"] = float(one.min() / two.min())
    res["speedup_2w_over_serial_median"] = float(np.median(times["serial"]) / np.median(two))
    serial = np.array(times["serial"])
    res["speedup_1w_over_serial_paired_median"] = float(np.median(serial / one))  # 1.0: as fast as the serial loop
    res["speedup_2w_over_serial_paired_median"] = float(np.median(serial / two))
    res["machine_2thread_speedup_median"] = float(np.median(2 * np.array(times["spin_1t"]) / np.array(times["spin_2t"])))
    h1, h2 = np.array(times["halves_1t"]), np.array(times["halves_2t"])
    res["halves_2thread_speedup_median"] = float(np.median(h1) / np.median(h2))
    res["halves_2thread_speedup_paired_median"] = float(np.median(h1 / h2))
    res["halves_times_s"] = {"1t": h1.tolist(), "2t": h2.tolist()}
    # CPU seconds exclude the time other processes held the cores: the speedup two workers would reach
    # on cores of their own if they never waited for each other (an estimate, not a timing).
    res["speedup_2w_estimate_from_cpu_time"] = float(np.median(cpu[1]) / (np.median(cpu[2]) / 2))
    return res


def _ray_curve(p: Problem) -> dict[str, Any]:
    try:
        import ray
    except ImportError as e:
        print(f"orion_par on Ray skipped: ray is not installed ({e})")
        return {"skipped": str(e)}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        # The first epoch includes starting the actors and loading the compiled body; later runs reuse them.
        curve: dict[str, Any] = _curve(p, "orion_par ray 2w", lambda: p.sgd.run(workers=2, backend="ray"))
        curve["final"] = (p.W.copy(), p.H.copy())
        return curve
    finally:
        p.sgd.close()
        ray.shutdown()


def _visit_order_curve(p: Problem, label: str, workers: int) -> dict[str, list[float]]:
    """The hand-written serial loop visiting the ratings in the order ``run(workers=workers)`` visits them
    (``schedule(workers).serial_order``: the blocks of each stratum one after another, DSGD's order)."""
    sched = p.sgd.schedule(workers)
    keys, values = p.data.keys, p.data.values

    def step() -> None:
        order = sched.serial_order(1, p.sgd.epochs_run)
        sgd_serial_numba(keys[order], values[order], np.asarray(p.W), np.asarray(p.H), p.cfg["lr"], p.cfg["reg"])
        p.sgd.epochs_run += 1  # as run() would advance it (every epoch repeats one order)

    return _curve(p, label, step)


def _lag_epochs(mean_ref: np.ndarray, mean_other: np.ndarray) -> list[float]:
    """Per epoch e: how many epochs later ``mean_other`` first reaches ``mean_ref[e]`` (linear interpolation
    between epochs; NaN if it never does).  Both curves decrease in the phase where this matters."""
    out = []
    for e, target in enumerate(mean_ref):
        hit = np.nonzero(mean_other <= target)[0]
        if hit.size == 0:
            out.append(float("nan"))
            continue
        j = int(hit[0])
        x = float(j)
        if j > 0 and mean_other[j - 1] != mean_other[j]:
            x = j - 1 + (mean_other[j - 1] - target) / (mean_other[j - 1] - mean_other[j])
        out.append(x - e)
    return out


def _shuffle_study(data: Ratings, cfg: dict[str, Any], lr: float, init: float) -> dict[str, Any]:
    """Serial loop vs orion_par 2 workers on ``cfg["shuffles"]`` random orders of the same ratings.

    For each order both start from the same factors; orion_par keeps that order inside each chunk and draws
    its chunks and step order from its own stratum seed per order.
    Returns per-epoch RMSE per order, and the gaps: between the mean curves (what "converges like
    serial" means for a method whose order differs), per order (paired), and two yardsticks for how much
    SGD's curve depends on the order alone: the serial loop against itself on the next order (one curve
    against one curve), and the mean serial curve over as many *other* orders (set B) against the mean
    over the first set (a gap of means against a gap of means, same number of orders).  On the first
    orders it also runs the serial loop in orion_par 2w's own visit order, which must equal 2w bitwise.
    """
    c = dict(cfg, lr=lr, init=init)
    serial, orion, serial_b = [], [], []
    visit_equal: list[bool] = []
    for s in range(c["shuffles"]):
        p = Problem(c, _shuffled(data, 100 + s))
        # Each order its own stratum seed: 2w's visit order is the data order inside chunks whose Latin squares
        # and step order come from the seed, and with one seed for every order the 16 runs share that
        # structure (their curves then agree with each other to 4 digits up to epoch 8), so their mean would
        # sample one structure, not the executor's order.  The serial runs each get their own order too.
        p.sgd.stratum_seed = 100 + s
        p.sgd.run(workers=2, epochs=0)  # build the schedule
        serial.append(_curve(p, f"serial lr={lr} order {s}", p.serial_epoch)["rmse"])
        orion.append(_curve(p, f"orion_par 2w lr={lr} order {s}", lambda p=p: p.sgd.run(workers=2))["rmse"])
        if s < 2:
            final_2w = (p.W.copy(), p.H.copy())
            visit = _visit_order_curve(p, f"serial loop in 2w's visit order lr={lr} order {s}", 2)["rmse"]
            visit_equal.append(bool(visit == orion[-1] and np.array_equal(p.W, final_2w[0])
                                    and np.array_equal(p.H, final_2w[1])))
        pb = Problem(c, _shuffled(data, 10_000 + s))  # set B: other orders, the serial-vs-serial yardstick
        serial_b.append(_curve(pb, f"serial lr={lr} order B{s}", pb.serial_epoch)["rmse"])
        print(f"shuffle study lr {lr}: order {s + 1}/{c['shuffles']} done, load {format_load(os.getloadavg())}", flush=True)
    ser, par, ser_b = np.array(serial), np.array(orion), np.array(serial_b)
    mean_s, mean_p, mean_b = ser.mean(axis=0), par.mean(axis=0), ser_b.mean(axis=0)
    gap_means = np.abs(mean_p - mean_s)[1:] / mean_s[1:]
    gap_means_ss = np.abs(mean_b - mean_s)[1:] / mean_s[1:]
    n = len(ser)
    # The paired difference per order (2w minus serial, same order and start): its standard error per epoch.
    diff = (par - ser)[:, 1:] / mean_s[1:]
    se_paired = diff.std(axis=0, ddof=1) / np.sqrt(n) if n > 1 else np.zeros(diff.shape[1])
    se_ss = (np.sqrt(ser.var(axis=0, ddof=1) / n + ser_b.var(axis=0, ddof=1) / n)[1:] / mean_s[1:] if n > 1
             else np.zeros(diff.shape[1]))
    paired = np.max(np.abs(par - ser)[:, 1:] / ser[:, 1:], axis=1)
    other = np.max(np.abs(np.roll(ser, 1, axis=0) - ser)[:, 1:] / ser[:, 1:], axis=1) if len(ser) > 1 else paired * 0
    worst = int(np.argmax(gap_means)) + 1
    # Where the gap of means exceeds 1%, is it beyond what the orders' own spread explains?  (2w and serial on
    # one order follow unrelated trajectories, so the paired SE is the noise of the gap of means.)
    over = np.flatnonzero(gap_means > 0.01)
    in_se = gap_means / np.maximum(se_paired, 1e-12)
    return {"lr": lr, "init": init, "shuffles": c["shuffles"], "rmse_serial": ser.tolist(), "rmse_orion_par_2w": par.tolist(),
            "rmse_serial_other_orders": ser_b.tolist(),
            "mean_rmse_serial": mean_s.tolist(), "mean_rmse_orion_par_2w": mean_p.tolist(),
            "mean_rmse_serial_other_orders": mean_b.tolist(),
            "gap_of_means_per_epoch": gap_means.tolist(), "max_gap_of_means": float(gap_means.max()),
            "epoch_of_max_gap_of_means": worst, "final_epoch_gap_of_means": float(gap_means[-1]),
            "gap_of_means_serial_vs_serial_other_orders_per_epoch": gap_means_ss.tolist(),
            "max_gap_of_means_serial_vs_serial_other_orders": float(gap_means_ss.max()),
            "paired_diff_mean_per_epoch": diff.mean(axis=0).tolist(), "paired_diff_standard_error_per_epoch": se_paired.tolist(),
            "serial_vs_serial_gap_of_means_standard_error_per_epoch": se_ss.tolist(),
            "lag_epochs_2w_behind_serial_mean": _lag_epochs(mean_s, mean_p),
            "orion_par_2w_equals_serial_loop_in_its_visit_order": visit_equal,
            "epochs_gap_of_means_over_1pct": (over + 1).tolist(),
            "max_gap_of_means_in_paired_se_where_over_1pct": float(in_se[over].max()) if over.size else 0.0,
            "max_gap_paired_median": float(np.median(paired)),
            "max_gap_serial_vs_serial_other_order_median": float(np.median(other)),
            "serial_sd_over_mean_per_epoch": (ser.std(axis=0, ddof=1) / mean_s).tolist() if len(ser) > 1 else []}


def _max_rel_gap(curve: dict[str, Any], ref: dict[str, Any]) -> float:
    a, b = np.array(curve["rmse"][1:]), np.array(ref["rmse"][1:])
    return float(np.max(np.abs(a - b) / b)) if a.size else 0.0


def run(cfg: dict[str, Any], use_ray: bool) -> dict[str, Any]:
    p = Problem(cfg)
    for w in (1, 2):
        p.sgd.run(workers=w, epochs=0)  # compile and build each schedule once, outside every timing
    sgd_serial_numba(p.data.keys[:1], p.data.values[:1], p.W.copy(), p.H.copy(), 0.0, 0.0)
    curves: dict[str, Any] = {"serial": _curve(p, "serial", p.serial_epoch)}
    serial_final = (p.W.copy(), p.H.copy())
    curves["orion_par 1w"] = _curve(p, "orion_par 1w", lambda: p.sgd.run(workers=1))
    checks: dict[str, Any] = {"orion_par_1w_bitwise_equals_serial": bool(
        np.array_equal(p.W, serial_final[0]) and np.array_equal(p.H, serial_final[1]))}
    curves["orion_par 2w"] = _curve(p, "orion_par 2w", lambda: p.sgd.run(workers=2))
    local_final = (p.W.copy(), p.H.copy())
    if use_ray:
        ray_curve = _ray_curve(p)
        if "final" in ray_curve:
            W, H = ray_curve.pop("final")
            checks["ray_equals_local"] = bool(np.array_equal(W, local_final[0]) and np.array_equal(H, local_final[1]))
        curves["orion_par ray 2w"] = ray_curve
    curves["surprise SVD"] = _surprise_curve(p)
    for name in ("orion_par 1w", "orion_par 2w", "orion_par ray 2w"):
        if "rmse" in curves.get(name, {}):
            checks[f"rmse_gap_vs_serial_same_data_order[{name}]"] = _max_rel_gap(curves[name], curves["serial"])
    study = [_shuffle_study(p.data, cfg, cfg["lr"], cfg["init"]), _shuffle_study(p.data, cfg, cfg["gentle_lr"], cfg["gentle_init"])]
    for o in study:
        lr = o["lr"]
        checks[f"max_gap_of_mean_rmse_2w_vs_serial[lr={lr}]"] = o["max_gap_of_means"]
        checks[f"max_gap_paired_2w_vs_serial_median_over_orders[lr={lr}]"] = o["max_gap_paired_median"]
        checks[f"max_gap_serial_vs_serial_other_order_median[lr={lr}]"] = o["max_gap_serial_vs_serial_other_order_median"]
        checks[f"rmse_within_1pct[lr={lr}]"] = checks["orion_par_1w_bitwise_equals_serial"] and o["max_gap_of_means"] <= 0.01
        checks[f"epoch_of_max_gap_of_means[lr={lr}]"] = o["epoch_of_max_gap_of_means"]
        checks[f"final_epoch_gap_of_means[lr={lr}]"] = o["final_epoch_gap_of_means"]
        checks[f"max_gap_of_means_serial_vs_serial_other_orders[lr={lr}]"] = o["max_gap_of_means_serial_vs_serial_other_orders"]
        # Is 2w's gap of means larger than two serial sets of as many orders differ, at the worst epoch?
        e = o["epoch_of_max_gap_of_means"]
        checks[f"gap_of_means_at_worst_epoch_over_serial_vs_serial[lr={lr}]"] = (
            o["max_gap_of_means"] / max(o["gap_of_means_serial_vs_serial_other_orders_per_epoch"][e - 1], 1e-12))
        checks[f"gap_of_means_at_worst_epoch_in_paired_standard_errors[lr={lr}]"] = (
            o["max_gap_of_means"] / max(o["paired_diff_standard_error_per_epoch"][e - 1], 1e-12))
        checks[f"orion_par_2w_equals_serial_loop_in_its_visit_order[lr={lr}]"] = all(
            o["orion_par_2w_equals_serial_loop_in_its_visit_order"])
        checks[f"epochs_gap_of_means_over_1pct[lr={lr}]"] = str(o["epochs_gap_of_means_over_1pct"])
        # Not the issue's criterion: whether the gap is within 1% or within 2 standard errors of the orders' noise.
        checks[f"gap_within_1pct_or_2_paired_se[lr={lr}]"] = o["max_gap_of_means_in_paired_se_where_over_1pct"] <= 2.0
    checks["rmse_per_epoch_within_1pct_of_serial[lr=both]"] = all(
        checks[f"rmse_within_1pct[lr={o['lr']}]"] for o in study)
    p.reset()
    thr = _throughput(p, cfg["repeats"], cfg.get("quiet_gate_s", 0.0), cfg.get("warm", False))
    checks.update(_throughput_checks(thr))
    return {"curves": curves, "throughput": thr, "checks": checks, "plan": str(p.sgd.plan),
            "num_ratings": int(p.data.keys.shape[0]), "shuffle_study": study}


def run_study(cfg: dict[str, Any]) -> dict[str, Any]:
    """Only the shuffle study at the main learning rate (``cfg["shuffles"]`` orders)."""
    p = Problem(cfg)
    o = _shuffle_study(p.data, cfg, cfg["lr"], cfg["init"])
    e = o["epoch_of_max_gap_of_means"]
    se = o["paired_diff_standard_error_per_epoch"][e - 1]
    ss = o["gap_of_means_serial_vs_serial_other_orders_per_epoch"]
    checks = {"orders": o["shuffles"], "max_gap_of_means": o["max_gap_of_means"], "epoch_of_max_gap_of_means": e,
              "paired_se_at_that_epoch": se, "max_gap_of_means_in_paired_se": o["max_gap_of_means"] / max(se, 1e-12),
              "mean_paired_diff_at_that_epoch": o["paired_diff_mean_per_epoch"][e - 1],
              "max_gap_of_means_serial_vs_serial_other_orders": o["max_gap_of_means_serial_vs_serial_other_orders"],
              "epoch_of_max_gap_serial_vs_serial": int(np.argmax(ss)) + 1,
              "serial_vs_serial_se_at_that_epoch":
                  o["serial_vs_serial_gap_of_means_standard_error_per_epoch"][int(np.argmax(ss))],
              "rmse_within_1pct": o["max_gap_of_means"] <= 0.01,
              "orion_par_2w_equals_serial_loop_in_its_visit_order": all(
                  o["orion_par_2w_equals_serial_loop_in_its_visit_order"])}
    return {"shuffle_study": [o], "checks": checks, "num_ratings": int(p.data.keys.shape[0])}


def _throughput_checks(thr: dict[str, Any]) -> dict[str, Any]:
    return {"ratings_per_s_per_worker_1w": thr["orion_par_1w"]["ratings_per_s_per_worker"],
            "ratings_per_s_per_worker_2w": thr["orion_par_2w"]["ratings_per_s_per_worker"],
            "at_least_5M_per_worker": min(thr["orion_par_1w"]["ratings_per_s_per_worker"],
                                          thr["orion_par_2w"]["ratings_per_s_per_worker"]) >= 5e6,
            "speedup_2w_over_1w_median": thr["speedup_2w_over_1w_median"],
            "speedup_2w_over_1w_paired_median": thr["speedup_2w_over_1w_paired_median"],
            "speedup_at_least_1.7": thr["speedup_2w_over_1w_median"] >= 1.7,
            "speedup_at_least_1.7_paired": thr["speedup_2w_over_1w_paired_median"] >= 1.7,
            "speedup_1w_over_serial_paired_median": thr["speedup_1w_over_serial_paired_median"],
            "speedup_2w_over_serial_paired_median": thr["speedup_2w_over_serial_paired_median"],
            "machine_2thread_speedup_compute_only_median": thr["machine_2thread_speedup_median"],
            "machine_2thread_speedup_serial_loop_on_independent_halves_median": thr.get("halves_2thread_speedup_median",
                                                                                         float("nan")),
            "machine_2thread_speedup_serial_loop_on_independent_halves_paired": thr.get(
                "halves_2thread_speedup_paired_median", float("nan")),
            "speedup_2w_estimate_from_cpu_time": thr["speedup_2w_estimate_from_cpu_time"]}


def run_throughput(cfg: dict[str, Any]) -> dict[str, Any]:
    p = Problem(cfg)
    for w in (1, 2):
        p.sgd.run(workers=w, epochs=0)
    p.serial_epoch()
    p.reset()
    thr = _throughput(p, cfg["repeats"], cfg.get("quiet_gate_s", 0.0), cfg.get("warm", False))
    return {"throughput": thr, "checks": _throughput_checks(thr), "num_ratings": int(p.data.keys.shape[0])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.mf_convergence", description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a seconds-long smoke run (written to a temp dir)")
    ap.add_argument("--no-ray", action="store_true", help="skip the Ray executor")
    ap.add_argument("--throughput-only", action="store_true",
                    help="only the throughput phase, written to mf_throughput.json/.md")
    ap.add_argument("--study-only", action="store_true",
                    help="only the shuffle study at the main lr, written to mf_shuffle_study.json/.md")
    ap.add_argument("--orders", type=int, default=None, help="random data orders in the shuffle study (default 16)")
    ap.add_argument("--repeats", type=int, default=None, help="throughput repeats (default: 15; --tiny: 2)")
    ap.add_argument("--quiet-gate", type=float, default=0.0, metavar="S",
                    help="before each throughput repeat, wait up to S seconds for the CPUs to be 90%% idle")
    ap.add_argument("--warm", action="store_true",
                    help="time each method's epoch right after an untimed one (the untimed ones are reported too)")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default experiments/results)")
    args = ap.parse_args(argv)
    cfg = dict(TINY if args.tiny else FULL)
    if args.repeats:
        cfg["repeats"] = args.repeats
    if args.orders:
        cfg["shuffles"] = args.orders
    if args.quiet_gate:
        cfg["quiet_gate_s"] = args.quiet_gate
    if args.warm:
        cfg["warm"] = True
    out = args.out or (Path(tempfile.mkdtemp(prefix="mf_convergence_")) if args.tiny else
                       Path(__file__).resolve().parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    name = "mf_throughput" if args.throughput_only else "mf_shuffle_study" if args.study_only else "mf_convergence"
    res = (run_throughput(cfg) if args.throughput_only else run_study(cfg) if args.study_only
           else run(cfg, use_ray=not args.no_ray))
    machine["loadavg_end"] = os.getloadavg()
    res.update(command="python -m experiments.mf_convergence " + " ".join(sys.argv[1:] if argv is None else argv),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               versions=versions(), machine=machine, config=cfg)
    text = {"mf_throughput": markdown_throughput, "mf_shuffle_study": markdown_study}.get(name, markdown)(res)
    (out / f"{name}.json").write_text(json.dumps(res, indent=1, default=float))
    (out / f"{name}.md").write_text(text)
    if name == "mf_convergence":
        plot(res, out / "mf_convergence.png")
    print(text.split("## Training")[0])
    print(f"wrote {out / name}.json and .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
