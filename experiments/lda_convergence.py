"""LDA convergence: log-likelihood per token vs time for serial Gibbs, orion_par and tomotopy.

All samplers fit the same synthetic corpus (drawn from a known LDA model) with the same priors:

* ``serial``: the collapsed-Gibbs loop body compiled, run serially in data order (``run_serial``);
* ``orion_par 1w`` / ``orion_par 2w``: the same body under ``@parallel_for`` (2D plan: documents in
  space, words in time, topic totals through a Buffer), local threads;
* ``tomotopy``: tomotopy's LDAModel trained single-threaded (the reference implementation).

The log-likelihood is the joint ``log p(w, z) / N`` computed from each sampler's counts with one
function (``models.lda.log_likelihood_per_token``), so all curves are comparable; tomotopy's own
``ll_per_word`` is recorded as well.

A single collapsed-Gibbs chain settles in one of several local modes (topics merged or split), so one
chain against one chain mostly measures chain-to-chain variance.  Each method therefore runs several
chains (``chains``; chain ``c`` of serial and of orion_par 2w share the initial assignment and random
seeds, orion_par 1w's chains use other ones: one worker runs the serial loop itself, checked bitwise on
a short run, so its chains are serial chains with other seeds and the serial 1w gap of means is the
serial-vs-serial yardstick).  The check ``final_ll_within_1pct`` compares the *mean* final
log-likelihood per token over the chains: ``|mean(method) - mean(serial)| / |mean(serial)| <= 1%``.

A throughput phase compares tokens/s per worker with tomotopy at two topic counts (medians of
interleaved repeats, with the load average); check: tokens/s per worker within 2x of tomotopy
single-threaded.

Run: ``python -m experiments.lda_convergence`` (full, a few minutes) or ``--tiny`` (seconds);
``--throughput-only --repeats 11`` re-measures only the throughput (for a quiet moment on a shared machine).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from experiments._machine import versions
from models.lda import Corpus, LdaState, log_likelihood_per_token, parallel_gibbs, synthetic_corpus

FULL = dict(docs=10000, doc_len=100, vocab=10000, topics=20, alpha=0.1, beta=0.01, epochs=150, chains=6,
            throughput_topics=[20, 50], throughput_epochs=3, repeats=7)
TINY = dict(docs=200, doc_len=50, vocab=500, topics=10, alpha=0.1, beta=0.01, epochs=3, chains=2,
            throughput_topics=[10], throughput_epochs=1, repeats=1)
METHODS = ("serial", "orion_par 1w", "orion_par 2w", "tomotopy")


def _ll(state: LdaState) -> float:
    return log_likelihood_per_token(state.ndk, state.nwk, state.alpha, state.beta)


def _orion_curve(gibbs: Any, state: LdaState, init: LdaState, label: str, epochs: int, workers: int | None,
                 seed_base: int = 0, stratum_seed: int = 0) -> dict[str, Any]:
    """One chain from ``init``: ``gibbs`` is the loop over ``state``'s arrays (compiled once, reused)."""
    state.assign(init)
    gibbs.stratum_seed = stratum_seed  # 2 workers: the order of the strata per epoch (DSGD-style)
    gibbs.epochs_run = 0
    if workers is not None:
        gibbs.run(workers=workers, epochs=0)  # build the schedule outside the timing
    out: dict[str, Any] = {"epoch": [0], "ll": [_ll(state)], "time_s": [0.0], "seed_base": seed_base,
                           "stratum_seed": stratum_seed}
    total = 0.0
    for e in tqdm(range(1, epochs + 1), desc=label, leave=False):
        seed = seed_base + 1000 * e  # a fresh, reproducible random stream per epoch (and per worker: + worker)
        t0 = time.perf_counter()
        if workers is None:
            gibbs.run_serial(seed=seed)
        else:
            gibbs.run(workers=workers, seed=seed)
        total += time.perf_counter() - t0
        out["epoch"].append(e)
        out["ll"].append(_ll(state))
        out["time_s"].append(total)
    out["scheme"] = str(gibbs.plan.scheme)
    return out


