"""LDA convergence: log-likelihood per token vs time for serial Gibbs, orion_par and tomotopy.

All samplers fit the same synthetic corpus (drawn from a known LDA model) with the same priors:

* ``serial``: the collapsed-Gibbs loop body compiled, run serially in data order (``run_serial``);
* ``orion_par 1w`` / ``orion_par 2w``: the same body under ``@parallel_for`` (2D plan: documents in
  space, words in time, topic totals through a Buffer), local threads;
* ``tomotopy``: tomotopy's LDAModel trained single-threaded (the reference implementation).

The log-likelihood is the joint ``log p(w, z) / N`` computed from each sampler's counts with one
function (``models.lda.log_likelihood_per_token``), so all curves are comparable; tomotopy's own
``ll_per_word`` is recorded as well.  A throughput phase compares tokens/s per worker with tomotopy at
two topic counts (medians of interleaved repeats, with the load average).  Checks: tokens/s per worker
within 2x of tomotopy single-threaded, and final log-likelihood per token within 1% of the serial loop.

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

from models.lda import Corpus, LdaState, log_likelihood_per_token, parallel_gibbs, synthetic_corpus

FULL = dict(docs=10000, doc_len=100, vocab=10000, topics=20, alpha=0.1, beta=0.01, epochs=100,
            throughput_topics=[20, 50], throughput_epochs=3, repeats=7)
TINY = dict(docs=200, doc_len=50, vocab=500, topics=10, alpha=0.1, beta=0.01, epochs=3,
            throughput_topics=[10], throughput_epochs=1, repeats=1)


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("numpy", "numba", "tomotopy"):
        try:
            out[name] = getattr(__import__(name), "__version__", "present")
        except ImportError as e:
            out[name] = f"not installed ({e})"
    return out


def _ll(state: LdaState) -> float:
    return log_likelihood_per_token(state.ndk, state.nwk, state.alpha, state.beta)


def _orion_curve(corpus: Corpus, init: LdaState, label: str, epochs: int, workers: int | None,
                 seed_base: int = 0) -> dict[str, Any]:
    state = init.copy()
    gibbs = parallel_gibbs(corpus, state)
    gibbs.run(workers=workers or 1, epochs=0)  # compile and build the schedule outside the timing
    gibbs.run_serial(order=np.zeros(0, np.int64))
    out: dict[str, Any] = {"epoch": [0], "ll": [_ll(state)], "time_s": [0.0]}
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


def _tomotopy_model(corpus: Corpus, topics: int) -> Any:
    import tomotopy as tp

    keys = corpus.tokens.keys
    model = tp.LDAModel(k=topics, alpha=corpus.alpha, eta=corpus.beta, seed=1)
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


def _tomotopy_curve(corpus: Corpus, topics: int, epochs: int) -> dict[str, Any]:
    try:
        import tomotopy as tp
    except ImportError as e:
        print(f"tomotopy skipped: not installed ({e})")
        return {"skipped": str(e)}
    model = _tomotopy_model(corpus, topics)
    ndk, nwk = _tomotopy_counts(model, corpus, topics)
    out: dict[str, Any] = {"epoch": [0], "ll": [log_likelihood_per_token(ndk, nwk, corpus.alpha, corpus.beta)],
                           "time_s": [0.0], "ll_per_word_tomotopy": [model.ll_per_word]}
    total = 0.0
    for e in tqdm(range(1, epochs + 1), desc="tomotopy", leave=False):
        t0 = time.perf_counter()
        model.train(1, workers=1, parallel=tp.ParallelScheme.NONE)
        total += time.perf_counter() - t0
        ndk, nwk = _tomotopy_counts(model, corpus, topics)
        out["epoch"].append(e)
        out["ll"].append(log_likelihood_per_token(ndk, nwk, corpus.alpha, corpus.beta))
        out["time_s"].append(total)
        out["ll_per_word_tomotopy"].append(model.ll_per_word)
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


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    corpus = synthetic_corpus(cfg["docs"], cfg["doc_len"], cfg["vocab"], cfg["topics"], alpha=cfg["alpha"],
                              beta=cfg["beta"], seed=0)
    init = LdaState.random(corpus, cfg["topics"], seed=1)
    curves: dict[str, Any] = {"serial": _orion_curve(corpus, init, "serial", cfg["epochs"], None)}
    # The yardstick: the same serial sampler with other random numbers; chains differ by this much anyway.
    curves["serial (other seed)"] = _orion_curve(corpus, init, "serial (other seed)", cfg["epochs"], None, 7)
    for w in (1, 2):
        curves[f"orion_par {w}w"] = _orion_curve(corpus, init, f"orion_par {w}w", cfg["epochs"], w)
    curves["tomotopy"] = _tomotopy_curve(corpus, cfg["topics"], cfg["epochs"])
    thr = [_throughput(corpus, k, cfg["throughput_epochs"], cfg["repeats"]) for k in cfg["throughput_topics"]]
    serial_ll = curves["serial"]["ll"][-1]
    checks: dict[str, Any] = {}
    for name in ("serial (other seed)", "orion_par 1w", "orion_par 2w", "tomotopy"):
        if "ll" in curves[name]:
            checks[f"final_ll_gap_vs_serial[{name}]"] = abs(curves[name]["ll"][-1] - serial_ll) / abs(serial_ll)
    checks["final_ll_within_1pct"] = all(v <= 0.01 for k, v in checks.items() if "orion_par" in k)
    checks.update(_throughput_checks(thr))
    plan = str(parallel_gibbs(corpus, init.copy()).plan)
    return {"curves": curves, "throughput": thr, "checks": checks, "plan": plan, "num_tokens": corpus.num_tokens,
            "true_model_ll": _true_ll(corpus, cfg)}


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
    curves = {k: v for k, v in res["curves"].items() if "ll" in v}
    lines = _header(res, "lda_convergence") + _checks_and_throughput(res)
    lines += ["\n## Log-likelihood per token (cumulative seconds in brackets)\n",
              "| epoch | " + " | ".join(curves) + " |", "| --- |" + " --- |" * len(curves)]
    for e in curves["serial"]["epoch"]:
        if e > 10 and e % 10 and e != curves["serial"]["epoch"][-1]:
            continue  # every epoch is in the json; the table keeps the first ten and every tenth
        cells = [f"{cv['ll'][e]:.4f} ({cv['time_s'][e]:.2f}s)" if e < len(cv["ll"]) else "" for cv in curves.values()]
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
    for name, c in res["curves"].items():
        if "ll" in c:
            ax1.plot(np.maximum(c["time_s"], 1e-3), c["ll"], marker="o", ms=2, label=name)
            ax2.plot(c["epoch"], c["ll"], marker="o", ms=2, label=name)
    ax1.set(xlabel="seconds", ylabel="log-likelihood per token", title="LDA: log-likelihood vs time", xscale="log")
    ax2.set(xlabel="epoch", ylabel="log-likelihood per token", title="vs epoch")
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
    ap.add_argument("--out", type=Path, default=None, help="output directory (default experiments/results)")
    args = ap.parse_args(argv)
    cfg = dict(TINY if args.tiny else FULL)
    if args.repeats:
        cfg["repeats"] = args.repeats
    out = args.out or (Path(tempfile.mkdtemp(prefix="lda_convergence_")) if args.tiny else
                       Path(__file__).resolve().parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    machine: dict[str, Any] = {"cpus": os.cpu_count(), "platform": platform.platform(),
                               "loadavg_start": os.getloadavg()}
    res = run_throughput(cfg) if args.throughput_only else run(cfg)
    machine["loadavg_end"] = os.getloadavg()
    res.update(command="python -m experiments.lda_convergence " + " ".join(sys.argv[1:] if argv is None else argv),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               versions=_versions(), machine=machine, config=cfg)
    name = "lda_throughput" if args.throughput_only else "lda_convergence"
    text = _markdown_throughput(res) if args.throughput_only else _markdown(res)
    (out / f"{name}.json").write_text(json.dumps(res, indent=1, default=float))
    (out / f"{name}.md").write_text(text)
    if not args.throughput_only:
        _plot(res, out / "lda_convergence.png")
    print(text.split("## Log-likelihood")[0])
    print(f"wrote {out / name}.json and .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
