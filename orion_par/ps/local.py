"""The embedded transport: shards and workers in one process, messages as locked method calls.

Each shard is a ``BoundedStalenessServer`` behind a condition variable.  A read that SSP does not admit
waits on that condition until a tick raises the shard's min clock; every such raise pushes a delivery to
every worker's inbox (server push), and with managed communication every early flush pushes the rows it
changed as well.  Workers are threads; numpy and numba release the GIL in the heavy parts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from orion_par.ps.bandwidth import BackgroundFlusher
from orion_par.ps.client import ClientOptions, PSClient
from orion_par.ps.oplog import Batch
from orion_par.ps.param_server import BoundedStalenessServer, ShardState
from orion_par.ps.stats import WorkerStats
from orion_par.ps.tables import PSError, TableSpec, specs_by_name

Program = Callable[[PSClient, int, int], Any]  # program(client, worker, clock): one clock of one worker's work


@dataclass
class Checkpoint:
    """Every table at ``clock`` (all updates of clocks < clock), one state per shard."""

    clock: int
    shards: list[ShardState]


@dataclass
class RunResult:
    """What ``run`` did: wall time, per-worker stats, table snapshots, and bytes sent over time.

    ``sent`` holds ``(seconds since the start, bytes all workers had sent)`` at each wall-time snapshot.
    """

    elapsed_s: float
    stats: list[WorkerStats]
    snapshots: list[tuple[int, float, dict[str, Any]]] = field(default_factory=list)
    results: list[list[Any]] = field(default_factory=list)
    sent: list[tuple[float, int]] = field(default_factory=list)


class _Host:
    def __init__(self, server: BoundedStalenessServer) -> None:
        self.server = server
        self.cond = threading.Condition()


class LocalChannel:
    """Moves a client's messages to in-process shards (see module docstring)."""

    def __init__(self, ps: LocalPS) -> None:
        self.ps = ps
        self.num_shards = len(ps.hosts)

    def send_inc(self, client: PSClient, shard: int, batches: Sequence[Batch], flush_seq: int, clock: int) -> None:
        host = self.ps.hosts[shard]
        with host.cond:
            host.server.check(client.worker, client.generation)
            for b in batches:
                host.server.inc(client.worker, b.table, b.rows, b.deltas, flush_seq=flush_seq, clock=clock)
            if client.options.policy is not None:  # managed communication: push fresh rows between clocks
                self.ps.push(host, only_news=True, skip=client.worker)  # the sender reads its own writes already

    def send_tick(self, client: PSClient, shard: int) -> None:
        host = self.ps.hosts[shard]
        with host.cond:
            host.server.check(client.worker, client.generation)
            if host.server.tick(client.worker):
                self.ps.push(host, only_news=False)
                if shard == 0:
                    self.ps.on_advance(host.server.min_clock)
                host.cond.notify_all()

    def fetch(self, client: PSClient, shard: int, requests: Mapping[str, np.ndarray]) -> None:
        host = self.ps.hosts[shard]
        with host.cond:
            while True:
                host.server.check(client.worker, client.generation)
                delivery = host.server.get(client.worker, requests, client.clock_)
                if delivery is not None:
                    client.receive(delivery)
                    return
                host.cond.wait()


