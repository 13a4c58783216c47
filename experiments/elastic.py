"""Elastic workers: an autoscaler against fixed allocations, transitions against checkpoint-and-restart,
and a slow worker replaced or not -- MF with orion_par on Ray, and data-parallel MF on the parameter server.

Worker speed is emulated (``orion_par.elastic.Emulation``): each worker pads its work to a calibrated time
per rating, so up to 8 workers fit on this 2-core machine; the scaling limits that remain are real (Ray's
per-task and per-transfer costs on 2 cores, the driver, the window barriers, actors starting on the same
2 cores).  All runs start from the same factors:

- fixed allocations of 1, 2, 4 and 8 workers (one run each, largest first), and ``ScalingEfficiency``
  starting from 1 worker: time to the target training RMSE (measured from the run's start, actor
  start-up included) and worker-seconds up to then; the autoscaler and the best fixed allocation are run
  ``repeats`` times, interleaved, and compared by their medians (one run varies by a few seconds here).
  Times are also reported at the other RMSEs of ``targets`` (a shorter job, from the same runs): the
  autoscaler's exploration costs about the same seconds in any job, so its share falls as jobs get longer;
- the autoscaler's allocation sequence replayed by checkpoint-and-restart (``Elastic(restart=True)``):
  idle time per transition, and the arrays compared bit for bit;
- 4 workers with one 3x-slow worker, with and without ``Stragglers`` replacement.

Run: ``python -m experiments.elastic`` (``--tiny`` for a smoke run in a temp dir; ``--part orion`` or
``--part ps`` for one half). Written to ``experiments/results/elastic.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from experiments._common import RESULTS, load_average, write
from experiments._machine import machine_info, versions

# ps_window_per_worker: parameter-server clocks per window per worker (at least 1): a clock's work is split
# among the workers, so windows stay about as long at every count (one worker: 1 clock of 2 s, not 4).
# measure=1 window per count (after a warm-up window): windows at one count vary by ~2% (results' curves).
FULL = dict(users=12000, items=6000, ratings=1_200_000, rank=8, lr=0.02, reg=0.01, seconds_per_rating=4e-5,
            epochs=16, time_partitions=16, window=4, targets=(0.5, 0.6), counts=(1, 2, 4, 8), threshold=0.3,
            warmup=1, measure=1, slow=3.0, ps_batches=24, ps_lr=0.02, ps_window_per_worker=0.5, repeats=3)
TINY = dict(users=600, items=300, ratings=40_000, rank=4, lr=0.03, reg=0.01, seconds_per_rating=2e-5,
            epochs=4, time_partitions=4, window=2, targets=(0.8, 0.9), counts=(1, 2), threshold=0.5, warmup=1,
            measure=1, slow=3.0, ps_batches=6, ps_lr=0.03, ps_window_per_worker=0.5, repeats=1)


class MFJob:
    """The MF loop of ``models.mf`` on fixed data and starting factors; ``run`` resets them first."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        from models.mf import init_factors, parallel_sgd, rmse, synthetic_ratings

        self.cfg = cfg
        self.data = synthetic_ratings(num_users=cfg["users"], num_items=cfg["items"], num_ratings=cfg["ratings"],
                                      rank=cfg["rank"], seed=0)
        self.W, self.H = init_factors(cfg["users"], cfg["items"], rank=cfg["rank"], seed=1)
        self.W0, self.H0 = np.array(self.W, copy=True), np.array(self.H, copy=True)
        self.sgd = parallel_sgd(self.data.ratings, self.W, self.H, lr=cfg["lr"], reg=cfg["reg"])
        self.rmse = lambda: rmse(self.data.keys, self.data.values, self.W, self.H)

    def state(self) -> list[np.ndarray]:
        return [np.array(self.W, copy=True), np.array(self.H, copy=True)]

    def run(self, workers: int, elastic_args: dict[str, Any], limit_s: float | None = None
            ) -> tuple[Any, float, float]:
        """The run's log, its wall time, and its set-up time before the log's clock (none: the driver's clock
        starts before it starts Ray and the actors).  It ends at the target or after ``limit_s``."""
        from orion_par.elastic import Elastic, Emulation

        self.W[...], self.H[...] = self.W0, self.H0
        self.sgd.epochs_run = 0
        slow = elastic_args.pop("slow", {})
        elastic = Elastic(window=self.cfg["window"], progress=self.rmse, stop=stopper(self.cfg["targets"][0], limit_s),
                          emulation=Emulation(self.cfg["seconds_per_rating"], slow), **elastic_args)
        t0 = time.perf_counter()
        stats = self.sgd.run(workers=workers, epochs=self.cfg["epochs"], backend="ray",
                             time_partitions=self.cfg["time_partitions"], elastic=elastic)
        return stats.elastic, time.perf_counter() - t0, 0.0