def _tomotopy_model(corpus: Corpus, topics: int, seed: int = 1) -> Any:
    import tomotopy as tp

    keys = corpus.tokens.keys
    model = tp.LDAModel(k=topics, alpha=corpus.alpha, eta=corpus.beta, seed=seed)
    starts = np.searchsorted(keys[:, 0], np.arange(corpus.doc_lengths.size + 1))  # tokens are in doc order
    for d in range(corpus.doc_lengths.size):
        model.add_doc([str(w) for w in keys[starts[d]:starts[d + 1], 1].tolist()])
    model.optim_interval = 0  # keep alpha fixed, as the other samplers do
    model.train(0, workers=1)  # initialise the assignments outside the timing
    return model


def _tomotopy_counts(model: Any, corpus: Corpus, topics: int) -> tuple[np.ndarray, np.ndarray]:
    to_ours = np.array([int(v) for v in model.vocabs], dtype=np.int64)
    ndk = np.zeros((corpus.doc_lengths.size, topics), np.int64)
    nwk = np.zeros((corpus.vocab_size, topics), np.int64)
    for d, doc in enumerate(model.docs):
        z = np.asarray(doc.topics, dtype=np.int64)
        w = to_ours[np.asarray(doc.words, dtype=np.int64)]
        np.add.at(ndk, (d, z), 1)
        np.add.at(nwk, (w, z), 1)
    return ndk, nwk


def _tomotopy_curve(corpus: Corpus, topics: int, epochs: int, seed: int = 1, label: str = "tomotopy"
                    ) -> dict[str, Any]:
    try:
        import tomotopy as tp
    except ImportError as e:
        print(f"tomotopy skipped: not installed ({e})")
        return {"skipped": str(e)}
    model = _tomotopy_model(corpus, topics, seed)
    ndk, nwk = _tomotopy_counts(model, corpus, topics)
    out: dict[str, Any] = {"epoch": [0], "ll": [log_likelihood_per_token(ndk, nwk, corpus.alpha, corpus.beta)],
                           "time_s": [0.0], "ll_per_word_tomotopy": [model.ll_per_word]}
    total = 0.0
    for e in tqdm(range(1, epochs + 1), desc=label, leave=False):
        t0 = time.perf_counter()
        model.train(1, workers=1, parallel=tp.ParallelScheme.NONE)
        total += time.perf_counter() - t0
        ndk, nwk = _tomotopy_counts(model, corpus, topics)
        out["epoch"].append(e)
        out["ll"].append(log_likelihood_per_token(ndk, nwk, corpus.alpha, corpus.beta))
        out["time_s"].append(total)
        out["ll_per_word_tomotopy"].append(model.ll_per_word)
    out["seed"] = seed
    return out


def _throughput(corpus: Corpus, topics: int, epochs: int, repeats: int) -> dict[str, Any]:
    """Tokens/s of ``epochs`` sweeps from a random start: orion_par with 1 and 2 workers and tomotopy
    single-threaded, ``repeats`` times interleaved (so all see the same load); medians and bests."""
    n = corpus.num_tokens * epochs
    res: dict[str, Any] = {"topics": topics, "repeats": repeats}
    start = LdaState.random(corpus, topics, seed=2)
    state = start.copy()
    gibbs = parallel_gibbs(corpus, state)
    for w in (1, 2):
        gibbs.run(workers=w, epochs=0)  # compile and build the schedules outside the timing
    try:
        import tomotopy as tp
    except ImportError as e:
        tp = None
        res["tomotopy_1t"] = {"skipped": str(e)}
    times: dict[str, list[float]] = {"orion_par_1w": [], "orion_par_2w": [], "tomotopy_1t": []}
    cpu2: list[float] = []
    load = [os.getloadavg()[0]]
    for r in tqdm(range(repeats), desc=f"throughput K={topics}", leave=False):
        for w in (1, 2):
            state.assign(start)  # every repeat samples from the same random start, as tomotopy's does
            st = gibbs.run(workers=w, epochs=epochs, seed=r)
            times[f"orion_par_{w}w"].append(st.elapsed_s)
            if w == 2:
                cpu2.append(max(st.cpu_s))
        if tp is not None:
            model = _tomotopy_model(corpus, topics)
            t0 = time.perf_counter()
            model.train(epochs, workers=1, parallel=tp.ParallelScheme.NONE)
            times["tomotopy_1t"].append(time.perf_counter() - t0)
        load.append(os.getloadavg()[0])
    res["loadavg_1min"] = load
    for name, t in times.items():
        if t:
            w = 2 if name.endswith("2w") else 1
            med = float(np.median(t))
            res[name] = {"tokens_per_s": n / med, "tokens_per_s_per_worker": n / med / w, "median_s": med,
                         "best_s": min(t), "tokens_per_s_best": n / min(t), "times_s": t}
    # Per-worker tokens per CPU second: what a worker does on a core of its own (other processes excluded).
    res["orion_par_2w_tokens_per_cpu_s_per_worker"] = n / float(np.median(cpu2)) / 2
    if times["tomotopy_1t"]:
        tomo = res["tomotopy_1t"]["tokens_per_s"]
        res["orion_1w_over_tomotopy"] = res["orion_par_1w"]["tokens_per_s"] / tomo
        res["orion_2w_per_worker_over_tomotopy"] = res["orion_par_2w"]["tokens_per_s_per_worker"] / tomo
        res["orion_2w_per_worker_cpu_over_tomotopy"] = res["orion_par_2w_tokens_per_cpu_s_per_worker"] / tomo
    return res


