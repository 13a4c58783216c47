"""MF convergence: training RMSE vs epoch and vs time for serial SGD, orion_par and scikit-surprise.

Methods, all from the same synthetic ratings (rank-32 ground truth plus noise) and the same initial factors:

* ``serial``: the serial loop compiled by hand with numba (``models.mf.sgd_serial_numba``), data order;
* ``orion_par 1w`` / ``orion_par 2w``: the same loop body under ``@parallel_for`` (2D plan), local threads;
* ``orion_par ray 2w``: the same plan on Ray actors (Ray started here, 2 CPUs);
* ``surprise SVD``: scikit-surprise's SVD (unbiased, same rank, learning rate and regularisation), which
  has no per-epoch hook, so it is refitted for a few epoch counts.

A separate throughput phase runs single epochs several times per worker count and keeps the best, since
the machine is shared.  It checks the issue's targets: >= 5M ratings/s per worker at rank 32, 2 workers
>= 1.7x one worker, and RMSE per epoch within 1% of the serial loop.

Run: ``python -m experiments.mf_convergence`` (full, a few minutes) or ``--tiny`` (seconds).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numba
import numpy as np
from tqdm import tqdm

from models.mf import init_factors, parallel_sgd, rmse, sgd_serial_numba, synthetic_ratings

FULL = dict(users=10000, items=5000, ratings=2_000_000, rank=32, epochs=15, lr=0.03, reg=0.02, init=0.3,
            repeats=7, surprise_epochs=[1, 2, 4, 8, 15], gentle_lr=0.01, gentle_init=0.5)
TINY = dict(users=400, items=300, ratings=20000, rank=32, epochs=3, lr=0.03, reg=0.02, init=0.3, repeats=2,
            surprise_epochs=[1, 3], gentle_lr=0.01, gentle_init=0.5)


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("numpy", "numba", "ray", "surprise", "orion_par"):
        try:
            mod = __import__(name)
            out[name] = getattr(mod, "__version__", "present")
        except ImportError as e:
            out[name] = f"not installed ({e})"
    return out


def _machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg_start": os.getloadavg()}


class Problem:
    """Data, the factors every method trains (reset between methods), and the decorated loop."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.data = synthetic_ratings(cfg["users"], cfg["items"], cfg["ratings"], cfg["rank"], seed=0)
        self.W, self.H = init_factors(cfg["users"], cfg["items"], cfg["rank"], seed=1, scale=cfg["init"])
        self.W0, self.H0 = self.W.copy(), self.H.copy()
        self.sgd = parallel_sgd(self.data.ratings, self.W, self.H, lr=cfg["lr"], reg=cfg["reg"])

    def reset(self) -> None:
        self.W[...] = self.W0
        self.H[...] = self.H0

    def rmse(self, W: np.ndarray | None = None, H: np.ndarray | None = None) -> float:
        return rmse(self.data.keys, self.data.values, self.W if W is None else W, self.H if H is None else H)


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


@numba.njit(nogil=True)
def _spin(n: int) -> float:
    x = 0.0
    for _ in range(n):
        x = x * 0.999999 + 1.0
    return x


def _spin_seconds(threads: int, n: int = 30_000_000) -> float:
    """Wall time of ``threads`` threads each running the same compute-only kernel: the machine's own
    parallel capacity right now (1.0 = two threads take as long as one; 2x speedup = perfect)."""
    pool = [threading.Thread(target=_spin, args=(n,)) for _ in range(threads)]
    t0 = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return time.perf_counter() - t0