def stopper(target: float, limit_s: float | None) -> Callable[[Any], bool]:
    """End a run at the target RMSE, or once ``limit_s`` seconds (of the log's clock) have passed."""
    def stop(window: Any) -> bool:
        over = limit_s is not None and window.start_s + window.elapsed_s > limit_s
        return over or (window.progress is not None and window.progress <= target)
    return stop


def time_to(log: Any, target: float) -> float | None:
    """Seconds from the run's start to the end of the first window whose RMSE is at most ``target``."""
    for w in log.windows:
        if w.progress is not None and w.progress <= target:
            return float(w.start_s + w.elapsed_s)
    return None


def summary(log: Any, targets: Sequence[float], wall_s: float, setup_s: float = 0.0, setup_workers: int = 0
            ) -> dict[str, Any]:
    """Time and worker-seconds to the first of ``targets`` (and, in ``at``, to each of them).  ``setup_s``:
    seconds before the log's clock started (``setup_workers`` actors starting), added in."""
    at: dict[str, dict[str, float | None]] = {}
    for target in targets:
        t = time_to(log, target)
        at[str(target)] = {"time_to_target_s": None if t is None else t + setup_s,
                           "worker_seconds_to_target": None if t is None
                           else log.worker_seconds(t) + setup_s * setup_workers}
    first = at[str(targets[0])]
    return {**first, "at": at,
            "wall_s": wall_s, "final_rmse": log.windows[-1].progress if log.windows else None,
            "median_throughput": float(np.median([w.throughput for w in log.windows])) if log.windows else None,
            "final_workers": log.windows[-1].workers if log.windows else None,
            "events": [{"at_s": e.at_s, "window": e.window, "kind": e.kind, "from": e.workers_before,
                        "to": e.workers_after, "replaced": list(e.replaced), "reason": e.reason, "idle_s": e.idle_s,
                        "started_s": e.started_s, "throughput_before": e.throughput_before,
                        "throughput_after": log.throughput_after(e)} for e in log.events],
            "setup_s": setup_s,
            "not_reached_by_s": (setup_s + log.windows[-1].start_s + log.windows[-1].elapsed_s
                                 if first["time_to_target_s"] is None and log.windows else None),
            "curve": [(round(setup_s + w.start_s + w.elapsed_s, 3), w.workers, round(w.throughput), w.progress)
                      for w in log.windows]}


def orion_part(cfg: dict[str, Any], say: Callable[[str], None]) -> dict[str, Any]:
    return compare(MFJob(cfg), cfg, "orion", say)


