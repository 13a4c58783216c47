"""When to resize an elastic job and which workers to replace: measurement windows, policies, the log.

An elastic run is cut into *windows* (a few schedule steps of ``parallel_for``, a few clocks of the
parameter server).  After each window the executor hands the controller a ``Window`` (wall time, work
done, each worker's throughput, the user's progress measure); the controller asks the policy for a worker
count and the straggler rule for workers to replace, and the executor carries the ``Decision`` out at the
boundary.  Every transition is logged as an ``Event`` with its reason, its idle time and the throughput
around it (``ElasticLog``).

Policies (pluggable: anything with ``decide(history) -> Decision | None``):

- ``ScalingEfficiency``: after Or, Zhang and Freedman (MLSys '20).  Grow while each added worker brings at
  least ``threshold`` of the current per-worker throughput, ``s = (R_new - R_old) / (k_new - k_old) /
  (R_old / k_old)``; when ``s`` falls below, remove the workers added last and stay.
- ``UtilityCost``: grow while the user's utility of progress per second, less ``cost_per_worker_s`` per
  worker, improves; go back when it does not.
- ``FixedSchedule``: the worker count (and replacements) at given windows, for tests and baselines.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from orion_par.elastic.emulate import Emulation


class ElasticError(ValueError):
    """Bad elastic configuration: what is wrong and how to fix it."""


@dataclass(frozen=True)
class Window:
    """What one measurement window did.

    ``work`` is in the executor's unit (records for ``parallel_for``, the program's reported work for the
    parameter server); ``per_worker`` is each worker slot's throughput (work per busy second) in the window
    (NaN for a slot that had no work in it);
    ``progress`` is the user's measure after the window (``Elastic.progress``), or None.
    """

    index: int
    start_s: float
    elapsed_s: float
    workers: int
    work: float
    per_worker: tuple[float, ...]
    progress: float | None = None

    @property
    def throughput(self) -> float:
        return self.work / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclass(frozen=True)
class Decision:
    """Run the next window with ``workers`` workers; first replace the worker slots in ``replace``."""

    workers: int
    replace: tuple[int, ...] = ()
    reason: str = ""


class Policy(Protocol):
    """Chooses the worker count from the windows so far (None: keep the current count)."""

    def decide(self, history: Sequence[Window]) -> Decision | None: ...


def _stint(history: Sequence[Window]) -> list[Window]:
    """The latest windows run at the current worker count (since the last change of count)."""
    out: list[Window] = []
    for w in reversed(history):
        if out and w.workers != out[-1].workers:
            break
        out.append(w)
    return out[::-1]


@dataclass
class _HillClimb:
    """Grow from the current count while ``better(old, new)``; on the first step that is not, go back and stay.

    A count is measured over ``measure`` windows after ``warmup`` windows (after a change only: a new
    worker's first window is slower).  Growth doubles the count, by at most ``max_step`` workers, up to
    ``max_workers``.
    """

    max_workers: int = 8
    min_workers: int = 1
    max_step: int = 4
    measure: int = 1
    warmup: int = 1
    settled: bool = field(default=False, init=False)
    last: tuple[int, float] | None = field(default=None, init=False)  # (workers, score) of the previous count

    def __post_init__(self) -> None:
        if not 1 <= self.min_workers <= self.max_workers:
            raise ElasticError(f"{type(self).__name__}: need 1 <= min_workers ({self.min_workers}) <= max_workers "
                               f"({self.max_workers}).")
        if self.max_step < 1 or self.measure < 1 or self.warmup < 0:
            raise ElasticError(f"{type(self).__name__}: max_step ({self.max_step}) and measure ({self.measure}) "
                               f"must be >= 1, warmup ({self.warmup}) >= 0.")

    def next_count(self, workers: int) -> int | None:
        """The count it would try next if ``workers`` pays (None once settled): drivers start those actors early."""
        grow = min(workers + self.max_step, 2 * workers, self.max_workers)
        return None if self.settled or grow <= workers else grow

    def score(self, windows: Sequence[Window]) -> float:
        raise NotImplementedError

    def better(self, old: tuple[int, float], new: tuple[int, float]) -> tuple[bool, str]:
        raise NotImplementedError

    def decide(self, history: Sequence[Window]) -> Decision | None:
        stint = _stint(history)
        if stint[0].index > 0:
            stint = stint[self.warmup:]
        if self.settled or len(stint) < self.measure:
            return None
        k = stint[-1].workers
        now = (k, self.score(stint[-self.measure:]))
        if self.last is None or self.last[0] == k:
            ok, why = True, "first measurement"
        else:
            ok, why = self.better(self.last, now)
        if not ok:
            self.settled = True
            return Decision(self.last[0], reason=f"{why}: back to {self.last[0]} workers")  # type: ignore[index]
        grow = min(k + self.max_step, 2 * k, self.max_workers)
        if grow <= k:
            self.settled = True
            return None
        self.last = now
        return Decision(grow, reason=f"{why}: try {grow} workers")


@dataclass
class ScalingEfficiency(_HillClimb):
    """Add workers while each brings at least ``threshold`` of the per-worker throughput (module doc)."""

    threshold: float = 0.5

    def score(self, windows: Sequence[Window]) -> float:
        return float(np.mean([w.throughput for w in windows]))

    def better(self, old: tuple[int, float], new: tuple[int, float]) -> tuple[bool, str]:
        (k0, r0), (k1, r1) = old, new
        s = (r1 - r0) / (k1 - k0) / (r0 / k0) if r0 > 0 else 0.0
        return s >= self.threshold, f"scaling efficiency {s:.2f} from {k0} to {k1} (threshold {self.threshold})"


@dataclass
class UtilityCost(_HillClimb):
    """Grow while utility gained per second less ``cost_per_worker_s`` per worker improves.

    ``utility(progress) -> float`` values the user's progress measure (``Window.progress``, from
    ``Elastic(progress=...)``, which it needs), higher is better: for a loss, e.g. ``lambda loss: -loss``.
    """

    utility: Callable[[float], float] = float
    cost_per_worker_s: float = 0.0

    def score(self, windows: Sequence[Window]) -> float:
        rates = []
        for w in windows:
            if w.progress is None:
                raise ElasticError("UtilityCost needs a progress measure: pass Elastic(progress=...) returning a "
                                   "number the utility function values.")
            rates.append(w.progress)
        first, last = windows[0], windows[-1]
        seconds = sum(w.elapsed_s for w in windows)
        before = self._before.get(first.index, rates[0])
        gain = (self.utility(rates[-1]) - self.utility(before)) / seconds if seconds > 0 else 0.0
        return gain - self.cost_per_worker_s * last.workers

    _before: dict[int, float] = field(default_factory=dict, init=False, repr=False)

    def decide(self, history: Sequence[Window]) -> Decision | None:
        # Utility gained in a window needs the progress before it: the previous window's.
        for prev, cur in zip(history, history[1:], strict=False):
            if prev.progress is not None:
                self._before[cur.index] = prev.progress
        return super().decide(history)

    def better(self, old: tuple[int, float], new: tuple[int, float]) -> tuple[bool, str]:
        return new[1] > old[1], f"net utility rate {new[1]:.4g} at {new[0]} workers vs {old[1]:.4g} at {old[0]}"


@dataclass
class FixedSchedule:
    """The worker count from window ``i`` on is ``workers[i]`` (latest key <= i); ``replace[i]``: slots to
    replace before window ``i``.  Window 0's count is the run's starting count."""

    workers: Mapping[int, int] = field(default_factory=dict)
    replace: Mapping[int, tuple[int, ...]] = field(default_factory=dict)

    @property
    def max_workers(self) -> int:
        """The largest count it asks for (0 if none): drivers size their Ray for it."""
        return max(self.workers.values(), default=0)

    def decide(self, history: Sequence[Window]) -> Decision | None:
        nxt = len(history)
        keys = [i for i in self.workers if i <= nxt]
        count = self.workers[max(keys)] if keys else history[-1].workers
        slots = tuple(self.replace.get(nxt, ()))
        if count == history[-1].workers and not slots:
            return None
        return Decision(count, slots, f"fixed schedule at window {nxt}")


@dataclass
class Stragglers:
    """Replace a worker whose throughput's moving average stays below ``fraction`` of the others' median.

    ``alpha`` weighs the newest window in the exponential moving average; a worker is replaced after
    ``patience`` windows in a row below the line.  A replaced or new slot starts a fresh average.
    """

    fraction: float = 0.5
    patience: int = 2
    alpha: float = 0.5
    ema: dict[int, float] = field(default_factory=dict, init=False)
    below: dict[int, int] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if not 0 < self.fraction < 1 or self.patience < 1 or not 0 < self.alpha <= 1:
            raise ElasticError(f"Stragglers: need 0 < fraction ({self.fraction}) < 1, patience ({self.patience}) "
                               f">= 1 and 0 < alpha ({self.alpha}) <= 1.")

    def forget(self, slots: Sequence[int]) -> None:
        for s in slots:
            self.ema.pop(s, None)
            self.below.pop(s, None)

    def observe(self, window: Window) -> tuple[tuple[int, ...], str]:
        """Slots to replace after ``window``, and why."""
        self.forget([s for s in self.ema if s >= window.workers])
        for s, r in enumerate(window.per_worker):
            if np.isfinite(r):  # a slot without work in this window keeps its average
                self.ema[s] = r if s not in self.ema else self.alpha * r + (1 - self.alpha) * self.ema[s]
        out, why = [], []
        for s in range(window.workers):
            others = [self.ema[o] for o in range(window.workers) if o != s and o in self.ema]
            if not others or s not in self.ema or not np.isfinite(window.per_worker[s]):
                continue
            line = self.fraction * float(np.median(others))
            self.below[s] = self.below.get(s, 0) + 1 if self.ema[s] < line else 0
            if self.below[s] >= self.patience:
                out.append(s)
                why.append(f"worker {s} at {self.ema[s]:.4g}/s below {self.fraction} x the others' median "
                           f"{line / self.fraction:.4g}/s for {self.below[s]} windows")
        self.forget(out)
        return tuple(out), "; ".join(why)


@dataclass
class Elastic:
    """How ``parallel_for(...).run(..., elastic=...)`` and ``RayPS.run(..., elastic=...)`` resize.

    Parameters
    ----------
    policy : Policy
        ``ScalingEfficiency()``, ``UtilityCost(...)``, ``FixedSchedule(...)`` or your own.
    window : int or callable
        Schedule steps (``parallel_for``) or clocks (parameter server) per measurement window, or a function
        of the worker count giving them (``window_for``); transitions happen only at window boundaries.  On
        the parameter server a clock's work is split among the workers, so one worker's clocks are the
        longest: e.g. ``lambda workers: max(1, workers // 2)`` keeps windows about as long at every count.
    stragglers : Stragglers, optional
        Replace slow workers (None: never).
    progress : callable, optional
        Called after every window with no arguments; returns the user's progress measure (e.g. RMSE),
        logged with the window and given to the policy.
    restart : bool
        Carry every transition out by checkpoint-and-restart (save the state to disk, stop every worker
        and Ray itself, start again, load): the baseline elastic transitions are measured against.
    background : bool
        Start new actors (additions, replacements) in the background while the current ones keep working,
        and make the transition once they are up (default).  False: wait for them at the transition, so the
        transitions happen exactly at the windows the policy chose.
    emulation : Emulation, optional
        Pad each worker's work to emulated compute times (experiments on a small machine; ``emulate``).
    speculate : bool
        While a grown count is measured, start in the background the actors the policy would add next
        (``next_count``): if it asks for them they are up already, if not they are stopped; their time is
        counted in ``ElasticLog.worker_seconds``.
    stop : callable, optional
        ``stop(window) -> bool``: end the run after the first window for which it is true (a target reached,
        a time limit); the arrays are those of that window's end.
    fault : callable, optional
        Fault injection: called as ``fault(point, window, actors)`` at each window's start (``"window"``) and
        inside each transition once the new actors exist (``"transition"``); tests kill actors there.
    """

    policy: Policy
    window: int | Callable[[int], int] = 4
    stragglers: Stragglers | None = None
    progress: Callable[[], float] | None = None
    restart: bool = False
    background: bool = True
    emulation: Emulation | None = None
    speculate: bool = True
    stop: Callable[[Window], bool] | None = None
    fault: Callable[[str, int, Sequence[Any]], None] | None = None

    def __post_init__(self) -> None:
        if not callable(self.window):
            self.window_for(1)

    def window_for(self, workers: int) -> int:
        """Steps or clocks per window while ``workers`` workers run."""
        width = self.window(workers) if callable(self.window) else self.window
        if isinstance(width, bool) or not isinstance(width, (int, np.integer)) or width < 1:
            shown = f"{self.window!r}" if not callable(self.window) else f"<function> giving {width!r} at {workers}"
            raise ElasticError(f"Elastic(window={shown}): a window is a whole number >= 1 of schedule steps "
                               f"(parallel_for) or clocks (parameter server), or a function of the worker count "
                               f"returning one.")
        return int(width)


@dataclass(frozen=True)
class Event:
    """One transition: at ``at_s`` seconds into the run, before window ``window``."""

    kind: str  # "resize", "replace" or "resize+replace"
    window: int
    at_s: float
    workers_before: int
    workers_after: int
    replaced: tuple[int, ...]
    reason: str
    idle_s: float  # wall time of the transition itself (no work done)
    throughput_before: float  # the last window's
    started_s: float = 0.0  # how long the new actors were starting in the background before it


@dataclass
class ElasticLog:
    """Every window and every transition of an elastic run, in order."""

    windows: list[Window] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    recoveries: int = 0  # failed workers restarted from the last window's checkpoint
    spares: list[tuple[float, float, int]] = field(default_factory=list)  # (from, to, actors) started, never used
    stopped: bool = False  # ended early by Elastic.stop

    def throughput_after(self, event: Event) -> float | None:
        """Throughput of the first window after ``event`` (None if the run ended first)."""
        later = [w for w in self.windows if w.index >= event.window]
        return later[0].throughput if later else None

    def as_schedule(self) -> FixedSchedule:
        """The transitions this run made, as a policy: replays the same allocation sequence (with
        ``Elastic(background=False)``, or ``restart=True``, transitions happen at exactly these windows)."""
        return FixedSchedule({e.window: e.workers_after for e in self.events},
                             {e.window: e.replaced for e in self.events if e.replaced})

    def worker_seconds(self, until_s: float | None = None) -> float:
        """Workers held times wall time, from the run's start to ``until_s`` (default: its last window).

        The time up to each window's end is charged at that window's count (starting actors and transitions
        included); actors started in the background are charged from their start.
        """
        total, prev = 0.0, 0.0
        for w in self.windows:
            end = w.start_s + w.elapsed_s
            if until_s is not None:
                end = min(end, until_s)
            total += w.workers * max(0.0, end - prev)
            prev = max(prev, end)
        for start, stop, count in self.spares:
            end = stop if until_s is None else min(stop, until_s)
            total += count * max(0.0, end - start)
        for e in self.events:
            fresh = len(e.replaced) + max(0, e.workers_after - e.workers_before)
            begun = e.at_s - e.started_s
            if until_s is not None:
                total += fresh * max(0.0, min(e.at_s, until_s) - begun)
            else:
                total += fresh * e.started_s
        return total

    def idle_s(self) -> float:
        return sum(e.idle_s for e in self.events)

    def describe(self) -> str:
        """One line per transition: when, what, why, idle time, throughput before and after."""
        lines = []
        for e in self.events:
            after = self.throughput_after(e)
            lines.append(f"{e.at_s:8.2f}s window {e.window}: {e.kind} {e.workers_before} -> {e.workers_after}"
                         f"{' replaced ' + str(list(e.replaced)) if e.replaced else ''} ({e.reason}); idle "
                         f"{e.idle_s * 1e3:.0f} ms; throughput {e.throughput_before:.4g}/s -> "
                         f"{'-' if after is None else f'{after:.4g}'}/s")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, object]:
        return {"windows": [vars(w) | {"throughput": w.throughput} for w in self.windows],
                "events": [vars(e) | {"throughput_after": self.throughput_after(e)} for e in self.events],
                "recoveries": self.recoveries, "worker_seconds": self.worker_seconds(), "idle_s": self.idle_s()}

    def plot(self, path: str) -> None:
        """Workers and throughput over time, transitions marked (needs matplotlib)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.2))
        t = [w.start_s + w.elapsed_s for w in self.windows]
        ax.step(t, [w.workers for w in self.windows], where="pre", color="C0", label="workers")
        ax.set_xlabel("seconds")
        ax.set_ylabel("workers", color="C0")
        ax2 = ax.twinx()
        ax2.plot(t, [w.throughput for w in self.windows], ".-", color="C1", label="throughput")
        ax2.set_ylabel("work / s", color="C1")
        for e in self.events:
            ax.axvline(e.at_s, color="grey", lw=0.6, ls=":")
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)


