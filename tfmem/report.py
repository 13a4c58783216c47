"""The optimisation report: before/after peaks, what each pass did, and which instrument each figure is from.

Three outputs: ``to_markdown()`` (a table people read), ``plot(path)`` (device memory over the step, before vs
after, PNG) and ``chrome_trace(path)`` (the simulated schedule with memory counter tracks, for Perfetto or
chrome://tracing).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from tfmem.pipeline import PassReport
from tfmem.sim.profile import MemoryProfile
from tfmem.units import format_bytes

if TYPE_CHECKING:
    from tfmem.search import SearchLog

SIMULATOR = "simulator"
GRAPPLER = "Grappler estimate"
TESTBED = "testbed"


@dataclass(frozen=True)
class Figure:
    """One number in the report, with the instrument that produced it."""

    label: str
    before: float | None
    after: float | None
    instrument: str
    unit: str = "bytes"

    def cells(self) -> tuple[str, str]:
        return _fmt(self.before, self.unit), _fmt(self.after, self.unit)


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "—"
    if unit == "bytes":
        return format_bytes(value)
    if unit == "s":
        return f"{value * 1e3:.2f} ms"
    return f"{value:g}"


@dataclass
class Report:
    """What ``tfmem.optimize`` did to a graph (returned as ``Optimized.report``)."""

    budget_bytes: int | None
    before: MemoryProfile
    after: MemoryProfile
    passes: list[PassReport]
    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    search: SearchLog | None = None   # every plan the budget search tried (tfmem.search)
    devices: dict[str, Report] = field(default_factory=dict)   # each device's, when several were planned
    caveat: str | None = None   # which outputs may differ in their last bits, and why (also in notes)

    def add(self, label: str, before: float | None, after: float | None, instrument: str,
            unit: str = "bytes") -> None:
        """Add a figure (e.g. a testbed measurement) to the report's table."""
        self.figures.append(Figure(label, before, after, instrument, unit))

    def all_figures(self) -> list[Figure]:
        core = [
            Figure("device peak", self.before.peak_bytes, self.after.peak_bytes, SIMULATOR),
            Figure("  of which persistent", self.before.persistent_bytes, self.after.persistent_bytes, SIMULATOR),
            Figure("host peak", self.before.host_peak_bytes, self.after.host_peak_bytes, SIMULATOR),
            Figure("estimated step time (testbed cost model)", self.before.estimated_step_s,
                   self.after.estimated_step_s, SIMULATOR, "s"),
        ]
        return core + self.figures

    def to_markdown(self) -> str:
        """A markdown summary: a figures table, one line per pass, the budget search's attempts and the notes."""
        budget = format_bytes(self.budget_bytes) if self.budget_bytes is not None else "none"
        lines = [f"### tfmem report (device budget: {budget})", "", "| figure | before | after | instrument |",
                 "|---|---:|---:|---|"]
        for fig in self.all_figures():
            b, a = fig.cells()
            lines.append(f"| {fig.label} | {b} | {a} | {fig.instrument} |")
        if self.devices:
            lines += ["", "**Per device** (simulator)", "", "| device | peak before | peak after | its host's peak after |",
                      "|---|---:|---:|---:|"]
            for device, r in self.devices.items():
                lines.append(f"| {device} | {format_bytes(r.before.peak_bytes)} | {format_bytes(r.after.peak_bytes)} "
                             f"| {format_bytes(r.after.host_peak_bytes)} |")
        lines += ["", "**Passes**", ""]
        if not self.passes:
            lines.append("- none ran")
        for p in self.passes:
            what = "changed the graph" if p.changed else "no change"
            counts = f"+{p.nodes_added} ops, +{p.control_edges_added} control edges"
            if p.bytes_moved:
                counts += f", {format_bytes(p.bytes_moved)} moved per step"
            lines.append(f"- `{p.name}`: {what} ({counts})" + "".join(f"; {n}" for n in p.notes))
        for p in self.passes:
            decisions = cast("list[dict[str, Any]] | None", p.details.get("decisions") if p.changed else None)
            if decisions:
                lines += ["", f"**Planner decisions** ({len(decisions)}, largest first)", ""]
                for d in sorted(decisions, key=lambda d: -d["bytes"])[:10]:
                    lines.append(f"- {d['kind']} `{d['tensor']}` {format_bytes(d['bytes'])}, "
                                 f"est. {d['cost_s'] * 1e3:.2f} ms")
        if self.search is not None and self.search.attempts:
            lines += ["", f"**Budget search** ({self.search.summary().removeprefix('search: ')})", ""]
            lines += [f"{i}. {a.line()}" for i, a in enumerate(self.search.attempts, 1)]
        top = self.after.live_at_peak[:5]
        if top:
            lines += ["", f"**Largest tensors live at the device peak after** (at `{self.after.peak_unit}`)", ""]
            lines += [f"- `{t.tensor}` {format_bytes(t.nbytes)} ({t.kind}, from {t.producer})" for t in top]
        if self.notes or self.after.notes:
            lines += ["", "**Notes**", ""] + [f"- {n}" for n in (*self.notes, *self.after.notes[:5])]
        return "\n".join(lines) + "\n"

    def plot(self, path: str | Path) -> Path:
        """Write a PNG of device memory over one simulated step, before vs after."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 3.6))
        for label, prof, style in (("before", self.before, "-"), ("after", self.after, "-")):
            span = prof.estimated_step_s or 1.0
            xs = [t / span for t, *_ in prof.timeline]
            ys = [d / 2**20 for _, d, *_ in prof.timeline]
            ax.step(xs, ys, style, where="post", label=f"{label} (peak {format_bytes(prof.peak_bytes)})")
        if self.budget_bytes:
            ax.axhline(self.budget_bytes / 2**20, color="red", linestyle="--", label="budget")
        ax.set_xlabel("fraction of the step (simulated schedule)")
        ax.set_ylabel("device memory (MiB)")
        ax.set_title("Device memory over one step (tfmem simulator)")
        ax.legend(loc="best", fontsize=8)
        fig.tight_layout()
        out = Path(path)
        fig.savefig(out, dpi=110)
        plt.close(fig)
        return out

    def chrome_trace(self, path: str | Path) -> Path:
        """Write the after-schedule as Chrome trace JSON with device/host memory counters."""
        events: list[dict[str, object]] = []
        for pid, (label, prof) in enumerate((("before", self.before), ("after", self.after))):
            events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"{label} (simulated)"}})
            sched = prof.schedule
            for unit, start, end in zip(sched.order, sched.start_s, sched.end_s, strict=True):
                events.append({"name": unit, "ph": "X", "pid": pid, "tid": 0, "ts": start * 1e6,
                               "dur": max((end - start) * 1e6, 0.01)})
            for t, device, host, _unit in prof.timeline:
                events.append({"name": "memory", "ph": "C", "pid": pid, "ts": t * 1e6,
                               "args": {"device MiB": device / 2**20, "host MiB": host / 2**20}})
        out = Path(path)
        out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
        return out