class LocalPS:
    """A parameter server whose shards and workers live in this process.

    Parameters
    ----------
    tables : iterable of TableSpec
    num_workers : int
    num_shards : int
    options : ClientOptions
        Bandwidth budget and managed-communication policy of every worker.
    deterministic : bool
        Apply updates clock by clock in worker order (bit-reproducible tables).

    Examples
    --------
    >>> import numpy as np
    >>> ps = LocalPS([TableSpec("w", num_rows=2, width=1, staleness=0)], num_workers=2, deterministic=True)
    >>> def program(client, worker, clock):
    ...     client.inc("w", [worker], [[1.0]])
    ...     return client.get("w", [0, 1]).ravel().tolist()
    >>> result = ps.run(program, clocks=3)
    >>> ps.table("w").ravel().tolist()
    [3.0, 3.0]
    >>> result.results[0][2]     # clock 2, BSP: both workers' clocks 0 and 1, plus its own clock 2
    [3.0, 2.0]
    """

    def __init__(self, tables: Iterable[TableSpec], num_workers: int, *, num_shards: int = 1,
                 options: ClientOptions | None = None, deterministic: bool = False) -> None:
        self.specs = specs_by_name(tables)
        if num_workers < 1 or num_shards < 1:
            raise PSError(f"LocalPS: num_workers={num_workers} and num_shards={num_shards} must be >= 1.")
        options = options or ClientOptions()
        if deterministic and options.policy is not None:
            raise PSError("LocalPS: deterministic mode applies updates clock by clock, so managed communication "
                          "(options.policy) has nothing to send early; drop one of them.")
        self.num_workers, self.options = num_workers, options
        self.hosts = [_Host(BoundedStalenessServer(self.specs.values(), num_workers, shard=i,
                                                   deterministic=deterministic)) for i in range(num_shards)]
        self.channel = LocalChannel(self)
        self.clients = [PSClient(w, self.specs, self.channel, options, num_workers=num_workers)
                        for w in range(num_workers)]
        self.snapshot_every: int | None = None
        self.snapshots: list[tuple[int, float, dict[str, Any]]] = []
        self.sent: list[tuple[float, int]] = []
        self.observe: Callable[[], dict[str, Any]] | None = None
        self.t0 = time.perf_counter()

    def client(self, worker: int) -> PSClient:
        """Worker ``worker``'s client (``get``, ``inc``, ``clock``)."""
        return self.clients[worker]

    def push(self, host: _Host, only_news: bool, skip: int | None = None) -> None:
        for c in self.clients:
            if c.worker != skip and (not only_news or host.server.has_news(c.worker)):
                c.receive(host.server.deliver(c.worker))

    def on_advance(self, min_clock: int) -> None:
        if self.snapshot_every and min_clock % self.snapshot_every == 0:
            self.snapshots.append((min_clock, time.perf_counter() - self.t0, self._snapshot(locked=False)))

    def _snapshot(self, locked: bool) -> dict[str, Any]:
        tables = self.tables(locked)
        return tables if self.observe is None else {**tables, **self.observe()}

    def run(self, program: Program, clocks: int, *, snapshot_every: int | None = None,
            snapshot_every_s: float | None = None, observe: Callable[[], dict[str, Any]] | None = None
            ) -> RunResult:
        """Run ``program(client, worker, clock)`` then ``client.clock()``, ``clocks`` times per worker thread.

        ``snapshot_every=k`` copies the tables each time the min clock reaches a multiple of ``k``;
        ``snapshot_every_s=dt`` copies them every ``dt`` seconds of wall time as well (the server's model
        as a reader would find it then, between clocks included).  Each snapshot is ``(min clock, seconds
        since the run started, tables)``, sorted by time, for time-to-target curves.  ``observe()``, if
        given, adds to each snapshot the parts of the model that live in the workers, not in the server
        (e.g. LDA's per-document counts, which only their owner reads).
        """
        self.snapshot_every, self.snapshots, self.sent, self.t0 = snapshot_every, [], [], time.perf_counter()
        self.observe = observe
        results: list[list[Any]] = [[] for _ in range(self.num_workers)]
        errors: list[BaseException] = []
        threads = [threading.Thread(target=self._worker, args=(w, program, clocks, results[w], errors),
                                    name=f"orion_par-ps-worker-{w}") for w in range(self.num_workers)]
        done = threading.Event()
        monitor = (threading.Thread(target=self._monitor, args=(snapshot_every_s, done), name="orion_par-ps-monitor")
                   if snapshot_every_s else None)
        for t in threads:
            t.start()
        if monitor is not None:
            monitor.start()
        for t in threads:
            t.join()
        done.set()
        if monitor is not None:
            monitor.join()
        if errors:
            raise errors[0]
        elapsed = time.perf_counter() - self.t0
        snapshots = sorted(self.snapshots, key=lambda snap: snap[1])
        return RunResult(elapsed, [c.stats for c in self.clients], snapshots, results, self.sent)

    def _monitor(self, every_s: float, done: threading.Event) -> None:
        while not done.wait(every_s):
            with self.hosts[0].cond:  # shard 0's min clock and its advance snapshots stay in time order
                clock = self.hosts[0].server.min_clock
                now = time.perf_counter() - self.t0
                tables = self._snapshot(locked=True)
            self.sent.append((now, sum(c.stats.bytes_sent for c in self.clients)))
            self.snapshots.append((clock, now, tables))

    def _worker(self, w: int, program: Program, clocks: int, out: list[Any], errors: list[BaseException]) -> None:
        client = self.clients[w]
        bucket = client.bucket
        flusher = (BackgroundFlusher(client, bucket, client.options.flush_interval_s).start()
                   if client.options.policy is not None and bucket is not None else None)
        try:
            start = client.clock_now
            for c in range(start, start + clocks):
                out.append(program(client, w, c))
                client.clock()
            client.finish()
        except BaseException as e:
            errors.append(e)
            self._abort()
        finally:
            if flusher is not None:
                flusher.stop()

    def _abort(self) -> None:
        # A failed worker never ticks again; roll the others back so their blocked reads end.
        for host in self.hosts:
            with host.cond:
                host.server.generation += 1
                host.cond.notify_all()

    # -- tables and persistence -------------------------------------------------------------------
    def tables(self, locked: bool = True) -> dict[str, Any]:
        """A copy of every table (dense: an array; sparse: ``{row: {column: value}}``)."""
        return {name: self.table(name, locked) for name in self.specs}

    def initialize(self, name: str, values: Any) -> None:
        """Set a table's starting values (between runs); every shard keeps the rows it owns."""
        for host in self.hosts:
            with host.cond:
                host.server.load_table(name, values)

    def table(self, name: str, locked: bool = True) -> Any:
        """A copy of one table, merged over shards."""
        parts = []
        for host in self.hosts:
            if locked:
                with host.cond:
                    parts.append(host.server.table(name))
            else:
                parts.append(host.server.table(name))
        return merge_shards(self.specs[name], parts)

    def checkpoint(self) -> Checkpoint:
        """Every table at the current clock; call between runs (all workers at one clock)."""
        states = []
        for host in self.hosts:
            with host.cond:
                states.append(host.server.checkpoint())
        return Checkpoint(states[0].clock, states)

    def restore(self, ckpt: Checkpoint) -> None:
        """Tables, clocks and clients back to ``ckpt`` (caches and oplogs are dropped)."""
        for host, state in zip(self.hosts, ckpt.shards, strict=True):
            with host.cond:
                host.server.restore(state)
                host.cond.notify_all()
        for c in self.clients:
            c.reset(ckpt.clock, self.hosts[0].server.generation)


def merge_shards(spec: TableSpec, parts: Sequence[Any]) -> Any:
    """One table from its shards' copies: row ``r`` comes from shard ``r % len(parts)``."""
    n = len(parts)
    if spec.kind == "dense":
        out = np.array(parts[0], copy=True)
        for s in range(1, n):
            out[s::n] = parts[s][s::n]
        return out
    return {r: v for s, p in enumerate(parts) for r, v in p.items() if r % n == s}
