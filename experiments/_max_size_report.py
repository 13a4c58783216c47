"""Markdown for the largest-model tables (experiments.max_size and the three tables that run it)."""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


from experiments._common import NAMED_GPU
from tfmem.units import format_bytes


def _fmt(value: Any, kind: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if kind == "bytes":
        return format_bytes(int(value))
    if kind == "s":
        return f"{value * 1e3:.0f} ms" if value < 1 else f"{value:.2f} s"
    return f"{value:,.1f}" if isinstance(value, float) else f"{value:,}" if isinstance(value, int) else str(value)


def _gpu(est: dict[str, Any] | None) -> str:
    if not est:
        return "-"
    low, high = f"{est['low_s'] * 1e3:.3g}", f"{est['high_s'] * 1e3:.3g}"
    return f"{low} ms" if low == high else f"{low}-{high} ms"


def markdown(result: dict[str, Any]) -> str:
    label, s = result["label_name"], result["summary"]
    v, t = s["vanilla"], s["tfmem"]
    ratio = f"{s['ratio']:.2f}x" if s["ratio"] else "-"
    slowdown = f"{s['slowdown']:.2f}x" if s["slowdown"] else "-"
    lines = [
        f"# Largest {result['family']} ({result['size_name']}) under a {result['testbed_budget']} testbed budget",
        "",
        f"Command: `{result['command']}` ({result['date']}). Builder: `{result['builder']}` with "
        f"`{result['builder_kwargs']}`. tfmem plans for {format_bytes(result['plan_budget_bytes'])} with passes "
        f"`{result['passes']}`. Peaks: testbed (measured); throughput: samples/s over {result['steps']} timed "
        "step(s) on the testbed (CPU)."
        + (f" Run time {result['run_s'] / 60:.1f} min; 1-minute load average {result['load_average']['start'][0]:.1f} "
           f"at the start, {result['load_average']['end'][0]:.1f} at the end (2 cores)." if "run_s" in result else ""),
        "",
        f"| | largest {label} | params | device peak | step time | samples/s | step on {NAMED_GPU} "
        "(cost model) | first failure |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for mode, row in (("vanilla", v), ("tfmem", t)):
        fail = f"{row['first_failing_size']} ({row['failing_status']})" if row["first_failing_size"] else \
            "none: the search stopped at its maximum" if row.get("capped") else "-"
        largest = ("≥ " if row.get("capped") else "") + _fmt(row[f"largest_{label}"])
        lines.append(f"| {mode} | {largest} | {_fmt(row['params'])} | "
                     f"{_fmt(row['device_peak_bytes'], 'bytes')} | {_fmt(row['step_time_s'], 's')} | "
                     f"{_fmt(row['samples_per_s'])} | {_gpu(row.get('gpu_estimate'))} | {fail} |")
    gpu = s.get("gpu_slowdown_range")
    gpu_text = f"; on {NAMED_GPU} (cost model) {gpu[0]:.2f}x-{gpu[1]:.2f}x" if gpu else ""
    work = (f"; per unit of work (cost-model FLOPs per step, vanilla {v['step_flops'] / 1e9:,.2f} G, tfmem "
            f"{t['step_flops'] / 1e9:,.2f} G) {s['work_slowdown']:.2f}x" if s.get("work_slowdown") else "")
    lines += ["", f"Ratio tfmem/vanilla: **{ratio}**; throughput slowdown at each side's largest: {slowdown} on the "
              f"testbed{work}{gpu_text}; "
              f"same loss at vanilla's largest: {_fmt(s['same_loss_at_vanilla_largest'])}; "
              f"tfmem refusals: {s['tfmem_refusals']}; errors: {s['errors']}.", "",
              "## Probes", "",
              f"| mode | size | {label} | status | device peak | sim peak | step time | samples/s | optimize |",
              "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in result["probes"]:
        lines.append(f"| {r['mode']} | {r['size']} | {r[label]} | {r['status']} | "
                     f"{_fmt(r.get('device_peak_bytes'), 'bytes')} | {_fmt(r.get('simulated_peak_bytes'), 'bytes')} | "
                     f"{_fmt(r.get('step_time_s'), 's')} | {_fmt(r.get('samples_per_s'))} | "
                     f"{_fmt(r.get('optimize_s'), 's')} |")
    errors = [r for r in result["probes"] if r.get("error")]
    if errors:
        lines += ["", "Why probes failed (first line):", ""]
        lines += [f"- {r['mode']} {label}={r[label]}: {r['status']}: {r['error']}" for r in errors]
    return "\n".join(lines) + "\n"
