"""An emulated limited link (token bucket on bytes sent) and managed communication's background flusher.

The bucket fills at ``rate_bytes_per_s`` up to ``burst_bytes``.  A clock-boundary flush must send its
whole oplog, so it waits for tokens; the background flusher only spends tokens that are already there,
between clocks, on the highest-priority rows -- so a budget the plain SSP worker leaves idle while it
computes is what managed communication spends.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

from orion_par.ps.tables import PSError


class TokenBucket:
    """Bytes a worker may send now; thread-safe.

    Parameters
    ----------
    rate_bytes_per_s : float
        The link's bandwidth budget.
    burst_bytes : int, optional
        Most tokens that can accumulate (default: 10 ms at the full rate, at least 4 KiB).

    Examples
    --------
    >>> b = TokenBucket(rate_bytes_per_s=1e6, burst_bytes=1000)
    >>> b.try_take(800), b.try_take(800)
    (True, False)
    """

    def __init__(self, rate_bytes_per_s: float, burst_bytes: int | None = None) -> None:
        if not rate_bytes_per_s > 0:
            raise PSError(f"TokenBucket: rate_bytes_per_s={rate_bytes_per_s!r} must be > 0 (use None for no limit).")
        self.rate = float(rate_bytes_per_s)
        self.burst = float(burst_bytes if burst_bytes is not None else max(4096, self.rate * 0.01))
        self.tokens = self.burst
        self.stamp = time.perf_counter()
        self.lock = threading.Lock()

    def _refill(self) -> None:
        now = time.perf_counter()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now

    def available(self) -> int:
        with self.lock:
            self._refill()
            return max(0, int(self.tokens))

    def try_take(self, nbytes: int) -> bool:
        """Take ``nbytes`` if they are there now; never waits."""
        with self.lock:
            self._refill()
            if self.tokens >= nbytes:
                self.tokens -= nbytes
                return True
            return False

    def take(self, nbytes: int) -> float:
        """Wait until ``nbytes`` may be sent and take them; returns the seconds waited.

        A message larger than the burst waits for a full bucket and leaves it in debt, so the average
        rate still never exceeds ``rate_bytes_per_s``.
        """
        waited = 0.0
        while True:
            with self.lock:
                self._refill()
                need = min(float(nbytes), self.burst)
                if self.tokens >= need:
                    self.tokens -= nbytes
                    return waited
                sleep = (need - self.tokens) / self.rate
            time.sleep(sleep)
            waited += sleep


class Flushable(Protocol):
    def flush_some(self, budget_bytes: int, prepaid: bool = False) -> int: ...

    def has_dirty(self) -> bool: ...


class BackgroundFlusher:
    """A thread that, while there are unsent updates, buys ``interval_s`` worth of link time and spends it.

    It takes the tokens before it picks rows (outside the client's lock, so the worker never waits for
    it), then hands that budget to ``client.flush_some``: the link carries early updates at the budget's
    rate while the worker computes, and what the clock boundary must send shrinks.
    """

    def __init__(self, client: Flushable, bucket: TokenBucket, interval_s: float = 0.002) -> None:
        self.client, self.bucket, self.interval_s = client, bucket, interval_s
        self.stop_event = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="orion_par-ps-flusher", daemon=True)

    def start(self) -> BackgroundFlusher:
        self.thread.start()
        return self

    def _loop(self) -> None:
        try:
            budget = max(1, int(self.bucket.rate * self.interval_s))
            while not self.stop_event.wait(self.interval_s / 4):
                if self.client.has_dirty():
                    self.bucket.take(budget)
                    self.client.flush_some(budget, prepaid=True)
        except BaseException as e:  # noqa: BLE001 - reported by stop()
            self.error = e

    def stop(self) -> None:
        """Stop the thread; re-raises what made it fail, if anything did."""
        self.stop_event.set()
        if self.thread.is_alive():
            self.thread.join()
        if self.error is not None:
            raise self.error