def _throughput(p: Problem, repeats: int) -> dict[str, Any]:
    """Best-of-``repeats`` single-epoch ratings/s (serial, orion_par 1 and 2 workers), interleaved with a
    compute-only 1- and 2-thread control so that all see the same load."""
    n = p.data.keys.shape[0]
    keys, vals = p.data.keys, p.data.values
    _spin(10)
    times: dict[str, list[float]] = {"serial": [], "orion_par_1w": [], "orion_par_2w": [], "spin_1t": [], "spin_2t": []}
    best: dict[int, Any] = {}
    for _ in range(repeats):
        t0 = time.perf_counter()
        sgd_serial_numba(keys, vals, np.asarray(p.W), np.asarray(p.H), p.cfg["lr"], p.cfg["reg"])
        times["serial"].append(time.perf_counter() - t0)
        for w in (1, 2):
            st = p.sgd.run(workers=w)
            times[f"orion_par_{w}w"].append(st.elapsed_s)
            if w not in best or st.elapsed_s < best[w].elapsed_s:
                best[w] = st
        times["spin_1t"].append(_spin_seconds(1))
        times["spin_2t"].append(_spin_seconds(2))
    res: dict[str, Any] = {"serial": {"best_s": min(times["serial"]), "median_s": float(np.median(times["serial"])),
                                      "ratings_per_s": n / min(times["serial"])}}
    for w in (1, 2):
        res[f"orion_par_{w}w"] = {
            "best_s": best[w].elapsed_s, "median_s": float(np.median(times[f"orion_par_{w}w"])),
            "ratings_per_s": best[w].records_per_s, "ratings_per_s_per_worker": best[w].records_per_s_per_worker,
            "busy_s": list(best[w].busy_s), "cpu_s": list(best[w].cpu_s),
        }
    res["speedup_2w_over_1w"] = res["orion_par_2w"]["ratings_per_s"] / res["orion_par_1w"]["ratings_per_s"]
    res["machine_2thread_speedup"] = 2 * min(times["spin_1t"]) / min(times["spin_2t"])
    # CPU seconds exclude the time other processes held the cores: this is the speedup the two workers
    # would reach on cores of their own if they never waited for each other (an estimate, not a timing).
    res["speedup_2w_estimate_from_cpu_time"] = sum(best[1].cpu_s) / max(best[2].cpu_s)
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


def _order_sensitivity(cfg: dict[str, Any], lr: float, init: float) -> dict[str, Any]:
    """How much SGD's RMSE curve moves when only the order of the ratings changes.

    The serial loop on a reshuffled copy of the data is the yardstick for orion_par's gap: both visit
    the same ratings per epoch in a different order.
    """
    p = Problem(dict(cfg, lr=lr, init=init))
    perm = np.random.default_rng(5).permutation(p.data.keys.shape[0])
    keys2, vals2 = p.data.keys[perm].copy(), p.data.values[perm].copy()
    W, H = np.asarray(p.W), np.asarray(p.H)
    serial = _curve(p, f"serial lr={lr}", lambda: sgd_serial_numba(p.data.keys, p.data.values, W, H, lr, cfg["reg"]))
    shuffled = _curve(p, f"serial reshuffled lr={lr}", lambda: sgd_serial_numba(keys2, vals2, W, H, lr, cfg["reg"]))
    orion = _curve(p, f"orion_par 2w lr={lr}", lambda: p.sgd.run(workers=2))
    return {"lr": lr, "init": init, "rmse_serial": serial["rmse"], "rmse_serial_reshuffled": shuffled["rmse"],
            "rmse_orion_par_2w": orion["rmse"], "gap_serial_reshuffled": _max_rel_gap(shuffled, serial),
            "gap_orion_par_2w": _max_rel_gap(orion, serial)}


def _max_rel_gap(curve: dict[str, Any], ref: dict[str, Any]) -> float:
    a, b = np.array(curve["rmse"][1:]), np.array(ref["rmse"][1:])
    return float(np.max(np.abs(a - b) / b)) if a.size else 0.0


