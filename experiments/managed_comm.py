"""Managed communication at a limited bandwidth budget: plain SSP vs prioritised early sending (Bösen, P3).

Data-parallel LDA (collapsed Gibbs) and MF (SGD) on ``orion_par.ps`` as in ``ssp_vs_bsp`` (emulated
machines: a clock's compute takes ``clock_s``; no straggler), in Bösen's regime: a clock is one pass over
a worker's share of the data, done in ``chunks`` pieces that each read their rows, compute and ``inc``
their changes.  Every worker's
link is limited by a token bucket with the same budget and depth in every setting, and every setting
has Bösen's background communication thread (``clock()`` returns at once).  Settings:

* ``plain SSP``: the oplog leaves at ``clock()``; the link idles while the worker computes, and the
  clock-boundary burst is throttled by the budget, so the others see a clock's updates a clock or more late;
* ``plain SSP, sync send``: the same, but the worker waits at ``clock()`` until its oplog is sent;
* ``managed: magnitude``: between clocks a background flusher spends the budget the link would leave idle
  on the rows with the largest relative change ``sum |delta| / sum |value|`` (Bösen); the server pushes
  the changed rows to the other workers' caches, so reads between clocks see them;
* ``managed: absolute``: the same, rows with the largest accumulated change ``sum |delta|`` first;
* ``managed: consumption``: the same, rows in the order this worker read them in its previous clock (P3);
* ``managed: random``: the same, rows in random order (no prioritisation; what prioritisation adds);
* ``managed: magnitude, score only``: ``managed: magnitude`` as it was before the two fixes below (the
  score alone decides, resends included, and the clock-boundary flush is one message) -- what they add;
* ``managed: push only``: a reference: the server pushes every arriving update to the other workers' caches
  as in the managed settings, but nothing is sent early (the flusher never wakes during the run) -- what
  early sending and its priorities add on top of the push;
* ``plain SSP, unlimited link``: a reference, not a contender: plain SSP with no budget, so each clock's
  updates arrive at the clock boundary at once -- how much sooner faster communication alone could get.

The flusher is charged from the same bucket as the clock-boundary flush, for exactly the bytes it sends;
a message costs its payload (row ids and values) only, in every mode.  Reported per setting: time until
the server's model reaches a target loss (the one plain SSP reaches at ``target_frac`` of its clocks),
the loss at each clock boundary, bytes sent in all and until the target, and the share sent early
(and per table: which rows the policy chose).  The server's model is copied every ``clock_s /
SNAPSHOTS_PER_CLOCK`` seconds and at every clock boundary: plain SSP's model changes in steps when a
clock's burst lands (timed exactly by the boundary copies), managed communication's changes between them,
so copies only every ``clock_s`` would time managed runs up to a clock late.  Each case states how much of
the link plain SSP's updates fill (``link use``): near 100% the link is the bottleneck for every setting,
far below it early sending has nothing to gain.

Why MF gained less than LDA (measured on the previous results, 7 repeats; see ``results/managed_comm.md``
of 2026-11-23T03:01 in git): each of MF's 8 chunks rewrites all 500 ``H`` rows (every item is rated in
every chunk) while a chunk's ``W`` rows are final once it ends (ratings are visited user by user), and the
relative (and absolute) change of a ``W`` row and of an ``H`` row after one chunk are alike, so the scores
cannot tell them apart.  At 8 MB/s (link use 74%) the scored policies spent the budget resending ``H``
(13-17 MB of ``H`` sent early per run, where plain SSP sends 5.3 MB of ``H`` in all) and the ``W`` rows
waited for the clock-boundary burst; ``random`` resent less and did best (14.2%).  The boundary burst
went as one message per shard, so its first rows reached the readers only with its last.  At 12 MB/s the
budget does not bind for managed communication at all (95-98% of its bytes leave early, every policy picks
the same rows): its loss per clock already matched the unlimited link's, and what is left is what fresher
reads are worth to MF here -- all workers visit users in the same order, so a ``W`` row sent early is read
by the others only in the same chunk of the next clock, and only ``H`` is read fresher within a clock.
Two fixes in ``orion_par.ps`` (``ClientOptions.resends_last``, ``ordered_boundary``): rows not yet sent
in the clock go before resends, and the boundary flush leaves in the policy's order in pieces of
``FLUSH_INTERVAL_S`` of link time, each pushed to the readers as it lands.  With them (``--repeats 5``,
2026-11-23, load 2.8 at start): at 8 MB/s every policy sends all of ``W`` early (42 MB, against 19 MB for
``score only``), its loss per clock matches the unlimited link's, and it reaches the target 20.6-21.6%
sooner than plain SSP (``score only`` 15.3% in the same interleaved run, 11.3% in the previous results);
at 12 MB/s 13.4-13.9% for every policy and for ``score only`` alike (the budget does not bind); LDA at
1 MB/s 16.5% with magnitude (``score only`` 4.5%).  Managed communication costs CPU (a sender, a flusher
and server pushes per worker): on a loaded machine (load 6) its emulated clocks overran and the MF
times lost most of the gain (see the git history of ``results/managed_comm.md``), so compare runs at the
recorded load.

Run: ``python -m experiments.managed_comm`` or ``--tiny``.
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

from experiments.ssp_vs_bsp import (
    BURST_S,
    LDA_TINY,
    MF_TINY,
    lda_problem,
    loss_at_clock,
    machine,
    mf_problem,
    run_setting,
    target_from,
    time_to,
    versions,
    write,
)
from orion_par.ps import ClientOptions, LocalPS

STALENESS = 1
FLUSH_INTERVAL_S = 0.02  # the flusher sends 20 ms of link time at a time
SNAPSHOTS_PER_CLOCK = 8  # the server's model is copied every clock_s / 8 (and at every clock boundary)
MF_MANAGED = dict(users=4000, items=500, ratings=1_200_000, rank=32, batches=1, chunks=8, epochs=10, lr=0.01,
                  reg=0.02, workers=4, clock_s=0.2, link_mbps=8.0)
LDA_MANAGED = dict(docs=3000, doc_len=80, vocab=1500, topics=20, batches=1, chunks=8, epochs=10, workers=4,
                   clock_s=0.2, link_mbps=2.0)  # tables nwk and nk; each worker keeps its documents' ndk
TINY = {"lda": dict(LDA_TINY, batches=1, chunks=4, epochs=4, clock_s=0.02, link_mbps=1.0),
        "mf": dict(MF_TINY, batches=1, chunks=4, epochs=4, clock_s=0.02, link_mbps=2.0)}
# Two budgets per model: plain SSP's updates fill ~45-50% of the link (spare bandwidth during compute)
# and ~75-85% (little to spare). Per worker and clock LDA sends ~0.17 MB, MF ~1.19 MB.
FULL = {"lda, 2 MB/s": LDA_MANAGED, "lda, 1 MB/s": dict(LDA_MANAGED, link_mbps=1.0),
        "mf, 12 MB/s": dict(MF_MANAGED, link_mbps=12.0), "mf, 8 MB/s": MF_MANAGED}
PROBLEMS = {"lda": lda_problem, "mf": mf_problem}
UNLIMITED = "plain SSP, unlimited link"
PUSH_ONLY = "managed: push only"  # server push on arrival, no early sends (a flush interval longer than any run)
SCORE_ONLY = "managed: magnitude, score only"  # Bösen's rule as before: the score alone, one boundary message


def settings(link: float) -> dict[str, ClientOptions]:
    common = dict(bandwidth_bytes_per_s=link, burst_bytes=int(link * BURST_S))
    managed = dict(common, async_send=True, flush_interval_s=FLUSH_INTERVAL_S)
    return {"plain SSP": ClientOptions(**common, async_send=True),
            "plain SSP, sync send": ClientOptions(**common),
            "managed: magnitude": ClientOptions(**managed, policy="magnitude"),
            "managed: absolute": ClientOptions(**managed, policy="absolute"),
            "managed: consumption": ClientOptions(**managed, policy="consumption"),
            "managed: random": ClientOptions(**managed, policy="random"),
            SCORE_ONLY: ClientOptions(**managed, policy="magnitude", resends_last=False, ordered_boundary=False),
            PUSH_ONLY: ClientOptions(**dict(managed, flush_interval_s=1e9), policy="random"),
            UNLIMITED: ClientOptions(async_send=True)}


def run_once(problem: dict[str, Any], options: ClientOptions) -> dict[str, Any]:
    """``ssp_vs_bsp.run_setting`` (no straggler), with the model copied ``SNAPSHOTS_PER_CLOCK`` times a clock."""
    cfg = problem["cfg"]
    ps = LocalPS(problem["tables"](STALENESS), cfg["workers"], options=options)
    for name, values in problem["init"].items():
        ps.initialize(name, values)
    clocks = cfg["epochs"] * cfg["batches"]
    program = problem["program"]("none", 0)
    cpu0 = time.process_time()
    result = ps.run(program, clocks, snapshot_every=1, snapshot_every_s=cfg["clock_s"] / SNAPSHOTS_PER_CLOCK,
                    observe=getattr(program, "observe", None))
    cpu_s = time.process_time() - cpu0
    points = [(0, 0.0, problem["loss"]({**problem["init"], **problem["local"]}))]
    points += [(c, t, problem["loss"](tables)) for c, t, tables in result.snapshots]
    hist: dict[str, int] = {}
    early: dict[str, int] = {}
    for st in result.stats:
        for k, v in st.staleness_hist.items():
            hist[str(k)] = hist.get(str(k), 0) + v
        for k, v in st.early_bytes_by_table.items():
            early[k] = early.get(k, 0) + v
    return {"clock": [p[0] for p in points], "time_s": [round(p[1], 4) for p in points],
            "loss": [float(p[2]) for p in points], "clocks": clocks, "elapsed_s": round(result.elapsed_s, 3),
            "cpu_s": round(cpu_s, 3), "blocked_s": [round(st.blocked_s, 3) for st in result.stats],
            "throttled_s": [round(st.throttled_s, 3) for st in result.stats],
            "bytes_sent": sum(st.bytes_sent for st in result.stats),
            "early_bytes": sum(st.early_bytes for st in result.stats), "early_bytes_by_table": early,
            "messages_sent": sum(st.messages_sent for st in result.stats), "overruns": program.pace.overruns,
            "sent": [(round(t, 4), b) for t, b in result.sent], "staleness_hist": hist}


def bytes_until(run: dict[str, Any], t: float | None) -> int | None:
    """Bytes all workers had sent when the server's model reached the target (None if it never did)."""
    if t is None:
        return None
    before = [b for s, b in run["sent"] if s <= t]
    return before[-1] if before else 0