def compare(job: Any, cfg: dict[str, Any], name: str, say: Callable[[str], None]) -> dict[str, Any]:
    """Fixed allocations, the autoscaler, its replay by checkpoint-and-restart, a slow worker kept or replaced."""
    from orion_par.elastic import FixedSchedule, ScalingEfficiency, Stragglers

    out: dict[str, Any] = {"fixed": {}, "load_before": load_average()}
    best: float | None = None
    for k in sorted(cfg["counts"], reverse=True):  # largest first: a run 2x slower than the best so far stops
        log, wall, setup = job.run(k, {"policy": FixedSchedule({})}, None if best is None else 2.0 * best)
        out["fixed"][str(k)] = summary(log, cfg["targets"], wall, setup, k)
        reached = out["fixed"][str(k)]["time_to_target_s"]
        best = reached if best is None or (reached is not None and reached < best) else best
        say(f"{name} fixed {k}: {reached} s to target")
    top = max(cfg["counts"])

    def autoscale() -> tuple[Any, dict[str, Any]]:
        policy = ScalingEfficiency(max_workers=top, threshold=cfg["threshold"], warmup=cfg["warmup"],
                                   measure=cfg["measure"])
        log, wall, setup = job.run(1, {"policy": policy})
        row = summary(log, cfg["targets"], wall, setup, 1)
        row["spares"] = log.spares
        say(f"{name} autoscaler: {row['time_to_target_s']} s to target")
        return log, row

    log, out["autoscaler"] = autoscale()
    elastic_state = job.state()
    replay, wall, setup = job.run(1, {"policy": log.as_schedule(), "restart": True})
    out["restart_replay"] = summary(replay, cfg["targets"], wall, setup, 1)
    out["restart_replay"]["same_allocations"] = replay.as_schedule() == log.as_schedule()
    out["restart_replay"]["bitwise_equal_to_elastic"] = all(
        np.array_equal(a, b) for a, b in zip(elastic_state, job.state(), strict=True))
    say(f"{name} restart replay: idle {[round(e.idle_s, 2) for e in replay.events]} s")
    # Repeats, interleaved: the autoscaler and the best fixed allocation (its first run is the sweep's).
    reached = {k: r["time_to_target_s"] for k, r in out["fixed"].items() if r["time_to_target_s"] is not None}
    best_k = min(reached, key=lambda k: reached[k]) if reached else None
    runs: dict[str, list[dict[str, Any]]] = {"autoscaler": [out["autoscaler"]]}
    if best_k is not None:
        runs[f"fixed {best_k}"] = [out["fixed"][best_k]]
    for _ in range(cfg["repeats"] - 1):
        runs["autoscaler"].append(autoscale()[1])
        if best_k is not None:
            log, wall, setup = job.run(int(best_k), {"policy": FixedSchedule({})})
            runs[f"fixed {best_k}"].append(summary(log, cfg["targets"], wall, setup, int(best_k)))
            say(f"{name} fixed {best_k} again: {runs[f'fixed {best_k}'][-1]['time_to_target_s']} s to target")
    out["repeats"] = {label: [r["at"] for r in rows] for label, rows in runs.items()}
    k = min(4, top)
    limit = None
    for label, rule in (("slow_replaced", Stragglers()), ("slow_kept", None)):
        log, wall, setup = job.run(k, {"policy": FixedSchedule({}), "stragglers": rule, "slow": {1: cfg["slow"]}},
                                   limit)
        out[label] = summary(log, cfg["targets"], wall, setup, k)
        reached_s = out[label]["time_to_target_s"]
        limit = None if reached_s is None else 2.0 * reached_s  # the slow run is cut at 2x the replaced one's time
        say(f"{name} {label}: {reached_s} s to target")
    out["load_after"] = load_average()
    return out


def median_of(rows: list[dict[str, Any]], key: str) -> float | None:
    """The median of ``key`` over repeated runs (None if any run did not reach the target)."""
    vals = [r[key] for r in rows]
    return None if any(v is None for v in vals) else float(np.median(vals))


class ElasticMFProgram:
    """One clock of data-parallel SGD for MF on the parameter server (tables ``W`` and ``H``).

    Clock ``c`` works on mini-batch ``c % batches`` of the ratings; worker ``w`` of ``n`` (``client.num_workers``,
    so the split follows every resize) takes the batch's ratings ``w, w + n, ...``, reads their rows, runs the
    serial SGD loop on them and sends the changes.  Returns the ratings it processed (its work, for the
    throughput and the emulated compute time).
    """

    def __init__(self, keys: np.ndarray, values: np.ndarray, batches: int, lr: float, reg: float) -> None:
        perm = np.random.default_rng(3).permutation(keys.shape[0])
        self.keys, self.values = keys[perm], values[perm]
        self.bounds = np.linspace(0, keys.shape[0], batches + 1).astype(np.int64)
        self.batches, self.lr, self.reg = batches, lr, reg

    def __call__(self, client: Any, worker: int, clock: int) -> int:
        from models.mf import sgd_serial_numba

        b = clock % self.batches
        lo, hi = int(self.bounds[b]), int(self.bounds[b + 1])
        keys, vals = self.keys[lo + worker:hi:client.num_workers], self.values[lo + worker:hi:client.num_workers]
        users, u_local = np.unique(keys[:, 0], return_inverse=True)
        items, i_local = np.unique(keys[:, 1], return_inverse=True)
        W, H = client.get("W", users), client.get("H", items)
        W0, H0 = W.copy(), H.copy()
        local = np.ascontiguousarray(np.stack([u_local, i_local], axis=1).astype(np.int64))
        sgd_serial_numba(local, np.ascontiguousarray(vals), W, H, self.lr, self.reg)
        client.inc("W", users, W - W0)
        client.inc("H", items, H - H0)
        return int(keys.shape[0])