def _chains(corpus: Corpus, cfg: dict[str, Any]) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    """``cfg["chains"]`` chains per method (interleaved, so all methods see the same machine load)."""
    K, E = cfg["topics"], cfg["epochs"]
    state = LdaState.random(corpus, K, seed=1)
    gibbs = parallel_gibbs(corpus, state)
    for w in (1, 2):
        gibbs.run(workers=w, epochs=0)  # compile once, outside every timing
    gibbs.run_serial(order=np.zeros(0, np.int64))
    checks: dict[str, Any] = {}
    # One worker is the serial loop: same start and seeds give the same assignments (a short run).
    init = LdaState.random(corpus, K, seed=1)
    short = min(E, 3)
    _orion_curve(gibbs, state, init, "serial (equality check)", short, None)
    z_serial = np.array(state.Z)
    _orion_curve(gibbs, state, init, "orion_par 1w (equality check)", short, 1)
    checks[f"orion_par_1w_equals_serial_same_seeds[{short} sweeps]"] = bool(np.array_equal(z_serial, state.Z))
    curves: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
    for c in range(cfg["chains"]):
        init = LdaState.random(corpus, K, seed=1 + c)  # chain 0 is the single chain of earlier runs
        curves["serial"].append(_orion_curve(gibbs, state, init, f"serial chain {c}", E, None, 10_000 * c))
        curves["orion_par 2w"].append(_orion_curve(gibbs, state, init, f"orion_par 2w chain {c}", E, 2,
                                                   10_000 * c, stratum_seed=c))
        other = LdaState.random(corpus, K, seed=501 + c)  # independent of the serial chains
        curves["orion_par 1w"].append(_orion_curve(gibbs, state, other, f"orion_par 1w chain {c}", E, 1,
                                                   10_000 * c + 500_007))
        tomo = _tomotopy_curve(corpus, K, E, seed=1 + c, label=f"tomotopy chain {c}")
        if "ll" in tomo:
            curves["tomotopy"].append(tomo)
    return {m: v for m, v in curves.items() if v}, checks