class Controller:
    """Turns windows into decisions: the policy's count, the straggler rule's replacements, bounds checked."""

    def __init__(self, elastic: Elastic, max_workers: int | None = None) -> None:
        self.elastic = elastic
        self.max_workers = max_workers
        self.log = ElasticLog()

    def observe(self, window: Window) -> Decision | None:
        self.log.windows.append(window)
        decision = self.elastic.policy.decide(self.log.windows)
        count = decision.workers if decision is not None else window.workers
        if self.max_workers is not None and count > self.max_workers:
            count = self.max_workers
        if count < 1:
            raise ElasticError(f"policy {type(self.elastic.policy).__name__} asked for {count} workers; need >= 1.")
        replace = tuple(decision.replace) if decision is not None else ()
        reasons = [decision.reason] if decision is not None and decision.reason else []
        if self.elastic.stragglers is not None:
            slow, why = self.elastic.stragglers.observe(window)
            slow = tuple(s for s in slow if s < count and s not in replace)
            if slow:
                replace += slow
                reasons.append(why)
            if count != window.workers:
                self.elastic.stragglers.forget(range(min(count, window.workers), max(count, window.workers)))
        if count == window.workers and not replace:
            return None
        return Decision(count, tuple(sorted(set(replace))), "; ".join(reasons))

    def record(self, decision: Decision, window: Window, at_s: float, idle_s: float, started_s: float = 0.0) -> None:
        kind = "+".join(k for k, on in (("resize", decision.workers != window.workers),
                                        ("replace", bool(decision.replace))) if on)
        self.log.events.append(Event(kind, window.index + 1, at_s, window.workers, decision.workers,
                                     decision.replace, decision.reason, idle_s, window.throughput, started_s))
