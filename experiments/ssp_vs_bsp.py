"""SSP vs BSP: data-parallel MF and LDA on orion_par.ps with one worker slowed 2x; time to a target loss.

Every worker owns a random share of the data and, each clock, processes one mini-batch of it: it reads
the rows the batch needs from the parameter server, runs the serial kernel on them (numba, GIL released)
and sends the changes as increments.  The straggler does its compute twice as slowly: after computing it
sleeps as long as the compute took.  ``persistent``: worker 0 is always the straggler; ``transient``: each
clock a different, random worker is (a shared cluster).  The workers' links are emulated by a token
bucket of the same budget for every setting (``--link-mbps``), with Bösen's background sender, so what
SSP can hide is both the straggler's lateness and the communication.

The tables are copied each time the minimum clock rises; losses are computed afterwards from those
copies, off the clock.  The target is the loss BSP (s=0) reaches at ``target_frac`` of its clocks.

Run: ``python -m experiments.ssp_vs_bsp`` (full, a few minutes) or ``--tiny`` (seconds).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numba
import numpy as np
from tqdm import tqdm

from models.lda import log_likelihood_per_token, synthetic_corpus
from models.mf import init_factors, rmse, sgd_serial_numba, synthetic_ratings
from orion_par.ps import ClientOptions, LocalPS, TableSpec

STALENESS: tuple[int | None, ...] = (0, 1, 2, 4, None)
BURST_S = 0.002  # the emulated link banks at most 2 ms of idle bandwidth
MF_FULL = dict(users=2000, items=1000, ratings=1_200_000, rank=32, batches=6, epochs=10, lr=0.01, reg=0.02,
               workers=2, link_mbps=200.0)
MF_TINY = dict(users=300, items=200, ratings=20_000, rank=8, batches=4, epochs=3, lr=0.03, reg=0.02,
               workers=2, link_mbps=20.0)
LDA_FULL = dict(docs=3000, doc_len=80, vocab=1500, topics=20, batches=6, epochs=10, workers=2, link_mbps=50.0)
LDA_TINY = dict(docs=100, doc_len=30, vocab=200, topics=5, batches=3, epochs=3, workers=2, link_mbps=20.0)


def slowed(mode: str, worker: int, clock: int, workers: int, seed: int = 0) -> bool:
    """Whether ``worker`` is the straggler at ``clock``."""
    if mode == "none":
        return False
    if mode == "persistent":
        return worker == 0
    return int(np.random.default_rng([seed, clock]).integers(workers)) == worker


def shares(n: int, workers: int, batches: int, seed: int) -> list[list[np.ndarray]]:
    """Record indices: a random share per worker, cut into ``batches`` mini-batches."""
    perm = np.random.default_rng(seed).permutation(n)
    return [np.array_split(part, batches) for part in np.array_split(perm, workers)]


class MFProgram:
    """One clock of data-parallel SGD for matrix factorisation (tables ``W`` and ``H``).

    A clock's mini-batch is processed in ``chunks`` pieces, each reading its rows, computing and sending
    its increments, as a Bösen application does: between clocks there are updates to send early and
    fresh rows to read.  Ratings are visited user by user, so a chunk's ``W`` rows are final once it ends.
    """

    def __init__(self, keys: np.ndarray, values: np.ndarray, cfg: dict[str, Any], straggler: str) -> None:
        self.cfg, self.straggler = cfg, straggler
        self.batches = []
        for worker_batches in shares(keys.shape[0], cfg["workers"], cfg["batches"], seed=3):
            mine = []
            for idx in worker_batches:
                idx = idx[np.argsort(keys[idx, 0], kind="stable")]
                chunks = []
                for part in np.array_split(idx, cfg.get("chunks", 4)):
                    users, u_local = np.unique(keys[part, 0], return_inverse=True)
                    items, i_local = np.unique(keys[part, 1], return_inverse=True)
                    local = np.ascontiguousarray(np.stack([u_local, i_local], axis=1).astype(np.int64))
                    chunks.append((users, items, local, np.ascontiguousarray(values[part])))
                mine.append(chunks)
            self.batches.append(mine)

    def __call__(self, client: Any, worker: int, clock: int) -> float:
        compute = 0.0
        for users, items, local, vals in self.batches[worker][clock % self.cfg["batches"]]:
            W = client.get("W", users)
            H = client.get("H", items)
            W0, H0 = W.copy(), H.copy()
            t0 = time.perf_counter()
            sgd_serial_numba(local, vals, W, H, self.cfg["lr"], self.cfg["reg"])
            compute += time.perf_counter() - t0
            client.inc("W", users, W - W0)
            client.inc("H", items, H - H0)
        if slowed(self.straggler, worker, clock, self.cfg["workers"]):
            time.sleep(compute)  # the 2x straggler: its compute takes twice as long
        return compute


@numba.njit(nogil=True, cache=True)
def _gibbs_batch(words: np.ndarray, docs: np.ndarray, z: np.ndarray, ndk: np.ndarray, nwk: np.ndarray,
                 nk: np.ndarray, alpha: float, beta: float, vbeta: float, seed: int) -> None:
    np.random.seed(seed)
    K = nk.shape[0]
    cdf = np.empty(K)
    for n in range(words.shape[0]):
        w, d, old = words[n], docs[n], z[n]
        ndk[d, old] -= 1
        nwk[w, old] -= 1
        nk[old] -= 1
        total = 0.0
        for k in range(K):
            total += (ndk[d, k] + alpha) * (max(nwk[w, k], 0.0) + beta) / (max(nk[k], 0.0) + vbeta)
            cdf[k] = total
        u = np.random.random() * total
        new = 0
        while new < K - 1 and cdf[new] <= u:
            new += 1
        z[n] = new
        ndk[d, new] += 1
        nwk[w, new] += 1
        nk[new] += 1


class LDAProgram:
    """One clock of data-parallel collapsed Gibbs sampling (tables ``nwk``, ``nk``; ``ndk`` rows by owner)."""

    def __init__(self, corpus: Any, z0: np.ndarray, cfg: dict[str, Any], straggler: str) -> None:
        self.cfg, self.straggler = cfg, straggler
        keys = corpus.tokens.keys
        self.alpha, self.beta = corpus.alpha, corpus.beta
        self.vbeta = corpus.beta * corpus.vocab_size
        docs_by_worker = np.array_split(np.random.default_rng(3).permutation(corpus.doc_lengths.size), cfg["workers"])
        self.batches = []
        self.z = z0.copy()
        for docs in docs_by_worker:
            mine = []
            for part in np.array_split(docs, cfg["batches"]):
                idx = np.flatnonzero(np.isin(keys[:, 0], part))
                words, w_local = np.unique(keys[idx, 1], return_inverse=True)
                dl = np.searchsorted(np.sort(part), keys[idx, 0])
                mine.append((idx, np.sort(part), words, w_local.astype(np.int64), dl.astype(np.int64)))
            self.batches.append(mine)

    def __call__(self, client: Any, worker: int, clock: int) -> float:
        idx, docs, words, w_local, d_local = self.batches[worker][clock % self.cfg["batches"]]
        nwk = client.get("nwk", words)
        nk = client.get("nk", [0])[0]
        ndk = client.get("ndk", docs)
        before = (nwk.copy(), nk.copy(), ndk.copy())
        z = self.z[idx]
        t0 = time.perf_counter()
        _gibbs_batch(w_local, d_local, z, ndk, nwk, nk, self.alpha, self.beta, self.vbeta, 1000 * clock + worker)
        compute = time.perf_counter() - t0
        self.z[idx] = z
        client.inc("nwk", words, nwk - before[0])
        client.inc("nk", [0], (nk - before[1])[None, :])
        client.inc("ndk", docs, ndk - before[2])
        if slowed(self.straggler, worker, clock, self.cfg["workers"]):
            time.sleep(compute)
        return compute


def mf_problem(cfg: dict[str, Any]) -> dict[str, Any]:
    data = synthetic_ratings(cfg["users"], cfg["items"], cfg["ratings"], cfg["rank"], seed=0)
    W0, H0 = init_factors(cfg["users"], cfg["items"], cfg["rank"], seed=1, scale=0.3)
    keys, values = data.keys, data.values
    return {"keys": keys, "values": values, "init": {"W": np.asarray(W0), "H": np.asarray(H0)},
            "loss": lambda t: rmse(keys, values, t["W"], t["H"]), "lower_is_better": True, "cfg": cfg,
            "tables": lambda s: [TableSpec("W", cfg["users"], cfg["rank"], staleness=s),
                                 TableSpec("H", cfg["items"], cfg["rank"], staleness=s)],
            "program": lambda straggler: MFProgram(keys, values, cfg, straggler)}


def lda_problem(cfg: dict[str, Any]) -> dict[str, Any]:
    corpus = synthetic_corpus(cfg["docs"], cfg["doc_len"], cfg["vocab"], cfg["topics"], seed=0)
    keys, K = corpus.tokens.keys, cfg["topics"]
    z0 = np.random.default_rng(0).integers(0, K, keys.shape[0])
    ndk = np.zeros((cfg["docs"], K))
    nwk = np.zeros((cfg["vocab"], K))
    np.add.at(ndk, (keys[:, 0], z0), 1)
    np.add.at(nwk, (keys[:, 1], z0), 1)

    def loss(t: dict[str, Any]) -> float:
        return log_likelihood_per_token(np.rint(t["ndk"]).astype(np.int64), np.rint(t["nwk"]).astype(np.int64),
                                        corpus.alpha, corpus.beta)

    return {"init": {"ndk": ndk, "nwk": nwk, "nk": nwk.sum(axis=0)[None, :]}, "loss": loss,
            "lower_is_better": False, "cfg": cfg,
            "tables": lambda s: [TableSpec("nwk", cfg["vocab"], K, staleness=s), TableSpec("nk", 1, K, staleness=s),
                                 TableSpec("ndk", cfg["docs"], K, staleness=s)],
            "program": lambda straggler: LDAProgram(corpus, z0, cfg, straggler)}


def run_setting(problem: dict[str, Any], staleness: int | None, options: ClientOptions, straggler: str
                ) -> dict[str, Any]:
    """One data-parallel run; returns the loss curve against wall time and clocks, and the PS stats."""
    cfg = problem["cfg"]
    ps = LocalPS(problem["tables"](staleness), cfg["workers"], options=options)
    for name, values in problem["init"].items():
        ps.initialize(name, values)
    clocks = cfg["epochs"] * cfg["batches"]
    result = ps.run(problem["program"](straggler), clocks, snapshot_every=1)
    points = [(0, 0.0, problem["loss"](problem["init"]))]
    points += [(c, t, problem["loss"](tables)) for c, t, tables in result.snapshots]
    blocked = [round(s.blocked_s, 3) for s in result.stats]
    hist: dict[str, int] = {}
    for s in result.stats:
        for k, v in s.staleness_hist.items():
            hist[str(k)] = hist.get(str(k), 0) + v
    return {"clock": [p[0] for p in points], "time_s": [round(p[1], 4) for p in points],
            "loss": [float(p[2]) for p in points], "elapsed_s": round(result.elapsed_s, 3), "blocked_s": blocked,
            "bytes_sent": sum(s.bytes_sent for s in result.stats), "early_bytes": sum(s.early_bytes for s in result.stats),
            "staleness_hist": hist}


def time_to(curve: dict[str, Any], target: float, lower_is_better: bool) -> float | None:
    """Seconds until the loss first reaches ``target`` (None if it never does)."""
    for t, loss in zip(curve["time_s"], curve["loss"], strict=True):
        if (loss <= target) if lower_is_better else (loss >= target):
            return float(t)
    return None


def target_from(curve: dict[str, Any], frac: float) -> float:
    """The loss a reference run reaches at ``frac`` of its clocks."""
    return float(curve["loss"][max(1, int(round(frac * (len(curve["loss"]) - 1))))])


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("numpy", "numba", "ray"):
        try:
            out[name] = __import__(name).__version__
        except ImportError as e:
            out[name] = f"not installed ({e})"
    return out


def machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor(),
            "loadavg_start": os.getloadavg()}


def write(out: Path, name: str, record: dict[str, Any], md: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(record, indent=1, default=str))
    (out / f"{name}.md").write_text(md)


def _compare(problem: dict[str, Any], straggler: str, frac: float, repeats: int, bar: Any) -> dict[str, Any]:
    link = problem["cfg"]["link_mbps"] * 1e6
    warm = dict(problem, cfg=dict(problem["cfg"], epochs=1))
    run_setting(warm, 0, ClientOptions(), "none")  # compile the kernels before anything is timed
    runs: dict[str, list[dict[str, Any]]] = {}
    for _ in range(repeats):  # interleaved, so a slow spell of the shared machine hits every setting
        for s in STALENESS:
            opts = ClientOptions(bandwidth_bytes_per_s=link, burst_bytes=int(link * BURST_S), async_send=True)
            runs.setdefault("ASP" if s is None else f"s={s}", []).append(run_setting(problem, s, opts, straggler))
            bar.update(1)
    target = float(np.median([target_from(r, frac) for r in runs["s=0"]]))
    lower = problem["lower_is_better"]
    table = {}
    for label, rs in runs.items():
        times = [time_to(r, target, lower) for r in rs]
        ok = [t for t in times if t is not None]
        table[label] = {"time_to_target_s": float(np.median(ok)) if len(ok) == len(times) else None,
                        "times_s": times, "final_loss": float(np.median([r["loss"][-1] for r in rs])),
                        "blocked_s": rs[0]["blocked_s"], "staleness_hist": rs[0]["staleness_hist"]}
    bsp = table["s=0"]["time_to_target_s"]
    for row in table.values():
        t = row["time_to_target_s"]
        row["speedup_vs_bsp"] = round(bsp / t, 3) if bsp and t else None
    return {"target": target, "table": table, "curves": {k: v[0] for k, v in runs.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.ssp_vs_bsp", description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="seconds-long smoke run")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--target-frac", type=float, default=0.75)
    args = ap.parse_args(argv)
    mf_cfg, lda_cfg = (MF_TINY, LDA_TINY) if args.tiny else (MF_FULL, LDA_FULL)
    repeats = args.repeats or (1 if args.tiny else 2)
    cases = [("mf", "persistent", mf_problem(mf_cfg)), ("mf", "transient", mf_problem(mf_cfg)),
             ("lda", "persistent", lda_problem(lda_cfg))]
    record: dict[str, Any] = {"command": "python -m experiments.ssp_vs_bsp " + " ".join(argv or sys.argv[1:]),
                              "date": datetime.datetime.now().isoformat(timespec="seconds"),
                              "versions": versions(), "machine": machine(), "tiny": args.tiny,
                              "parameters": {"mf": mf_cfg, "lda": lda_cfg, "repeats": repeats,
                                             "target_frac": args.target_frac, "staleness": list(STALENESS)},
                              "results": {}}
    with tqdm(total=len(cases) * len(STALENESS) * repeats, desc="ssp_vs_bsp", disable=None) as bar:
        for model, straggler, problem in cases:
            record["results"][f"{model}/{straggler}"] = _compare(problem, straggler, args.target_frac, repeats, bar)
    record["machine"]["loadavg_end"] = os.getloadavg()
    write(Path(args.out), "ssp_vs_bsp", record, markdown(record))
    return 0


def markdown(rec: dict[str, Any]) -> str:
    lines = ["# ssp_vs_bsp", "", f"`{rec['command']}` on {rec['date']}, {rec['machine']['cpus']} CPUs "
             f"(load {rec['machine']['loadavg_start'][0]:.1f} at start); {rec['versions']}.", "",
             "Data-parallel MF (RMSE) and LDA (log-likelihood per token) on `orion_par.ps` (local transport, "
             "2 workers, background sender, emulated link), one worker's compute slowed 2x. Target: the loss "
             "BSP reaches at the target fraction of its clocks; time = median wall time to reach it.", ""]
    for case, res in rec["results"].items():
        lines += [f"## {case} (target {res['target']:.4f})", "",
                  "| setting | time to target (s) | speedup vs BSP | final loss | blocked s per worker |",
                  "|---|---|---|---|---|"]
        for label, row in res["table"].items():
            t = row["time_to_target_s"]
            lines.append(f"| {label} | {'not reached' if t is None else f'{t:.2f}'} | "
                         f"{row['speedup_vs_bsp'] or '-'} | {row['final_loss']:.4f} | {row['blocked_s']} |")
        lines.append("")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