def _summary(curves: dict[str, list[dict[str, Any]]], epochs: int) -> dict[str, Any]:
    """Per method: final log-likelihood per token over the chains, and the chain means at the last checkpoints."""
    last = sorted({max(epochs - d, 0) for d in (40, 20, 10, 5, 0)})
    out: dict[str, Any] = {"checkpoints": last}
    for m, chains in curves.items():
        final = np.array([c["ll"][-1] for c in chains])
        out[m] = {"final_ll": final.tolist(), "mean": float(final.mean()),
                  "std": float(final.std(ddof=1)) if final.size > 1 else 0.0,
                  "min": float(final.min()), "max": float(final.max()), "chains": int(final.size),
                  "mean_at_checkpoints": [float(np.mean([c["ll"][e] for c in chains])) for e in last],
                  "seconds_per_chain_mean": float(np.mean([c["time_s"][-1] for c in chains]))}
    return out


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    corpus = synthetic_corpus(cfg["docs"], cfg["doc_len"], cfg["vocab"], cfg["topics"], alpha=cfg["alpha"],
                              beta=cfg["beta"], seed=0)
    curves, checks = _chains(corpus, cfg)
    summary = _summary(curves, cfg["epochs"])
    ser = summary["serial"]
    ref = abs(ser["mean"])
    for m in curves:
        if m == "serial":
            continue
        s = summary[m]
        checks[f"final_ll_gap_of_means_vs_serial[{m}]"] = abs(s["mean"] - ser["mean"]) / ref
        # The noise in a gap of means: the standard error of the difference (Welch), relative to |serial mean|.
        checks[f"gap_of_means_standard_error[{m}]"] = float(
            np.sqrt(ser["std"] ** 2 / ser["chains"] + s["std"] ** 2 / s["chains"]) / ref)
    checks["serial_vs_serial_gap_of_means (serial vs orion_par 1w, other seeds)"] = checks.get(
        "final_ll_gap_of_means_vs_serial[orion_par 1w]", float("nan"))
    checks["serial_chain_spread (max - min) / abs(mean)"] = (ser["max"] - ser["min"]) / ref
    checks["final_ll_within_1pct"] = all(checks[f"final_ll_gap_of_means_vs_serial[{m}]"] <= 0.01
                                         for m in ("orion_par 1w", "orion_par 2w") if m in curves)
    # Chain 0 alone (serial and 2w share its start and seeds): the single-chain comparison of earlier runs.
    for m in ("orion_par 2w", "tomotopy"):
        if m in curves:
            checks[f"single_chain_final_ll_gap_vs_serial[chain 0, {m}]"] = (
                abs(curves[m][0]["ll"][-1] - curves["serial"][0]["ll"][-1]) / abs(curves["serial"][0]["ll"][-1]))
    thr = [_throughput(corpus, k, cfg["throughput_epochs"], cfg["repeats"]) for k in cfg["throughput_topics"]]
    checks.update(_throughput_checks(thr))
    plan = str(parallel_gibbs(corpus, LdaState.random(corpus, cfg["topics"], seed=1)).plan)
    return {"curves": curves, "summary": summary, "throughput": thr, "checks": checks, "plan": plan,
            "num_tokens": corpus.num_tokens, "true_model_ll": _true_ll(corpus, cfg)}


def _throughput_checks(thr: list[dict[str, Any]]) -> dict[str, Any]:
    checks: dict[str, Any] = {}
    for t in thr:
        if "orion_1w_over_tomotopy" in t:
            k = t["topics"]
            checks[f"orion_1w_over_tomotopy[K={k}]"] = t["orion_1w_over_tomotopy"]
            checks[f"orion_2w_per_worker_over_tomotopy[K={k}]"] = t["orion_2w_per_worker_over_tomotopy"]
            checks[f"estimate_from_cpu_time: orion_2w_per_worker_over_tomotopy[K={k}]"] = (
                t["orion_2w_per_worker_cpu_over_tomotopy"])
    ratios = [v for k, v in checks.items() if "over_tomotopy" in k and not k.startswith("estimate")]
    checks["within_2x_of_tomotopy"] = bool(ratios) and min(ratios) >= 0.5
    return checks


def run_throughput(cfg: dict[str, Any]) -> dict[str, Any]:
    corpus = synthetic_corpus(cfg["docs"], cfg["doc_len"], cfg["vocab"], cfg["topics"], alpha=cfg["alpha"],
                              beta=cfg["beta"], seed=0)
    thr = [_throughput(corpus, k, cfg["throughput_epochs"], cfg["repeats"]) for k in cfg["throughput_topics"]]
    return {"throughput": thr, "checks": _throughput_checks(thr), "num_tokens": corpus.num_tokens}


def _true_ll(corpus: Corpus, cfg: dict[str, Any]) -> float:
    """The likelihood of the assignment that generated... approximated by each token's most likely topic."""
    keys = corpus.tokens.keys
    z = np.argmax(corpus.theta[keys[:, 0]] * corpus.phi[:, keys[:, 1]].T, axis=1)
    ndk = np.zeros((corpus.doc_lengths.size, cfg["topics"]), np.int64)
    nwk = np.zeros((corpus.vocab_size, cfg["topics"]), np.int64)
    np.add.at(ndk, (keys[:, 0], z), 1)
    np.add.at(nwk, (keys[:, 1], z), 1)
    return log_likelihood_per_token(ndk, nwk, corpus.alpha, corpus.beta)


