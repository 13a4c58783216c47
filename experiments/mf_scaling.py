"""MF scaling: orion_par's single-epoch ratings/s as workers grow, on whatever cores the machine has.

The MF problem of ``experiments.mf_convergence`` (rank 32, 2M ratings), one epoch at a time, for worker
counts 1, 2, 4, ... up to the machine's CPU count (or ``--workers``), the counts interleaved in every repeat so
that all see the same load. Reports the median time per count, ratings/s in all and per worker, and each
count's speedup over one worker (from the medians and the median of each repeat's own ratio).

Run: ``python -m experiments.mf_scaling`` (``--repeats 15``; ``--tiny`` for a seconds-long smoke run written to
a temp dir). Written to ``experiments/results/mf_scaling.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from experiments._machine import machine_info
from experiments.mf_convergence import FULL, TINY, Problem


def default_workers(cpus: int | None = None) -> list[int]:
    """1, 2, 4, ... up to the CPU count, and the CPU count itself.

    >>> default_workers(6)
    [1, 2, 4, 6]
    >>> default_workers(1)
    [1]
    """
    cpus = max(1, cpus if cpus is not None else os.cpu_count() or 1)
    counts = [1]
    while counts[-1] * 2 <= cpus:
        counts.append(counts[-1] * 2)
    if counts[-1] != cpus:
        counts.append(cpus)
    return counts


def measure(p: Problem, workers: list[int], repeats: int) -> dict[str, Any]:
    """Seconds per epoch for each worker count, ``repeats`` times, the counts interleaved in each repeat."""
    for w in workers:
        p.sgd.run(workers=w, epochs=0)  # compile and build each schedule outside the timings
    times: dict[int, list[float]] = {w: [] for w in workers}
    for _ in tqdm(range(repeats), desc="mf scaling", leave=False):
        for w in workers:
            times[w].append(p.sgd.run(workers=w).elapsed_s)
    n = int(p.data.keys.shape[0])
    one = np.array(times[workers[0]]) if workers[0] == 1 else None
    rows = []
    for w in workers:
        t = np.array(times[w])
        row = {"workers": w, "median_s": float(np.median(t)), "best_s": float(t.min()), "times_s": t.tolist(),
               "ratings_per_s": n / float(np.median(t)), "ratings_per_s_per_worker": n / float(np.median(t)) / w}
        if one is not None:
            row["speedup_median"] = float(np.median(one) / np.median(t))
            row["speedup_paired_median"] = float(np.median(one / t))
        rows.append(row)
    return {"num_ratings": n, "repeats": repeats, "rows": rows}


def markdown(res: dict[str, Any]) -> str:
    c = res["config"]
    lines = [f"# mf_scaling\n\nCommand: `{res['command']}`  \nDate: {res['date']}  \n"
             f"Machine: {res['machine']['cpus']} CPUs ({res['machine']['platform']}), load average at start "
             f"{res['machine']['loadavg_start'][0]:.2f}, at end {res['machine']['loadavg_end'][0]:.2f}.  \n"
             f"Data: {res['num_ratings']} ratings, {c['users']} users x {c['items']} items, rank {c['rank']}; "
             f"SGD lr {c['lr']}, reg {c['reg']}. One epoch per timing, {res['repeats']} repeats, worker counts "
             "interleaved.\n",
             "| workers | median s | ratings/s | per worker | speedup over 1 worker (medians) | (paired) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in res["rows"]:
        sp = (f"{r['speedup_median']:.2f}x | {r['speedup_paired_median']:.2f}x" if "speedup_median" in r
              else "- | -")
        lines.append(f"| {r['workers']} | {r['median_s']:.4f} | {r['ratings_per_s'] / 1e6:.2f}M | "
                     f"{r['ratings_per_s_per_worker'] / 1e6:.2f}M | {sp} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.mf_scaling", description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a seconds-long smoke run (written to a temp dir)")
    ap.add_argument("--repeats", type=int, default=None, help="timed epochs per worker count (default 15; tiny 2)")
    ap.add_argument("--workers", type=str, default=None,
                    help="comma-separated worker counts (default 1, 2, 4, ... up to the CPU count)")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default experiments/results)")
    args = ap.parse_args(argv)
    try:
        workers = [int(x) for x in args.workers.split(",")] if args.workers else default_workers()
    except ValueError:
        ap.error(f"--workers takes comma-separated positive integers such as 1,2,4; got {args.workers!r}")
    if any(w < 1 for w in workers):
        ap.error(f"--workers takes positive integers; got {args.workers!r}")
    if args.repeats is not None and args.repeats < 1:
        ap.error(f"--repeats must be at least 1; got {args.repeats}")
    cfg = dict(TINY if args.tiny else FULL)
    repeats = args.repeats or (2 if args.tiny else 15)
    out = args.out or (Path(tempfile.mkdtemp(prefix="mf_scaling_")) if args.tiny else
                       Path(__file__).resolve().parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    t0 = time.perf_counter()
    res = measure(Problem(cfg), workers, repeats)
    machine["loadavg_end"] = os.getloadavg()
    res.update(command="python -m experiments.mf_scaling " + " ".join(sys.argv[1:] if argv is None else argv),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), machine=machine,
               config=cfg, wall_s=time.perf_counter() - t0)
    text = markdown(res)
    (out / "mf_scaling.json").write_text(json.dumps(res, indent=1))
    (out / "mf_scaling.md").write_text(text)
    print(text)
    print(f"wrote {out / 'mf_scaling'}.json and .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
