"""The exception hierarchy of tfmem: every error the toolkit raises on purpose is a ``TfmemError``.

Messages say what went wrong, where, the numbers involved and how to fix it, so that the CLI can print
``str(error)`` as its one line.
"""

from __future__ import annotations

from collections.abc import Sequence


def first_line(error: BaseException) -> str:
    """The first non-empty line of an exception's message (TF's are long), or its type's name."""
    lines = [ln.strip() for ln in str(error).strip().splitlines() if ln.strip()]
    return lines[0] if lines else type(error).__name__


class TfmemError(Exception):
    """Base class of every error tfmem raises on purpose."""


class BadInputError(TfmemError, ValueError):
    """A user-supplied value (a budget string, a feed shape, a path) is malformed."""


class MalformedGraphError(TfmemError, ValueError):
    """The graph cannot be read or is not well formed (unknown input, cycle, duplicate name, ...)."""


class UnknownShapeError(MalformedGraphError):
    """Some tensor sizes cannot be determined; ``tensors`` lists every one of them."""

    def __init__(self, message: str, tensors: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.tensors = tuple(tensors)


class UnsupportedOpError(TfmemError, NotImplementedError):
    """An op or construct that tfmem cannot handle (and says so rather than guessing)."""


class ScheduleError(TfmemError):
    """A schedule reads a tensor that is not resident, or cannot order the graph."""


class InfeasibleBudgetError(TfmemError):
    """No plan tfmem can build fits the budget.

    Carries ``budget_bytes``, ``best_peak_bytes``, ``lower_bound_bytes`` and ``live_at_peak`` (the largest
    tensors live at the best plan's peak) so callers can decide what to change, and ``search``, the budget
    search's log (``tfmem.search.SearchLog``; None when nothing was planned). ``lower_bound_bytes`` is a
    device size no plan fits below: the largest single-op working set, or what the fed tensors need in TF's
    allocator (``tfmem.sim.bounds.fed_layout_floor``), whichever is higher. ``device`` names the device that
    cannot fit when ``optimize`` planned several (``devices=``), else None.
    """

    def __init__(
        self,
        message: str,
        *,
        budget_bytes: int,
        best_peak_bytes: int,
        lower_bound_bytes: int,
        live_at_peak: Sequence[object] = (),
        search: object | None = None,
        device: str | None = None,
    ) -> None:
        super().__init__(message)
        self.search = search
        self.device = device
        self.budget_bytes = budget_bytes
        self.best_peak_bytes = best_peak_bytes
        self.lower_bound_bytes = lower_bound_bytes
        self.live_at_peak = tuple(live_at_peak)


def on_device(error: InfeasibleBudgetError, device: str) -> InfeasibleBudgetError:
    """``error`` said of ``device``, one of several planned: its message starts with the device's name."""
    return InfeasibleBudgetError(f"device {device}: {error}", budget_bytes=error.budget_bytes,
                                 best_peak_bytes=error.best_peak_bytes, lower_bound_bytes=error.lower_bound_bytes,
                                 live_at_peak=error.live_at_peak, search=error.search, device=device)


class PassError(TfmemError):
    """A pass failed unexpectedly; names the pass and the passes that ran before it."""

    def __init__(self, pass_name: str, after: Sequence[str] = (), detail: str = "") -> None:
        before = ", ".join(after) if after else "none"
        super().__init__(f"pass {pass_name!r} failed (passes run before it: {before}): {detail}")
        self.pass_name = pass_name
        self.after = tuple(after)


class TestbedError(TfmemError):
    """The testbed could not run a graph: its servers did not start, or TensorFlow rejected the run (a bad feed
    value, an uninitialised variable)."""

    __test__ = False  # not a pytest test class


class TestbedTimeoutError(TestbedError):
    """A phase of a testbed run (``phase``: initialisation, the warm-up step, a timed step) took longer than its
    limit (``limit_s``); the servers were stopped, so nothing is left waiting."""

    def __init__(self, message: str, *, phase: str, limit_s: float) -> None:
        super().__init__(message)
        self.phase = phase
        self.limit_s = limit_s


class TestbedCrashError(TestbedError):
    """A testbed server died during a run; the message ends with its stderr."""

    def __init__(self, message: str, *, phase: str) -> None:
        super().__init__(message)
        self.phase = phase