class PSJob:
    """Data-parallel MF on ``RayPS`` (BSP, deterministic: the tables are reproducible)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        from models.mf import init_factors, rmse, synthetic_ratings

        self.cfg = cfg
        data = synthetic_ratings(num_users=cfg["users"], num_items=cfg["items"], num_ratings=cfg["ratings"],
                                 rank=cfg["rank"], seed=0)
        self.keys, self.values = data.keys, data.values
        W, H = init_factors(cfg["users"], cfg["items"], rank=cfg["rank"], seed=1)
        self.W0, self.H0 = np.array(W), np.array(H)
        self.program = ElasticMFProgram(self.keys, self.values, cfg["ps_batches"], cfg["ps_lr"], cfg["reg"])
        self.rmse = rmse
        self.tables: dict[str, np.ndarray] = {}

    def state(self) -> list[np.ndarray]:
        return [self.tables["W"], self.tables["H"]]

    def run(self, workers: int, elastic_args: dict[str, Any], limit_s: float | None = None
            ) -> tuple[Any, float, float]:
        """The run's log, its wall time, and the set-up (Ray, actors, tables) before ``RayPS.run``'s clock.
        It ends at the target or after ``limit_s``."""
        from orion_par.elastic import Elastic, Emulation
        from orion_par.ps import TableSpec
        from orion_par.ps.ray_transport import RayPS

        cfg = self.cfg
        specs = [TableSpec("W", cfg["users"], cfg["rank"], staleness=0),
                 TableSpec("H", cfg["items"], cfg["rank"], staleness=0)]
        slow = elastic_args.pop("slow", {})
        t0 = time.perf_counter()
        ps = RayPS(specs, workers, deterministic=True, emulation=Emulation(cfg["seconds_per_rating"], slow))
        try:
            ps.initialize("W", self.W0)
            ps.initialize("H", self.H0)

            def progress() -> float:
                return self.rmse(self.keys, self.values, ps.table("W"), ps.table("H"))

            setup = time.perf_counter() - t0
            per_worker = cfg["ps_window_per_worker"]
            elastic = Elastic(window=lambda workers: max(1, int(workers * per_worker)), progress=progress,
                              stop=stopper(cfg["targets"][0], None if limit_s is None else limit_s - setup), **elastic_args)
            ps.run(self.program, cfg["epochs"] * cfg["ps_batches"], elastic=elastic)
            self.tables = {"W": ps.table("W"), "H": ps.table("H")}
            log = ps.elastic_log
        finally:
            ps.close()
        return log, time.perf_counter() - t0, setup


def ps_part(cfg: dict[str, Any], say: Callable[[str], None]) -> dict[str, Any]:
    return compare(PSJob(cfg), cfg, "ps", say)


def verdicts(part: dict[str, Any], targets: Sequence[float]) -> dict[str, Any]:
    """The issue's bars, computed from one part's rows (at the first target; the autoscaler's ratios also at
    the others, against the same fixed allocation)."""
    fixed = {int(k): v for k, v in part["fixed"].items()}
    reached = {k: v["time_to_target_s"] for k, v in fixed.items() if v["time_to_target_s"] is not None}
    best_k = min(reached, key=lambda k: reached[k]) if reached else None
    auto = part["autoscaler"]
    top = max(fixed)
    idle_elastic = [e["idle_s"] for e in auto["events"]]
    idle_restart = [e["idle_s"] for e in part["restart_replay"]["events"]]
    repeats = part["repeats"]
    out: dict[str, Any] = {"best_fixed": best_k, "runs_per_median": len(repeats["autoscaler"])}
    for i, target in enumerate(targets):
        at = "" if i == 0 else f"_at_{target}"
        auto_rows = [r[str(target)] for r in repeats["autoscaler"]]
        auto_t = median_of(auto_rows, "time_to_target_s")
        best_t = (median_of([r[str(target)] for r in repeats[f"fixed {best_k}"]], "time_to_target_s")
                  if best_k is not None else None)
        if auto_t is not None and best_t is not None:
            out[f"autoscaler_vs_best{at}"] = auto_t / best_t  # medians of the interleaved repeats
            if i == 0:
                out["within_10pct_of_best"] = out["autoscaler_vs_best"] <= 1.10
        top_rows = [r[str(target)] for r in repeats.get(f"fixed {top}", [fixed[top]["at"]])]
        auto_ws, top_ws = (median_of(auto_rows, "worker_seconds_to_target"),
                           median_of(top_rows, "worker_seconds_to_target"))
        if auto_ws is not None and top_ws is not None:
            out[f"worker_seconds_vs_largest{at}"] = auto_ws / top_ws
    if idle_elastic and idle_restart:
        out["mean_idle_elastic_s"] = float(np.mean(idle_elastic))
        out["mean_idle_restart_s"] = float(np.mean(idle_restart))
        out["idle_ratio"] = out["mean_idle_elastic_s"] / out["mean_idle_restart_s"]
    kept, replaced = part["slow_kept"]["time_to_target_s"], part["slow_replaced"]["time_to_target_s"]
    out["straggler_replaced"] = any(e["replaced"] for e in part["slow_replaced"]["events"])
    if kept is not None and replaced is not None:
        out["straggler_speedup"] = kept / replaced
    elif replaced is not None:  # the slow run was cut at 2x the replaced one's time without reaching the target
        out["straggler_speedup_at_least"] = part["slow_kept"]["not_reached_by_s"] / replaced
    return out


def _fmt(x: Any, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(rec: dict[str, Any]) -> str:
    lines = ["# Elastic workers", "", f"`{rec['command']}` ({rec['date']}); machine: {rec['machine']}.", ""]
    for name, part in rec["parts"].items():
        v = part["verdicts"]
        lines += [f"## {name}", "", f"Target training RMSE {rec['config']['targets'][0]} (also timed at "
                  f"{', '.join(map(str, rec['config']['targets'][1:]))}); load average before "
                  f"{part['load_before']}, after {part['load_after']}.", "",
                  "| allocation | time to target (s) | worker-seconds to target | "
                  + "".join(f"time to {t} (s) | " for t in rec["config"]["targets"][1:])
                  + "median throughput (/s) | final workers |",
                  "| --- | --- | --- | " + "--- | " * len(rec["config"]["targets"][1:]) + "--- | --- |"]
        rows = [(f"fixed {k}", r) for k, r in part["fixed"].items()]
        rows += [("autoscaler from 1", part["autoscaler"]), ("autoscaler replayed by restart", part["restart_replay"]),
                 ("4 with a 3x-slow worker", part["slow_kept"]), ("... slow worker replaced", part["slow_replaced"])]
        for label, r in rows:
            reached = _fmt(r["time_to_target_s"]) if r["time_to_target_s"] is not None else (
                f"not by {r['not_reached_by_s']:.1f}" if r["not_reached_by_s"] is not None else "-")
            others = "".join(f"{_fmt(r['at'][str(t)]['time_to_target_s'])} | " for t in rec["config"]["targets"][1:])
            lines.append(f"| {label} | {reached} | {_fmt(r['worker_seconds_to_target'], '.1f')} | {others}"
                         f"{_fmt(r['median_throughput'], '.0f')} | {r['final_workers']} |")
        lines += ["", "Repeated, interleaved (time to each target, s; median):", ""]
        for label, rows in part["repeats"].items():
            for target in rec["config"]["targets"]:
                at = [r[str(target)] for r in rows]
                times = ", ".join(_fmt(r["time_to_target_s"]) for r in at)
                lines.append(f"- {label}, RMSE {target}: {times}; median {_fmt(median_of(at, 'time_to_target_s'))}"
                             f" s, worker-seconds {_fmt(median_of(at, 'worker_seconds_to_target'), '.1f')}")
        lines += ["", "Transitions of the (first) autoscaler run (elastic), and of its replay by checkpoint-and-restart:",
                  ""]
        for label, r in (("elastic", part["autoscaler"]), ("restart", part["restart_replay"]),
                         ("straggler", part["slow_replaced"])):
            for e in r["events"]:
                lines.append(f"- {label}, {e['at_s']:.2f} s: {e['kind']} {e['from']} -> {e['to']} "
                             f"{'(replaced ' + str(e['replaced']) + ') ' if e['replaced'] else ''}idle "
                             f"{e['idle_s'] * 1e3:.0f} ms (new actors started {e['started_s']:.2f} s before); "
                             f"{e['reason']}")
        lines += ["", "Verdicts: " + ", ".join(f"{k} = {_fmt(x, '.3f') if isinstance(x, float) else x}"
                                               for k, x in v.items()), ""]
    return "\n".join(lines) + "\n"


def plot(rec: dict[str, Any], path: Path) -> None:
    """Per part: RMSE over time for every allocation, and the autoscaler's workers and throughput over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = rec["parts"]
    fig, axes = plt.subplots(2, len(parts), figsize=(6 * len(parts), 6.5), squeeze=False)
    for col, (name, part) in enumerate(parts.items()):
        top, bottom = axes[0][col], axes[1][col]
        runs = [(f"fixed {k}", r) for k, r in part["fixed"].items()] + [("autoscaler", part["autoscaler"])]
        for label, r in runs:
            t = [c[0] for c in r["curve"]]
            top.plot(t, [c[3] for c in r["curve"]], label=label, lw=2.2 if label == "autoscaler" else 1.2)
        top.axhline(rec["config"]["targets"][0], color="grey", ls=":", lw=0.8)
        top.set(title=name, xlabel="seconds", ylabel="training RMSE")
        top.legend(fontsize=8)
        curve = part["autoscaler"]["curve"]
        t = [c[0] for c in curve]
        bottom.step(t, [c[1] for c in curve], where="pre", color="C0")
        bottom.set(xlabel="seconds", ylabel="autoscaler's workers")
        twin = bottom.twinx()
        twin.plot(t, [c[2] for c in curve], ".", ms=3, color="C1")
        twin.set_ylabel("ratings / s", color="C1")
        for e in part["autoscaler"]["events"]:
            bottom.axvline(e["at_s"] + part["autoscaler"]["setup_s"], color="grey", lw=0.6, ls=":")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="seconds-long smoke run, written to a temp dir")
    ap.add_argument("--part", choices=("orion", "ps", "all"), default="all")
    ap.add_argument("--out", type=Path, default=None, help="results folder (default experiments/results)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="runs of the autoscaler and of the best fixed allocation, interleaved (default 3; --tiny 1)")
    args = ap.parse_args(argv)
    cfg: dict[str, Any] = dict(TINY if args.tiny else FULL)
    if args.repeats is not None:
        if args.repeats < 1:
            ap.error(f"--repeats {args.repeats}: need at least 1 run")
        cfg["repeats"] = args.repeats
    out = args.out or (Path(tempfile.mkdtemp(prefix="elastic-")) if args.tiny else RESULTS)
    # Every run starts its own Ray and stops it (so checkpoint-and-restart restarts Ray too, as a job would).
    parts: dict[str, Any] = {}
    if args.part in ("orion", "all"):
        parts["orion_par (MF, 2D DSGD)"] = orion_part(cfg, lambda m: print(m, file=sys.stderr, flush=True))
    if args.part in ("ps", "all"):
        parts["parameter server (data-parallel MF, BSP)"] = ps_part(cfg, lambda m: print(m, file=sys.stderr,
                                                                                             flush=True))
    for part in parts.values():
        part["verdicts"] = verdicts(part, cfg["targets"])
    rec = {"command": " ".join(["python -m experiments.elastic", *(argv if argv is not None else sys.argv[1:])]),
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine_info(),
           "versions": versions(), "config": cfg, "parts": parts}
    json_path, _ = write("elastic", rec, markdown(rec), out)
    plot(rec, out / "elastic.png")
    print(json_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
