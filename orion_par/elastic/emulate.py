"""Emulated worker speeds, so that scaling and stragglers can be measured on a small machine.

A worker pads each piece of work to ``units * seconds_per_unit * slowdown`` seconds of wall time by
sleeping, so eight emulated workers fit on two cores as long as the real compute is a small part of the
emulated time (experiments/elastic.py checks it and records the overruns).  ``slow`` maps the *start
number* of a worker process (0, 1, 2, ... in the order the run started them) to its slowdown: a slow
machine stays slow, and the fresh process that replaces it runs at full speed.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Emulation:
    seconds_per_unit: float
    slow: Mapping[int, float] = field(default_factory=dict)

    def slowdown(self, start_number: int) -> float:
        return float(self.slow.get(start_number, 1.0))

    def pad(self, units: float, busy_s: float, slowdown: float) -> float:
        """Sleep until ``busy_s`` reaches the emulated time of ``units``; returns the seconds slept."""
        want = units * self.seconds_per_unit * slowdown
        rest = want - busy_s
        if rest > 0:
            time.sleep(rest)
            return rest
        return 0.0