def _header(res: dict[str, Any], title: str) -> list[str]:
    c = res["config"]
    load = ", ".join(f"{x:.2f}" for x in res["machine"]["loadavg_start"])
    load_end = ", ".join(f"{x:.2f}" for x in res["machine"]["loadavg_end"])
    truth = (f" Log-likelihood of the generating model's most likely topics: {res['true_model_ll']:.4f} per token."
             if "true_model_ll" in res else "")
    return [f"# {title}\n\nCommand: `{res['command']}`  \nDate: {res['date']}  \n"
            f"Machine: {res['machine']['cpus']} CPUs, load average (1, 5, 15 min) at start ({load}), at end "
            f"({load_end}) (shared machine).  \n"
            f"Corpus: {res['num_tokens']} tokens, {c['docs']} documents x {c['doc_len']} tokens, vocabulary "
            f"{c['vocab']}, {c['topics']} topics, alpha {c['alpha']}, beta {c['beta']}.{truth}\n"]


def _checks_and_throughput(res: dict[str, Any]) -> list[str]:
    c = res["config"]
    lines = ["## Checks\n", "| check | value |", "| --- | --- |"]
    for k, v in res["checks"].items():
        lines.append(f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |")
    lines += [f"\n## Throughput (tokens/s over {c['throughput_epochs']} sweeps from a random start; medians of "
              f"{c['repeats']} interleaved repeats)\n",
              "| topics | method | tokens/s | per worker | best | load (1 min) during repeats |",
              "| --- | --- | --- | --- | --- | --- |"]
    for t in res["throughput"]:
        load = t["loadavg_1min"]
        for k, v in t.items():
            if isinstance(v, dict) and "tokens_per_s" in v:
                lines.append(f"| {t['topics']} | {k} | {v['tokens_per_s'] / 1e6:.2f}M | "
                             f"{v['tokens_per_s_per_worker'] / 1e6:.2f}M | {v['tokens_per_s_best'] / 1e6:.2f}M | "
                             f"{min(load):.2f}-{max(load):.2f} |")
    return lines


def _markdown(res: dict[str, Any]) -> str:
    c = res["config"]
    curves, summ = res["curves"], res["summary"]
    lines = _header(res, "lda_convergence")
    lines.append(f"{c['chains']} chains per method, {c['epochs']} sweeps each. `final_ll_within_1pct` is computed "
                 "from the **gap of means over the chains**: |mean final LL/token (method) - mean (serial)| / "
                 "|mean (serial)| <= 0.01, for orion_par 1w and 2w. orion_par 1w's chains use other starts and "
                 "seeds than the serial ones (one worker runs the serial loop itself: same start and seeds give "
                 "the same assignments, checked on a short run), so its gap of means is the serial-vs-serial "
                 "yardstick. `gap_of_means_standard_error` is the standard error of the difference of the means "
                 "(Welch), the noise level of a gap of means with this many chains.\n")
    ch = res["checks"]
    ok = ch["final_ll_within_1pct"]
    lines.append(f"Issue criterion, final log-likelihood per token within 1% of the serial loop: **{'met' if ok else 'not met'}** "
                 f"(gap of means over {c['chains']} chains: orion_par 2w "
                 f"{ch['final_ll_gap_of_means_vs_serial[orion_par 2w]']:.2%}, standard error "
                 f"{ch['gap_of_means_standard_error[orion_par 2w]']:.2%}; serial vs serial (orion_par 1w, other seeds) "
                 f"{ch['final_ll_gap_of_means_vs_serial[orion_par 1w]']:.2%}; one chain against one, chain 0: "
                 f"{ch['single_chain_final_ll_gap_vs_serial[chain 0, orion_par 2w]']:.2%}).\n")
    lines += _checks_and_throughput(res)
    lines += ["\n## Final log-likelihood per token over the chains\n",
              "| method | chains | mean | std | min | max | gap of means vs serial | mean s per chain |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for m in curves:
        s = summ[m]
        gap = abs(s["mean"] - summ["serial"]["mean"]) / abs(summ["serial"]["mean"])
        lines.append(f"| {m} | {s['chains']} | {s['mean']:.4f} | {s['std']:.4f} | {s['min']:.4f} | {s['max']:.4f} | "
                     f"{gap:.4f} | {s['seconds_per_chain_mean']:.1f} |")
    cps = summ["checkpoints"]
    lines += ["\n## Have the chains plateaued? Mean log-likelihood per token over the chains at the last "
              "checkpoints\n", "| method | " + " | ".join(f"sweep {e}" for e in cps) + " |",
              "| --- |" + " --- |" * len(cps)]
    for m in curves:
        lines.append(f"| {m} | " + " | ".join(f"{v:.4f}" for v in summ[m]["mean_at_checkpoints"]) + " |")
    lines += ["\n## Final log-likelihood per token, each chain\n",
              "| chain | " + " | ".join(curves) + " |", "| --- |" + " --- |" * len(curves)]
    for i in range(max(len(v) for v in curves.values())):
        lines.append(f"| {i} | " + " | ".join(f"{v[i]['ll'][-1]:.4f}" if i < len(v) else "" for v in curves.values())
                     + " |")
    lines += ["\n## Mean log-likelihood per token over the chains (mean cumulative seconds in brackets)\n",
              "| epoch | " + " | ".join(curves) + " |", "| --- |" + " --- |" * len(curves)]
    last = curves["serial"][0]["epoch"][-1]
    for e in curves["serial"][0]["epoch"]:
        if e > 10 and e % 10 and e != last:
            continue  # every epoch of every chain is in the json; the table keeps the first ten and every tenth
        cells = [f"{np.mean([ch['ll'][e] for ch in v]):.4f} ({np.mean([ch['time_s'][e] for ch in v]):.2f}s)"
                 for v in curves.values()]
        lines.append(f"| {e} | " + " | ".join(cells) + " |")
    lines.append("\n## Plan\n\n```\n" + res["plan"] + "\n```\n")
    return "\n".join(lines)


def _markdown_throughput(res: dict[str, Any]) -> str:
    return "\n".join(_header(res, "lda_throughput") + _checks_and_throughput(res)) + "\n"


def _plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (name, chains) in enumerate(res["curves"].items()):
        for j, c in enumerate(chains):
            label = f"{name} ({len(chains)} chains)" if j == 0 else None
            ax1.plot(np.maximum(c["time_s"], 1e-3), c["ll"], color=f"C{i}", lw=0.8, label=label)
            ax2.plot(c["epoch"], c["ll"], color=f"C{i}", lw=0.8, label=label)
    ax1.set(xlabel="seconds", ylabel="log-likelihood per token", title="LDA: log-likelihood vs time", xscale="log")
    ax2.set(xlabel="epoch", ylabel="log-likelihood per token", title="vs epoch (late sweeps)")
    finals = [c["ll"][-1] for chains in res["curves"].values() for c in chains]
    ax2.set_ylim(min(finals) - 0.1, max(finals) + 0.05)
    ax1.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.lda_convergence", description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a seconds-long smoke run (written to a temp dir)")
    ap.add_argument("--throughput-only", action="store_true",
                    help="only the throughput phase, written to lda_throughput.json/.md")
    ap.add_argument("--repeats", type=int, default=None, help="throughput repeats (default: 7; --tiny: 1)")
    ap.add_argument("--chains", type=int, default=None, help="chains per method (default: 6; --tiny: 2)")
    ap.add_argument("--epochs", type=int, default=None, help="sweeps per chain (default: 150; --tiny: 3)")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default experiments/results)")
    args = ap.parse_args(argv)
    cfg = dict(TINY if args.tiny else FULL)
    for name in ("repeats", "chains", "epochs"):
        if getattr(args, name):
            cfg[name] = getattr(args, name)
    out = args.out or (Path(tempfile.mkdtemp(prefix="lda_convergence_")) if args.tiny else
                       Path(__file__).resolve().parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    machine: dict[str, Any] = {"cpus": os.cpu_count(), "platform": platform.platform(),
                               "loadavg_start": os.getloadavg()}
    res = run_throughput(cfg) if args.throughput_only else run(cfg)
    machine["loadavg_end"] = os.getloadavg()
    res.update(command="python -m experiments.lda_convergence " + " ".join(sys.argv[1:] if argv is None else argv),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               versions=versions(("numpy", "numba", "tomotopy")), machine=machine, config=cfg)
    name = "lda_throughput" if args.throughput_only else "lda_convergence"
    text = _markdown_throughput(res) if args.throughput_only else _markdown(res)
    (out / f"{name}.json").write_text(json.dumps(res, indent=1, default=float))
    (out / f"{name}.md").write_text(text)
    if not args.throughput_only:
        _plot(res, out / "lda_convergence.png")
    print(text.split("## Final log-likelihood")[0])
    print(f"wrote {out / name}.json and .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