def run(cfg: dict[str, Any], use_ray: bool) -> dict[str, Any]:
    p = Problem(cfg)
    for w in (1, 2):
        p.sgd.run(workers=w, epochs=0)  # compile and build each schedule once, outside every timing
    sgd_serial_numba(p.data.keys[:1], p.data.values[:1], p.W.copy(), p.H.copy(), 0.0, 0.0)
    args = (p.data.keys, p.data.values, np.asarray(p.W), np.asarray(p.H), cfg["lr"], cfg["reg"])
    curves: dict[str, Any] = {"serial": _curve(p, "serial", lambda: sgd_serial_numba(*args))}
    curves["orion_par 1w"] = _curve(p, "orion_par 1w", lambda: p.sgd.run(workers=1))
    curves["orion_par 2w"] = _curve(p, "orion_par 2w", lambda: p.sgd.run(workers=2))
    local_final = (p.W.copy(), p.H.copy())
    checks: dict[str, Any] = {}
    if use_ray:
        ray_curve = _ray_curve(p)
        if "final" in ray_curve:
            W, H = ray_curve.pop("final")
            checks["ray_equals_local"] = bool(np.array_equal(W, local_final[0]) and np.array_equal(H, local_final[1]))
        curves["orion_par ray 2w"] = ray_curve
    curves["surprise SVD"] = _surprise_curve(p)
    p.reset()
    thr = _throughput(p, cfg["repeats"])
    for name in ("orion_par 1w", "orion_par 2w", "orion_par ray 2w"):
        if "rmse" in curves.get(name, {}):
            checks[f"rmse_gap_vs_serial[{name}]"] = _max_rel_gap(curves[name], curves["serial"])
    checks["rmse_within_1pct"] = all(v <= 0.01 for k, v in checks.items() if k.startswith("rmse_gap"))
    last = {k: abs(c["rmse"][-1] - curves["serial"]["rmse"][-1]) / curves["serial"]["rmse"][-1]
            for k, c in curves.items() if k.startswith("orion_par") and "rmse" in c}
    checks["final_rmse_gap_vs_serial"] = max(last.values())
    order = [_order_sensitivity(cfg, cfg["lr"], cfg["init"]), _order_sensitivity(cfg, cfg["gentle_lr"], cfg["gentle_init"])]
    for o in order:
        checks[f"gap_serial_vs_reshuffled_serial[lr={o['lr']}]"] = o["gap_serial_reshuffled"]
        checks[f"gap_orion_par_2w_vs_serial[lr={o['lr']}]"] = o["gap_orion_par_2w"]
    checks["rmse_within_1pct[gentle lr]"] = order[1]["gap_orion_par_2w"] <= 0.01
    checks["ratings_per_s_per_worker_1w"] = thr["orion_par_1w"]["ratings_per_s_per_worker"]
    checks["ratings_per_s_per_worker_2w"] = thr["orion_par_2w"]["ratings_per_s_per_worker"]
    checks["at_least_5M_per_worker"] = checks["ratings_per_s_per_worker_1w"] >= 5e6
    checks["speedup_2w_over_1w"] = thr["speedup_2w_over_1w"]
    checks["speedup_at_least_1.7"] = thr["speedup_2w_over_1w"] >= 1.7
    checks["machine_2thread_speedup_compute_only"] = thr["machine_2thread_speedup"]
    checks["speedup_2w_estimate_from_cpu_time"] = thr["speedup_2w_estimate_from_cpu_time"]
    return {"curves": curves, "throughput": thr, "checks": checks, "plan": str(p.sgd.plan),
            "num_ratings": int(p.data.keys.shape[0]), "order_sensitivity": order}


