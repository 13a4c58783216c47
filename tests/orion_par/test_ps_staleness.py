"""No read ever breaks the SSP bound: 10,000 randomised reads with injected delays, on both transports.

The checker is written from the definition alone (orion_par.ps.param_server's docstring), not from the
implementation: worker ``v`` only ever adds 1 to column ``v``, so column ``v`` of a value counts exactly
the updates of ``v`` it includes.  A read by worker ``w`` at clock ``c`` of row ``r`` is correct iff

* for every worker ``v``: ``value[v] >= #updates of v to r at clocks < c - s`` (the bound; none for ASP);
* ``value[w] == #updates of w to r made before this read`` (read-my-writes, and nothing invented);
* for every worker ``v``: ``value[v] <= #updates of v to r`` over the whole run (nothing from nowhere).
"""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
import pytest

from orion_par.ps import ClientOptions, LocalPS, TableSpec

ROWS = 6
WORKERS = 3
READS_PER_TRANSPORT = 10_000
STALENESS = (0, 1, 3, None)  # BSP, SSP and ASP share the 10,000 reads of each transport


TABLES = {f"s{s}": s for s in STALENESS}  # one table per bound, all used in one run


class Probe:
    """One worker's random program: reads and +1 increments in random order, with injected delays."""

    def __init__(self, reads_per_clock: int, seed: int, straggler: int) -> None:
        self.reads_per_clock, self.seed, self.straggler = reads_per_clock, seed, straggler

    def __call__(self, client, worker, clock):
        rng = np.random.default_rng([self.seed, worker, clock])
        delay = 0.0004 if worker == self.straggler else 0.0001
        names = sorted(TABLES)
        log = []
        reads = 0
        while reads < self.reads_per_clock:
            if rng.random() < 0.3:
                time.sleep(rng.random() * delay)  # injected delay: workers drift apart
            table = names[int(rng.integers(len(names)))]
            if rng.random() < 0.5:
                row = int(rng.integers(ROWS))
                delta = np.zeros((1, WORKERS))
                delta[0, worker] = 1.0
                client.inc(table, [row], delta)
                log.append(("inc", table, clock, row, None))
            else:
                rows = rng.choice(ROWS, size=int(rng.integers(1, 4)), replace=False)
                values = client.get(table, rows)
                for r, v in zip(rows.tolist(), values.tolist(), strict=True):
                    log.append(("read", table, clock, r, v))
                reads += 1
        return log


def violations(logs, staleness):
    """Reads that break the definition above; ``logs[w]`` is worker w's ops on one table, in program order."""
    clocks = 1 + max((c for log in logs for _, c, _, _ in log), default=0)
    before = np.zeros((WORKERS, ROWS, clocks + 1), dtype=np.int64)  # [v, row, c]: updates at clocks < c
    for w, log in enumerate(logs):
        for op, clock, row, _ in log:
            if op == "inc":
                before[w, row, clock + 1:] += 1
    total = before[:, :, -1]
    bad = []
    for w, log in enumerate(logs):
        own = Counter()
        for op, clock, row, value in log:
            if op == "inc":
                own[row] += 1
                continue
            for v in range(WORKERS):
                required = 0 if staleness is None else int(before[v, row, max(clock - staleness, 0)])
                if value[v] < required or value[v] > total[v, row] or (v == w and value[v] != own[row]):
                    bad.append((w, clock, row, v, value[v], required, own[row] if v == w else None))
    return bad


def run_probe(make, reads, seed, clocks=25):
    """Run the probe on a fresh server; returns (per-table logs, reads done, staleness histogram, tables)."""
    per_clock = -(-reads // (WORKERS * clocks))  # round up: at least `reads` reads
    ps = make([TableSpec(name, ROWS, WORKERS, staleness=s) for name, s in TABLES.items()], WORKERS)
    try:
        result = ps.run(Probe(per_clock, seed, straggler=seed % WORKERS), clocks)
        logs = {t: [[(op, c, r, v) for clock_log in worker for op, tt, c, r, v in clock_log if tt == t]
                    for worker in result.results] for t in TABLES}
        return logs, sum(s.reads for s in result.stats), ps.tables()
    finally:
        if hasattr(ps, "close"):
            ps.close()


def check_transport(make):
    logs, reads, tables = run_probe(make, READS_PER_TRANSPORT, seed=1)
    assert reads >= READS_PER_TRANSPORT
    for name, s in TABLES.items():
        assert violations(logs[name], s) == [], f"table {name} (staleness {s})"
        want = np.zeros((ROWS, WORKERS))
        for w, log in enumerate(logs[name]):
            for op, _, row, _ in log:
                want[row, w] += op == "inc"
        assert np.array_equal(tables[name], want)  # every update arrived exactly once


def test_checker_catches_a_stale_read():
    # The checker must be able to fail: a read at clock 2 (s=0) that misses worker 1's clock-0 update.
    logs = [[("inc", 0, 0, None), ("read", 2, 0, [1.0, 0.0, 0.0])], [("inc", 0, 0, None)], []]
    assert len(violations(logs, 0)) == 1
    assert violations(logs, 2) == []
    logs[0][1] = ("read", 2, 0, [0.0, 1.0, 0.0])  # lost its own write
    assert len(violations(logs, 2)) == 1


def test_no_stale_reads_local():
    check_transport(lambda specs, n: LocalPS(specs, n, num_shards=2))


def test_no_stale_reads_local_managed_communication():
    # Early flushes, pushes between clocks and a background sender must not break the bound either.
    opts = ClientOptions(bandwidth_bytes_per_s=2e6, policy="magnitude", async_send=True)
    logs, reads, _ = run_probe(lambda specs, n: LocalPS(specs, n, options=opts), 2000, seed=7)
    assert reads >= 2000
    for name, s in TABLES.items():
        assert violations(logs[name], s) == []


@pytest.mark.slow
def test_no_stale_reads_ray(ray_session):
    from orion_par.ps.ray_transport import RayPS

    check_transport(lambda specs, n: RayPS(specs, n, num_shards=2))
