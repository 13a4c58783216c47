"""Markdown and the figure for experiments.mf_convergence: curves, checks, throughput and the shuffle study."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def _header(res: dict[str, Any], title: str) -> list[str]:
    c = res["config"]
    return [f"# {title}\n\nCommand: `{res['command']}`  \nDate: {res['date']}  \n"
            f"Machine: {res['machine']['cpus']} CPUs, load average (1, 5, 15 min) at start "
            f"{format_load(res['machine']['loadavg_start'])}, at end {format_load(res['machine']['loadavg_end'])} (the machine is "
            f"shared).  \nData: {res['num_ratings']} ratings, {c['users']} users x {c['items']} items, rank "
            f"{c['rank']}, noise 0.1; SGD lr {c['lr']}, reg {c['reg']}.\n"]


def format_load(avg: Any) -> str:
    return "(" + ", ".join(f"{x:.2f}" for x in avg) + ")"


def _checks_and_throughput(res: dict[str, Any]) -> list[str]:
    thr = res["throughput"]
    lines = ["## Checks\n", "| check | value |", "| --- | --- |"]
    for k, v in res["checks"].items():
        lines.append(f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |")
    load = thr["loadavg_1min"]
    gate = ""
    idle = [x for x in thr.get("idle_share_before_repeat", []) if x is not None]
    if thr.get("quiet_gate_s") and idle:
        gate = (f" Before each repeat the run waited up to {thr['quiet_gate_s']:g} s for the CPUs to be 90% idle over "
                f"0.5 s: {sum(x >= 0.9 for x in idle)} of {len(idle)} repeats started that quiet (idle share seen "
                f"{min(idle):.2f} to {max(idle):.2f}); all repeats are kept.")
    if thr.get("warm"):
        gate += (" Each timed epoch directly follows an untimed epoch of the same method (`--warm`: both cores "
                 "awake and at speed, as in training).")
    lines += [f"\n## Throughput (one epoch; {thr['repeats']} repeats, interleaved)\n",
              f"1-minute load average during the repeats: {min(load):.2f} to {max(load):.2f}.{gate}\n",
              "| method | ratings/s (median) | per worker (median) | ratings/s (best) | median s | best s |",
              "| --- | --- | --- | --- | --- | --- |"]
    for k, v in thr.items():
        if isinstance(v, dict) and "ratings_per_s" in v:
            lines.append(f"| {k} | {v['ratings_per_s'] / 1e6:.2f}M | {v['ratings_per_s_per_worker'] / 1e6:.2f}M | "
                         f"{v['ratings_per_s_best'] / 1e6:.2f}M | {v['median_s']:.4f} | {v['best_s']:.4f} |")
    lines += ["", f"2 workers / 1 worker: {thr['speedup_2w_over_1w_median']:.3f}x from the medians, "
              f"{thr['speedup_2w_over_1w_paired_median']:.3f}x median of each repeat's ratio, "
              f"{thr['speedup_2w_over_1w_best']:.3f}x from the bests; 2 workers / the hand-compiled serial loop: "
              f"{thr['speedup_2w_over_serial_median']:.3f}x from the medians"
              + (f", {thr['speedup_2w_over_serial_paired_median']:.3f}x paired; 1 worker / the serial loop (speed): "
                 f"{thr['speedup_1w_over_serial_paired_median']:.3f}x paired" if "speedup_1w_over_serial_paired_median" in thr
                 else "") + ". The compute-only control (same numba kernel on 1 and 2 "
              f"threads) gave {thr['machine_2thread_speedup_median']:.3f}x: the parallelism the machine's cores offered"
              + (f"; the hand-compiled serial loop on two independent halves of the ratings (own W and H each, nothing "
                 f"shared), two threads against one: {thr['halves_2thread_speedup_median']:.3f}x from the medians, "
                 f"{thr['halves_2thread_speedup_paired_median']:.3f}x paired: what two threads of this memory-bound "
                 "kernel got from the machine" if "halves_2thread_speedup_median" in thr else "") + "."]
    if "cold" in thr:
        c = thr["cold"]
        lines += ["", "The untimed first epochs (each method's first epoch after the others ran, so the second core "
                  f"had been idle): medians serial {c['median_s']['serial']:.4f} s, 1w {c['median_s']['orion_par_1w']:.4f} s, "
                  f"2w {c['median_s']['orion_par_2w']:.4f} s; 2w / 1w {c['speedup_2w_over_1w_median']:.3f}x from the "
                  f"medians, {c['speedup_2w_over_1w_paired_median']:.3f}x paired; 1w / serial "
                  f"{c['speedup_1w_over_serial_paired_median']:.3f}x, 2w / serial {c['speedup_2w_over_serial_paired_median']:.3f}x "
                  "paired."]
    return lines


def _shuffle_markdown(studies: list[dict[str, Any]]) -> list[str]:
    """The shuffle study's section: how it compares, then per learning rate the per-epoch table."""
    lines = ["\n## Shuffle study: serial vs orion_par 2 workers from the same random orders\n\nFor each of "
                 "several random orders of the ratings, the serial loop visits them in that order and orion_par "
                 "keeps it inside each chunk of its schedule, with a stratum seed of its own per order (both from "
                 "the same initial factors). `rmse_within_1pct[lr]` is the "
                 "issue's criterion on the *mean* curves over the orders: at every epoch, |mean RMSE (2w) - mean "
                 "RMSE (serial)| / mean RMSE (serial) <= 0.01. The yardstick for a gap of means is the same gap "
                 "between the serial loop's mean curve over these orders and over as many other orders (set B); "
                 "`paired SE` is the standard error of the per-order difference 2w - serial (same order, same "
                 "start). `lag` is how many epochs later the 2w mean curve reaches the serial mean's RMSE of that "
                 "epoch. On the first two orders the serial loop was also run in orion_par 2w's own visit order "
                 "(each stratum's blocks one after another, DSGD's order): equal bitwise to 2w means the "
                 "difference from the serial loop comes from the visit order, not from running in parallel.\n"]
    for o in studies:
        met = "met" if o["max_gap_of_means"] <= 0.01 else "NOT met"
        lines += [f"\n### lr {o['lr']}, init {o['init']}, {o['shuffles']} orders: 1% criterion {met}\n\n"
                  f"Max gap of the means {o['max_gap_of_means']:.4f} at epoch {o['epoch_of_max_gap_of_means']}, "
                  f"{o['final_epoch_gap_of_means']:.4f} at the last epoch; serial vs serial on other orders (gap of "
                  f"means): max {o['max_gap_of_means_serial_vs_serial_other_orders']:.4f}. Per order (paired) max "
                  f"gap, median over orders {o['max_gap_paired_median']:.4f}; the serial loop against itself on "
                  f"another order (one curve against one) {o['max_gap_serial_vs_serial_other_order_median']:.4f}. "
                  f"Serial loop in 2w's visit order equals 2w bitwise: "
                  f"{o.get('orion_par_2w_equals_serial_loop_in_its_visit_order', 'not run')}.\n",
                  "| epoch | serial (mean) | orion_par 2w (mean) | serial, other orders (mean) | gap of means 2w vs "
                  "serial | paired SE | gap of means serial vs serial | its SE | serial spread (sd/mean) | "
                  "2w lag (epochs) |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        sd = o["serial_sd_over_mean_per_epoch"] or [0.0] * len(o["mean_rmse_serial"])
        for e, (a, b) in enumerate(zip(o["mean_rmse_serial"], o["mean_rmse_orion_par_2w"], strict=True)):
            if "mean_rmse_serial_other_orders" not in o:  # results written before set B existed
                gap = o["gap_of_means_per_epoch"][e - 1] if e else 0.0
                lines.append(f"| {e} | {a:.4f} | {b:.4f} | | {gap:.4f} | | | | {sd[e]:.4f} | |")
                continue
            ob = o["mean_rmse_serial_other_orders"][e]
            cells = [o[k][e - 1] if e else 0.0 for k in ("gap_of_means_per_epoch", "paired_diff_standard_error_per_epoch",
                                                         "gap_of_means_serial_vs_serial_other_orders_per_epoch",
                                                         "serial_vs_serial_gap_of_means_standard_error_per_epoch")]
            lag = o["lag_epochs_2w_behind_serial_mean"][e]
            lines.append(f"| {e} | {a:.4f} | {b:.4f} | {ob:.4f} | " + " | ".join(f"{x:.4f}" for x in cells)
                         + f" | {sd[e]:.4f} | {lag:.2f} |")
    return lines


def markdown(res: dict[str, Any]) -> str:
    curves = {k: v for k, v in res["curves"].items() if "rmse" in v}
    lines = _header(res, "mf_convergence")
    verdict = []
    for o in res["shuffle_study"]:
        ok = o["max_gap_of_means"] <= 0.01
        verdict.append(f"lr {o['lr']}: **{'met' if ok else 'not met'}** (max gap of the mean curves over "
                       f"{o['shuffles']} orders {o['max_gap_of_means']:.2%} at epoch {o.get('epoch_of_max_gap_of_means', '?')})")
    lines.append("Issue criterion, RMSE per epoch of 2 workers within 1% of the serial loop (mean curves over random "
                 "orders, every epoch): " + "; ".join(verdict) + ". One worker equals the serial loop bitwise.\n")
    lines += _checks_and_throughput(res)
    lines += ["\n## Training RMSE per epoch, one data order (cumulative seconds in brackets)\n",
              "| epoch | " + " | ".join(curves) + " |", "| --- |" + " --- |" * len(curves)]
    epochs = sorted({e for c in curves.values() for e in c["epoch"]})
    for e in epochs:
        cells = []
        for c in curves.values():
            cells.append(f"{c['rmse'][c['epoch'].index(e)]:.4f} ({c['time_s'][c['epoch'].index(e)]:.2f}s)"
                         if e in c["epoch"] else "")
        lines.append(f"| {e} | " + " | ".join(cells) + " |")
    lines.append("\nsurprise SVD has no per-epoch hook: each of its rows is a separate fit with that many epochs.  ")
    lines.append("The Ray curve's first epoch includes starting the actors.\n")
    lines += _shuffle_markdown(res["shuffle_study"])
    lines.append("\n## Plan\n\n```\n" + res["plan"] + "\n```\n")
    return "\n".join(lines)


def markdown_throughput(res: dict[str, Any]) -> str:
    return "\n".join(_header(res, "mf_throughput") + _checks_and_throughput(res)) + "\n"


def markdown_study(res: dict[str, Any]) -> str:
    lines = _header(res, f"mf_shuffle_study (lr {res['config']['lr']}, {res['config']['shuffles']} orders)")
    lines += ["## Checks\n", "| check | value |", "| --- | --- |"]
    for k, v in res["checks"].items():
        lines.append(f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |")
    return "\n".join(lines + _shuffle_markdown(res["shuffle_study"])) + "\n"


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    studies = res.get("shuffle_study", [])
    rows = 1 + (len(studies) + 1) // 2
    fig, grid = plt.subplots(rows, 2, figsize=(11, 4 * rows), squeeze=False)
    axes = grid.ravel()
    ax1, ax2 = axes[0], axes[1]
    for name, c in res["curves"].items():
        if "rmse" not in c:
            continue
        ax1.plot(c["epoch"], c["rmse"], marker="o", ms=3, label=name)
        ax2.plot(np.maximum(c["time_s"], 1e-3), c["rmse"], marker="o", ms=3, label=name)
    ax1.set(xlabel="epoch", ylabel="training RMSE", title="RMSE vs epoch (one data order)")
    ax2.set(xlabel="seconds", ylabel="training RMSE", title="RMSE vs time", xscale="log")
    ax1.legend()
    for ax, o in zip(axes[2:2 + len(studies)], studies, strict=True):
        # Every order's curve (thin) and the mean over the orders (thick), per method.
        for i, (key, name) in enumerate((("rmse_serial", "serial"), ("rmse_orion_par_2w", "orion_par 2w"),
                                         ("rmse_serial_other_orders", "serial, other orders"))):
            if key not in o:
                continue
            runs = np.array(o[key])
            for r in runs:
                ax.plot(r, color=f"C{i}", lw=0.4, alpha=0.4)
            ax.plot(runs.mean(axis=0), color=f"C{i}", lw=2, label=f"{name} (mean of {len(runs)})")
        ax.set(xlabel="epoch", ylabel="training RMSE", yscale="log",
               title=f"shuffle study, lr {o['lr']}: max gap of means {o['max_gap_of_means']:.1%}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
