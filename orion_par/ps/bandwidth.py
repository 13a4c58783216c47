"""An emulated limited link (token bucket on bytes sent) and managed communication's background flusher.

The bucket fills at ``rate_bytes_per_s`` up to ``burst_bytes``; a message is delivered once the link has
carried its last byte.  A clock-boundary flush must send its whole oplog, so it waits its transmission
time; the background flusher spends, between clocks, link time the plain SSP worker leaves idle while it
computes, on the highest-priority rows.  Both are charged from the same bucket, byte for byte.
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

    def refund(self, nbytes: int) -> None:
        """Give back ``nbytes`` taken but not sent (never beyond a full bucket)."""
        with self.lock:
            self._refill()
            self.tokens = min(self.burst, self.tokens + nbytes)

    def take(self, nbytes: int) -> float:
        """Send ``nbytes``: wait until the link has carried them, and return the seconds waited.

        The message is queued behind whatever the link still owes (tokens below zero), so a message of
        ``n`` bytes beyond the bucket's tokens waits ``n / rate`` -- its transmission time -- and two
        senders sharing the bucket share the rate.  Nothing arrives before its last byte has been sent.
        """
        with self.lock:
            self._refill()
            self.tokens -= nbytes
            wait = max(0.0, -self.tokens / self.rate)
        if wait:
            time.sleep(wait)
        return wait


class Flushable(Protocol):
    def flush_some(self, budget_bytes: int, prepaid: bool = False) -> int: ...

    def has_dirty(self) -> bool: ...

    def link_idle(self) -> bool: ...

    def sends_in_background(self) -> bool: ...


class BackgroundFlusher:
    """A thread that, while there are unsent updates and the link is idle, sends ``interval_s`` worth of them.

    With a background sender (``async_send``) it picks the rows and queues them like any message: the
    sender pays for them from the bucket and delivers them after their transmission time, behind the
    clock-boundary flushes.  Without one it buys the link time first (outside the client's lock, so the
    worker never waits for it), picks rows that fit, and refunds what they did not use.  Either way
    managed communication is charged exactly the bytes it sends, from the same bucket as every flush.
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
            background = self.client.sends_in_background()
            while not self.stop_event.wait(self.interval_s / 4):
                if not self.client.has_dirty() or not self.client.link_idle():
                    continue
                if background:
                    self.client.flush_some(budget)
                else:
                    self.bucket.take(budget)
                    self.bucket.refund(budget - self.client.flush_some(budget, prepaid=True))
        except BaseException as e:
            self.error = e

    def stop(self) -> None:
        """Stop the thread; re-raises what made it fail, if anything did."""
        self.stop_event.set()
        if self.thread.is_alive():
            self.thread.join()
        if self.error is not None:
            raise self.error
