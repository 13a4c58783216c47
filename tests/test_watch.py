"""Tests of ``tfmem.testbed.watch``: how a run's ending is classified, with stand-ins for the servers (no TF)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tfmem.testbed.watch import Ending, Phase, watch


class Servers:
    """Stand-ins: a list of dump files, a dead flag, and a stop that wakes the blocked work."""

    def __init__(self) -> None:
        self.dumps: list[Path] = []
        self.is_dead = False
        self.stopped = threading.Event()
        self.aborted = False

    def stop(self) -> None:
        self.stopped.set()

    def abort(self) -> None:
        self.aborted = True
        self.stopped.set()

    def watch(self, work: Callable[[Phase], Any]) -> Ending:
        return watch(work, started=time.monotonic(), dumps=lambda: list(self.dumps), dead=lambda: self.is_dead,
                     stop=self.stop, abort=self.abort)


def blocked_until_stopped(servers: Servers, phase: Phase, limit_s: float | None = None) -> None:
    """A TF call that only returns (with an error) once its servers are gone (in a phase of ``limit_s``)."""
    if limit_s is not None:
        phase.enter("warm-up step", limit_s)
    if not servers.stopped.wait(30):
        raise AssertionError("never stopped")
    raise ConnectionError("UNAVAILABLE: socket closed")


def test_a_run_that_returns_ran() -> None:
    s = Servers()
    ending = s.watch(lambda phase: 42)
    assert (ending.kind, ending.value, ending.error) == ("ran", 42, None) and not s.stopped.is_set()


def test_a_failed_request_is_an_oom_and_stops_the_servers_without_waiting_for_tf() -> None:
    s = Servers()

    def work(phase: Phase) -> None:
        phase.enter("timed step 1 of 3", float("inf"))
        time.sleep(0.2)
        s.dumps.append(Path("bfc_1"))          # the allocator failed a request; TF would now wait 10 s
        blocked_until_stopped(s, phase)

    started = time.monotonic()
    ending = s.watch(work)
    assert ending.kind == "oom" and ending.phase == "timed step 1 of 3" and ending.dump == Path("bfc_1")
    assert s.stopped.is_set() and 0.2 <= ending.after_s < time.monotonic() - started


def test_a_request_served_after_the_retry_is_not_an_oom() -> None:
    s = Servers()

    def work(phase: Phase) -> str:
        s.dumps.append(Path("bfc_1"))
        return "done"   # another op freed memory in time

    assert s.watch(work).kind == "ran"


def test_a_dead_server_is_a_crash_unless_a_request_failed_first() -> None:
    s = Servers()

    def work(phase: Phase) -> None:
        s.is_dead = True
        blocked_until_stopped(s, phase)

    assert s.watch(work).kind == "crash"
    s = Servers()

    def after_failed_request(phase: Phase) -> None:
        s.dumps.append(Path("bfc_1"))
        time.sleep(0.05)
        s.is_dead = True
        blocked_until_stopped(s, phase)

    assert s.watch(after_failed_request).kind == "oom"


def test_a_phase_over_its_limit_is_a_timeout_naming_the_phase() -> None:
    s = Servers()
    ending = s.watch(lambda phase: blocked_until_stopped(s, phase, limit_s=0.1))
    assert (ending.kind, ending.phase, ending.limit_s) == ("timeout", "warm-up step", 0.1) and s.stopped.is_set()


def test_an_error_with_healthy_servers_is_handed_back() -> None:
    s = Servers()

    def work(phase: Phase) -> None:
        raise ValueError("bad feed")

    ending = s.watch(work)
    assert ending.kind == "failed" and isinstance(ending.error, ValueError)


def test_an_interrupt_in_the_calling_thread_aborts_the_servers_and_propagates() -> None:
    s = Servers()
    polls = iter(range(3))

    def dumps() -> list[Path]:
        if next(polls, None) is None:
            raise KeyboardInterrupt   # Ctrl-C lands while the calling thread polls
        return []

    with pytest.raises(KeyboardInterrupt):
        watch(lambda phase: blocked_until_stopped(s, phase), started=time.monotonic(), dumps=dumps,
              dead=lambda: False, stop=s.stop, abort=s.abort)
    assert s.aborted