def summarise(runs: dict[str, list[dict[str, Any]]], target: float, lower: bool) -> dict[str, Any]:
    table = {}
    for label, rs in runs.items():
        times = [time_to(r, target, lower) for r in rs]
        done = [t for t in times if t is not None]
        to_target = [bytes_until(r, t) for r, t in zip(rs, times, strict=True)]
        clocks = rs[0]["clocks"]
        table[label] = {"time_to_target_s": float(np.median(done)) if len(done) == len(times) else None,
                        "times_s": times, "final_loss": float(np.median([r["loss"][-1] for r in rs])),
                        "loss_at_clock": [round(float(np.median([loss_at_clock(r, c) for r in rs])), 4)
                                          for c in range(1, clocks + 1)],
                        "bytes_sent": int(np.median([r["bytes_sent"] for r in rs])),
                        "bytes_to_target": (int(np.median([b for b in to_target if b is not None]))
                                            if all(b is not None for b in to_target) else None),
                        "early_share": float(np.median([r["early_bytes"] / r["bytes_sent"] for r in rs])),
                        "early_mb_by_table": {t: round(float(np.median([r["early_bytes_by_table"].get(t, 0)
                                                                        for r in rs])) / 1e6, 3)
                                              for t in sorted({t for r in rs for t in r["early_bytes_by_table"]})},
                        "messages_sent": int(np.median([r["messages_sent"] for r in rs])),
                        "s_per_clock": float(np.median([r["elapsed_s"] / clocks for r in rs])),
                        "cpu_s": float(np.median([r["cpu_s"] for r in rs])),
                        "elapsed_s": float(np.median([r["elapsed_s"] for r in rs])),
                        "overruns": [r["overruns"] for r in rs], "blocked_s": rs[0]["blocked_s"],
                        "throttled_s": rs[0]["throttled_s"], "staleness_hist": rs[0]["staleness_hist"]}
    base = table["plain SSP"]["time_to_target_s"]
    for row in table.values():
        t = row["time_to_target_s"]
        row["sooner_than_plain_pct"] = round(100 * (1 - t / base), 1) if base and t else None
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.managed_comm", description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--link-mbps", type=float, default=None, help="per-worker budget in MB/s for every case")
    ap.add_argument("--target-frac", type=float, default=0.75)
    args = ap.parse_args(argv)
    repeats = args.repeats or (1 if args.tiny else 5)
    cases = TINY if args.tiny else FULL
    record: dict[str, Any] = {
        "command": "python -m experiments.managed_comm " + " ".join(argv or sys.argv[1:]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "versions": versions(), "machine": machine(),
        "tiny": args.tiny, "parameters": {"staleness": STALENESS, "repeats": repeats, "target_frac": args.target_frac,
                                          "flush_interval_s": FLUSH_INTERVAL_S, "burst_s": BURST_S,
                                          "snapshots_per_clock": SNAPSHOTS_PER_CLOCK},
        "results": {}}
    with tqdm(total=repeats * len(cases) * len(settings(1.0)), desc="managed_comm", disable=None) as bar:
        for name, base in cases.items():
            cfg = dict(base, link_mbps=args.link_mbps or base["link_mbps"])
            record["parameters"][name] = cfg
            record["results"][name] = _compare(PROBLEMS[name.split(",")[0]](cfg), repeats, args.target_frac, bar)
    record["machine"]["loadavg_end"] = os.getloadavg()
    write(Path(args.out), "managed_comm", record, markdown(record))
    return 0


def _compare(problem: dict[str, Any], repeats: int, frac: float, bar: Any) -> dict[str, Any]:
    cfg = problem["cfg"]
    run_setting(dict(problem, cfg=dict(cfg, epochs=1, clock_s=None)), STALENESS, ClientOptions(), "none")  # compile
    runs: dict[str, list[dict[str, Any]]] = {}
    opts = settings(cfg["link_mbps"] * 1e6)
    for _ in range(repeats):  # interleaved: a slow spell of the shared machine hits every setting
        for label, o in opts.items():
            runs.setdefault(label, []).append(run_once(problem, o))
            bar.update(1)
    target = float(np.median([target_from(r, frac) for r in runs["plain SSP"]]))
    per_clock = float(np.median([r["bytes_sent"] for r in runs["plain SSP"]])) / (cfg["workers"] * runs["plain SSP"][0]["clocks"])
    return {"target": target, "plain_bytes_per_worker_clock": per_clock,
            "link_use": per_clock / (cfg["link_mbps"] * 1e6 * cfg["clock_s"]),
            "table": summarise(runs, target, problem["lower_is_better"]),
            "curves": {k: {f: v[0][f] for f in ("clock", "time_s", "loss")} for k, v in runs.items()}}


def markdown(rec: dict[str, Any]) -> str:
    p = rec["parameters"]
    lines = ["# managed_comm", "", f"`{rec['command']}` on {rec['date']}, {rec['machine']['cpus']} CPUs "
             f"(load {rec['machine']['loadavg_start'][0]:.1f} at start); {rec['versions']}.", "",
             f"Data-parallel LDA (log-likelihood per token, higher is better) and MF (training RMSE) on "
             f"`orion_par.ps`, staleness {p['staleness']}, every worker's link limited by a token bucket with the "
             f"same budget and a depth of {p['burst_s'] * 1e3:g} ms in every setting; all settings but 'sync send' "
             f"have a background sender. Target: the loss plain SSP reaches at {p['target_frac']:.0%} of its clocks, "
             f"reached on the server's model (copied every 1/{p.get('snapshots_per_clock', 1)} of a clock and at "
             f"every clock boundary); median of {p['repeats']} interleaved runs. 'link use': the share of the link "
             "plain SSP's updates fill (bytes per clock / (budget x clock's compute)). 'plain SSP, unlimited link' "
             "is a reference (no budget), and 'managed: push only' one (the managed settings' server push, nothing sent "
             "early), not contenders. See the script's docstring for the settings.", ""]
    for name, res in rec["results"].items():
        c = p[name]
        lines += [f"## {name}: {c['workers']} emulated machines, a clock's compute {c['clock_s']} s (one pass over a "
                  f"worker's share, {c['chunks']} chunks), budget {c['link_mbps']} MB/s per worker, link use "
                  f"{res.get('link_use', float('nan')):.0%}; target {res['target']:.4f}", "",
                  "| setting | time to target (s) | sooner than plain SSP | loss after clocks 2, 4, 6 | final loss "
                  "| MB sent | MB to target | sent early | early MB by table | s per clock | CPU s |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for label, row in res["table"].items():
            t, pct, b = row["time_to_target_s"], row["sooner_than_plain_pct"], row["bytes_to_target"]
            at = row["loss_at_clock"]
            lines.append(f"| {label} | {'not reached' if t is None else f'{t:.2f}'} | "
                         f"{'-' if pct is None else f'{pct}%'} | "
                         f"{', '.join(f'{at[i]:.3f}' for i in (1, 3, 5) if i < len(at))} | {row['final_loss']:.4f} | "
                         f"{row['bytes_sent'] / 1e6:.1f} | {'-' if b is None else f'{b / 1e6:.1f}'} | "
                         f"{row['early_share']:.0%} | "
                         f"{', '.join(f'{t} {v:.2f}' for t, v in row.get('early_mb_by_table', {}).items()) or '-'} | "
                         f"{row['s_per_clock']:.3f} | {row['cpu_s']:.1f} |")
        lines.append("")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
