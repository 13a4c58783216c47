"""Per-worker instrumentation: staleness of every read, bytes on the wire, time spent waiting."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


@dataclass
class WorkerStats:
    """What one worker's client saw.

    Attributes
    ----------
    staleness_hist : dict
        ``clock - stamp`` of each row read -> number of row reads; 0 means the value included every
        update of every clock before the reader's, ``k`` means it may have missed the last ``k`` clocks.
    blocked_s : float
        Seconds ``get`` waited for slower workers (the SSP bound).
    throttled_s : float
        Seconds spent waiting for the bandwidth budget.
    early_bytes_by_table : dict
        Table -> bytes managed communication sent before the clock boundary (which rows it chose).

    Examples
    --------
    >>> s = WorkerStats(worker=0)
    >>> s.record_reads(np.array([3, 3, 1]), clock=3)
    >>> s.staleness_hist, s.max_staleness
    ({0: 2, 2: 1}, 2)
    """

    worker: int
    reads: int = 0
    row_reads: int = 0
    cache_misses: int = 0
    fetches: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    early_bytes: int = 0
    messages_sent: int = 0
    blocked_s: float = 0.0
    throttled_s: float = 0.0
    clocks: int = 0
    staleness_hist: dict[int, int] = field(default_factory=dict)
    early_bytes_by_table: dict[str, int] = field(default_factory=dict)

    def record_reads(self, stamps: np.ndarray, clock: int) -> None:
        self.reads += 1
        self.row_reads += int(stamps.size)
        ages, counts = np.unique(np.maximum(clock - stamps, 0), return_counts=True)
        for a, c in zip(ages.tolist(), counts.tolist(), strict=True):
            self.staleness_hist[a] = self.staleness_hist.get(a, 0) + c

    @property
    def max_staleness(self) -> int:
        return max(self.staleness_hist, default=0)

    @property
    def mean_staleness(self) -> float:
        n = sum(self.staleness_hist.values())
        return sum(a * c for a, c in self.staleness_hist.items()) / n if n else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["staleness_hist"] = {str(k): v for k, v in sorted(self.staleness_hist.items())}
        return out


def total(stats: Iterable[WorkerStats]) -> dict[str, Any]:
    """Sums over workers (histograms merged), for reports."""
    stats = list(stats)
    hist: dict[int, int] = {}
    for s in stats:
        for k, v in s.staleness_hist.items():
            hist[k] = hist.get(k, 0) + v
    keys = ("reads", "row_reads", "cache_misses", "fetches", "bytes_sent", "bytes_received", "early_bytes",
            "messages_sent", "clocks")
    out: dict[str, Any] = {k: sum(getattr(s, k) for s in stats) for k in keys}
    out["blocked_s"] = [round(s.blocked_s, 4) for s in stats]
    out["throttled_s"] = [round(s.throttled_s, 4) for s in stats]
    out["staleness_hist"] = {str(k): v for k, v in sorted(hist.items())}
    return out
