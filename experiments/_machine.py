"""What the machine offers a benchmark right now: versions, CPUs and load, a compute-only kernel's parallel capacity, and waiting for the CPUs to be idle."""

from __future__ import annotations

import os
import platform
import threading
import time
from typing import Any

import numba


def versions(packages: tuple[str, ...] = ("numpy", "numba", "ray", "surprise", "orion_par")) -> dict[str, str]:
    """Python's version and each package's (or why it is missing)."""
    out = {"python": platform.python_version()}
    for name in packages:
        try:
            mod = __import__(name)
            out[name] = getattr(mod, "__version__", "present")
        except ImportError as e:
            out[name] = f"not installed ({e})"
    return out


def machine_info() -> dict[str, Any]:
    """CPUs, platform and the load average at the start of a run."""
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg_start": os.getloadavg()}


@numba.njit(nogil=True)
def _spin(n: int) -> float:
    x = 0.0
    for _ in range(n):
        x = x * 0.999999 + 1.0
    return x


def spin_seconds(threads: int, n: int = 30_000_000) -> float:
    """Wall time of ``threads`` threads each running the same compute-only kernel: the machine's own
    parallel capacity right now (1.0 = two threads take as long as one; 2x speedup = perfect)."""
    pool = [threading.Thread(target=_spin, args=(n,)) for _ in range(threads)]
    t0 = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return time.perf_counter() - t0


def idle_share(seconds: float) -> float | None:
    """Share of all CPUs' time idle over the next ``seconds`` (/proc/stat; None where there is none)."""
    def snap() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]  # all jiffies, idle + iowait

    try:
        a = snap()
        time.sleep(seconds)
        b = snap()
    except OSError:
        return None
    return (b[1] - a[1]) / max(b[0] - a[0], 1)


def wait_for_quiet(limit_s: float, idle: float = 0.9) -> tuple[float | None, float]:
    """Wait (up to ``limit_s``) until the CPUs are at least ``idle`` idle over half a second; returns the last
    idle share seen and the seconds waited."""
    t0 = time.perf_counter()
    share = idle_share(0.5)
    while share is not None and share < idle and time.perf_counter() - t0 < limit_s:
        share = idle_share(0.5)
    return share, time.perf_counter() - t0
