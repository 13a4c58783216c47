"""Watching one testbed run from the calling thread, so that every run ends as one of four things, promptly.

The run's TensorFlow calls go to a helper thread (``watch``); the calling thread polls, every ``POLL_S``:

- **out of memory**: the device server writes the BFC allocator's memory map (``TF_BFC_MEMORY_DUMP``) the moment
  a request fails, before TensorFlow's ``AllocatorRetry`` waits up to 10 s for memory to be returned and only then
  raises (with no other op running, nothing is returned: every OOM used to cost 10 s or more, and one while the
  worker built a constant surfaced as a parse error). A request still unserved ``OOM_GRACE`` of the time the run
  took to reach it later is an out-of-memory: the servers are killed, so TensorFlow's call returns at once;
- **crash**: a server process died;
- **timeout**: one phase (initialisation, the warm-up step, a timed step) took longer than its limit;
- **interrupt**: Ctrl-C in the calling thread (a lock wait in Python, unlike a TF call, takes it at once) kills
  the servers so the helper's TF call ends too, and re-raises.

Killing is how a run is cut short: TensorFlow has no way to cancel a step that waits in its allocator, and a
distributed session's close waits for the step (``tests/test_testbed.py``: Ctrl-C, repeated OOMs).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

POLL_S = 0.02
# A failed request may still be served after the allocator's retry if another op frees memory; wait this share
# of the time the run took to reach the failure (at most OOM_GRACE_MAX_S) before calling it out of memory, so
# that an OOM is reported within about twice the time it took to happen.
OOM_GRACE = 0.5
OOM_GRACE_MAX_S = 5.0


@dataclass
class Phase:
    """What the helper thread is doing now (set by the run), and since when."""

    name: str = "starting"
    since: float = field(default_factory=time.monotonic)
    limit_s: float = float("inf")

    def enter(self, name: str, limit_s: float) -> None:
        self.name, self.since, self.limit_s = name, time.monotonic(), limit_s


@dataclass(frozen=True)
class Ending:
    """How a watched run ended: ``kind`` is ``ran``, ``oom``, ``timeout``, ``crash`` or ``failed`` (the run
    raised ``error`` with the servers alive and no request unserved: the caller classifies it)."""

    kind: str
    phase: str
    after_s: float            # from the run's start to the ending (for ``oom``, to the failed request)
    value: Any = None
    error: BaseException | None = None
    dump: Path | None = None  # the allocator's memory map at the failed request
    limit_s: float | None = None


def watch(work: Callable[[Phase], Any], *, started: float, dumps: Callable[[], list[Path]],
          dead: Callable[[], bool], stop: Callable[[], None], abort: Callable[[], None] | None = None) -> Ending:
    """Run ``work(phase)`` in a helper thread and watch it (see the module docstring).

    ``dumps()`` lists the allocator's memory maps written so far, ``dead()`` says whether a server died, and
    ``stop()`` kills the servers (and starts the next ones). ``KeyboardInterrupt`` (and any other exception in
    the calling thread) calls ``abort`` (default ``stop``), which kills them, and propagates.
    """
    phase = Phase()
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = work(phase)
        except BaseException as e:  # handed to the calling thread, which classifies it
            box["error"] = e

    helper = threading.Thread(target=target, name="tfmem-testbed-run", daemon=True)
    helper.start()
    failure: Ending | None = None   # the first failed request: its phase, when, and the allocator's map

    def failed_request(now: float) -> Ending | None:
        nonlocal failure
        if failure is None and (written := dumps()):
            failure = Ending("oom", phase.name, now - started, dump=written[0])
        return failure

    try:
        while helper.is_alive():
            helper.join(POLL_S)
            if not helper.is_alive():
                break
            now = time.monotonic()
            oom, cut = failed_request(now), None
            if oom is not None and now - started - oom.after_s >= min(oom.after_s * OOM_GRACE, OOM_GRACE_MAX_S):
                cut = oom
            elif dead():
                cut = oom or Ending("crash", phase.name, now - started)
            elif now - phase.since > phase.limit_s:
                cut = Ending("timeout", phase.name, now - started, limit_s=phase.limit_s)
            if cut is not None:
                # The helper is left: its TF call waits on the lost master until TF's own deadline (the phase
                # limit + 5 s, ``tfmem.testbed.runner``), then the thread ends (experiments/results/reliability.md).
                stop()
                return cut
    except BaseException:
        (abort or stop)()
        raise
    now = time.monotonic()
    oom = failed_request(now)
    if "error" not in box:
        return Ending("ran", phase.name, now - started, value=box.get("value"))
    error = box["error"]
    if oom is not None:
        return dataclasses.replace(oom, error=error)
    if dead():
        return Ending("crash", phase.name, now - started, error=error)
    return Ending("failed", phase.name, now - started, error=error)