def _markdown(res: dict[str, Any]) -> str:
    curves = {k: v for k, v in res["curves"].items() if "rmse" in v}
    lines = [f"# mf_convergence\n\nCommand: `{res['command']}`  \nDate: {res['date']}  \n"
             f"Machine: {res['machine']['cpus']} CPUs, load average at start {res['machine']['loadavg_start']}, "
             f"at end {res['machine']['loadavg_end']} (the machine is shared; throughput is best of "
             f"{res['config']['repeats']} single-epoch runs).  \n"
             f"Data: {res['num_ratings']} ratings, {res['config']['users']} users x {res['config']['items']} items, "
             f"rank {res['config']['rank']}, noise 0.1; SGD lr {res['config']['lr']}, reg {res['config']['reg']}.\n",
             "## Checks\n", "| check | value |", "| --- | --- |"]
    for k, v in res["checks"].items():
        lines.append(f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |")
    lines += ["\n## Throughput (one epoch, best of repeats)\n", "| method | ratings/s | per worker | best s | median s |",
              "| --- | --- | --- | --- | --- |"]
    for k, v in res["throughput"].items():
        if isinstance(v, dict) and "ratings_per_s" in v:
            per = v.get("ratings_per_s_per_worker", v["ratings_per_s"])
            lines.append(f"| {k} | {v['ratings_per_s'] / 1e6:.2f}M | {per / 1e6:.2f}M | {v['best_s']:.3f} | "
                         f"{v['median_s']:.3f} |")
    lines += ["\n## Training RMSE per epoch (cumulative seconds in brackets)\n",
              "| epoch | " + " | ".join(curves) + " |", "| --- |" + " --- |" * len(curves)]
    epochs = sorted({e for c in curves.values() for e in c["epoch"]})
    for e in epochs:
        cells = []
        for c in curves.values():
            cells.append(f"{c['rmse'][c['epoch'].index(e)]:.4f} ({c['time_s'][c['epoch'].index(e)]:.2f}s)"
                         if e in c["epoch"] else "")
        lines.append(f"| {e} | " + " | ".join(cells) + " |")
    lines.append("\nsurprise SVD has no per-epoch hook: each of its rows is a separate fit with that many epochs.  ")
    lines.append("\n## Order sensitivity of SGD itself\n\nThe serial loop on a reshuffled copy of the data is the "
                 "yardstick: it sees the same ratings in another order, as orion_par's 2D schedule does.\n")
    lines += ["| lr | init | epoch | serial | serial reshuffled | orion_par 2w |", "| --- | --- | --- | --- | --- | --- |"]
    for o in res["order_sensitivity"]:
        for e, (a, b, c) in enumerate(zip(o["rmse_serial"], o["rmse_serial_reshuffled"], o["rmse_orion_par_2w"], strict=True)):
            lines.append(f"| {o['lr']} | {o['init']} | {e} | {a:.4f} | {b:.4f} | {c:.4f} |")
    lines.append("The Ray curve's first epoch includes starting the actors.\n\n## Plan\n\n```\n" + res["plan"] + "\n```\n")
    return "\n".join(lines)


def _plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, c in res["curves"].items():
        if "rmse" not in c:
            continue
        ax1.plot(c["epoch"], c["rmse"], marker="o", ms=3, label=name)
        ax2.plot(np.maximum(c["time_s"], 1e-3), c["rmse"], marker="o", ms=3, label=name)
    ax1.set(xlabel="epoch", ylabel="training RMSE", title="RMSE vs epoch")
    ax2.set(xlabel="seconds", ylabel="training RMSE", title="RMSE vs time", xscale="log")
    ax1.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.mf_convergence", description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a seconds-long smoke run (written to a temp dir)")
    ap.add_argument("--no-ray", action="store_true", help="skip the Ray executor")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default experiments/results)")
    args = ap.parse_args(argv)
    cfg = TINY if args.tiny else FULL
    out = args.out or (Path(tempfile.mkdtemp(prefix="mf_convergence_")) if args.tiny else
                       Path(__file__).resolve().parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    machine = _machine()
    res = run(cfg, use_ray=not args.no_ray)
    machine["loadavg_end"] = os.getloadavg()
    res.update(command="python -m experiments.mf_convergence " + " ".join(sys.argv[1:] if argv is None else argv),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               versions=_versions(), machine=machine, config=cfg)
    (out / "mf_convergence.json").write_text(json.dumps(res, indent=1, default=float))
    (out / "mf_convergence.md").write_text(_markdown(res))
    _plot(res, out / "mf_convergence.png")
    print(_markdown(res).split("## Training")[0])
    print(f"wrote {out / 'mf_convergence.json'}, .md, .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
