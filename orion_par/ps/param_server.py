"""The server side of Stale Synchronous Parallel: clock table, read admission, row delivery. No transport.

The SSP invariant
-----------------
Worker ``w`` starts at clock 0; every ``clock()`` moves it to the next clock.  An *update of clock c* is an
``inc`` a worker issues while at clock ``c``.  With staleness ``s`` (per table):

    a worker at clock ``c`` that reads a row gets a value that includes every update of every worker
    (itself included) made at a clock ``< c - s`` -- i.e. up to clock ``c - s - 1`` -- plus possibly newer
    ones; and it always includes the reader's own earlier updates (read-my-writes).

``s = 0`` is Bulk Synchronous Parallel (a read at clock c sees all of clock c - 1); ``s = None`` is
asynchronous (no bound).  How this module keeps it: a worker sends all its updates of clock ``c`` to every
shard *before* its tick for clock ``c``, over a FIFO channel, so when a shard's minimum clock (over all
workers) is ``m``, the shard has applied every update of every clock ``< m``.  Every value a shard sends
is stamped with ``m``; a client serves a read at clock ``c`` from its cache only if the row's stamp is
``>= c - s``, and otherwise the shard answers only once ``m >= c - s`` (``get`` returns ``None`` until
then).  Reads never wait on the clock ``c`` updates of others, so fast workers run ``s`` clocks ahead.

A *delivery* carries fresh values for the rows a worker asked for plus every row it has cached that
changed since its last delivery (server push), so its stamp vouches for the whole cached set.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from orion_par.ps.tables import PSError, RolledBack, RowSet, Store, TableSpec, make_store, specs_by_name


def ssp_admits(stamp: int, clock: int, staleness: int | None) -> bool:
    """Whether a value stamped ``stamp`` may be read by a worker at ``clock`` under staleness ``s``.

    Examples
    --------
    >>> ssp_admits(stamp=3, clock=5, staleness=2), ssp_admits(stamp=2, clock=5, staleness=2)
    (True, False)
    >>> ssp_admits(stamp=0, clock=100, staleness=None)   # ASP never waits
    True
    """
    return staleness is None or stamp >= clock - staleness


class ClockTable:
    """Each worker's clock as this shard knows it (the number of ticks received), and their minimum.

    Examples
    --------
    >>> ct = ClockTable(2)
    >>> ct.tick(0), ct.min_clock
    (False, 0)
    >>> ct.tick(1), ct.min_clock
    (True, 1)
    """

    def __init__(self, num_workers: int, start: int = 0) -> None:
        if num_workers < 1:
            raise PSError(f"ClockTable: num_workers={num_workers} must be >= 1.")
        self.clocks = [start] * num_workers
        self.min_clock = start

    def tick(self, worker: int) -> bool:
        """Advance ``worker``; returns whether the minimum clock advanced."""
        self.clocks[worker] += 1
        new_min = min(self.clocks)
        advanced = new_min > self.min_clock
        self.min_clock = new_min
        return advanced


@dataclass(frozen=True)
class Delivery:
    """Rows sent by one shard to one worker.

    ``stamp`` is the shard's min clock when it was made: the values include every update of a clock
    ``< stamp``, and the rows the worker has cached but that are not in ``rows`` are unchanged since the
    previous delivery.  ``acked_flush`` is the last of this worker's flushes that the values include.
    Deliveries to a worker are numbered ``seq = 1, 2, ...`` per shard and must be applied in that order.
    """

    shard: int
    seq: int
    stamp: int
    acked_flush: int
    rows: dict[str, tuple[np.ndarray, Any]]
    nbytes: int
    generation: int = 0


@dataclass
class ShardState:
    """A checkpoint of one shard: table contents at ``clock`` (every update of clocks < clock)."""

    clock: int
    tables: dict[str, Any]


@dataclass
class _Deferred:
    worker: int
    flush_seq: int
    table: str
    rows: np.ndarray
    deltas: Any


@dataclass
class _WorkerView:
    subscribed: dict[str, RowSet]
    changed: dict[str, RowSet]
    seq: int = 0
    acked_flush: int = 0


class BoundedStalenessServer:
    """One shard of the parameter server: the rows it owns and the SSP bookkeeping.

    Parameters
    ----------
    tables : iterable of TableSpec
    num_workers : int
    shard : int
        This shard's number (rows ``r`` with ``r % num_shards == shard`` are sent here).
    deterministic : bool
        Apply each clock's updates only when every worker has finished that clock, in worker order, so
        that a run gives bit-identical tables whatever the timing (used for fault recovery).

    Examples
    --------
    >>> import numpy as np
    >>> srv = BoundedStalenessServer([TableSpec("t", 2, 1, staleness=0)], num_workers=2)
    >>> srv.inc(0, "t", np.array([1]), np.array([[5.0]]), flush_seq=1)
    >>> srv.get(1, {"t": np.array([1])}, clock=1) is None   # BSP: worker 0 has not finished clock 0
    True
    >>> srv.tick(0), srv.tick(1)
    (False, True)
    >>> d = srv.get(1, {"t": np.array([1])}, clock=1)
    >>> d.stamp, d.rows["t"][1].tolist()
    (1, [[5.0]])
    """

    def __init__(self, tables: Iterable[TableSpec], num_workers: int, *, shard: int = 0,
                 deterministic: bool = False) -> None:
        self.specs = specs_by_name(tables)
        self.num_workers = num_workers
        self.shard = shard
        self.deterministic = deterministic
        self.generation = 0
        self.stores: dict[str, Store] = {n: make_store(s) for n, s in self.specs.items()}
        self._reset(0)

    def _reset(self, clock: int) -> None:
        self.clocks = ClockTable(self.num_workers, clock)
        self.views = [self._fresh_view() for _ in range(self.num_workers)]
        self.deferred: dict[int, list[_Deferred]] = {}
        self.applied_updates = 0

    def _fresh_view(self) -> _WorkerView:
        return _WorkerView({n: RowSet(s) for n, s in self.specs.items()},
                           {n: RowSet(s) for n, s in self.specs.items()})

    @property
    def min_clock(self) -> int:
        return self.clocks.min_clock

    def check(self, worker: int, generation: int) -> None:
        """``RolledBack`` if the worker runs in a generation before the last restore."""
        if generation != self.generation:
            raise RolledBack(f"shard {self.shard}: worker {worker} runs generation {generation} but the server was "
                             f"restored (generation {self.generation}); restart it from the checkpoint.")

    # -- updates ----------------------------------------------------------------------------------
    def inc(self, worker: int, table: str, rows: np.ndarray, deltas: Any, *, flush_seq: int,
            clock: int | None = None) -> None:
        """Apply (or, in deterministic mode, queue for ``clock``) one coalesced batch from ``worker``."""
        if self.deterministic:
            if clock is None:
                raise PSError("deterministic server: inc needs the clock the updates belong to.")
            self.deferred.setdefault(clock, []).append(_Deferred(worker, flush_seq, table, rows, deltas))
            return
        self._apply(worker, flush_seq, table, rows, deltas)

    def _apply(self, worker: int, flush_seq: int, table: str, rows: np.ndarray, deltas: Any) -> None:
        self.stores[table].add(rows, deltas)
        self.applied_updates += int(rows.size)
        view = self.views[worker]
        view.acked_flush = max(view.acked_flush, flush_seq)
        for v in self.views:
            v.changed[table].add(rows)

    def tick(self, worker: int) -> bool:
        """``worker`` finished its clock; returns whether the shard's min clock advanced."""
        before = self.clocks.min_clock
        advanced = self.clocks.tick(worker)
        if advanced and self.deterministic:
            for c in range(before, self.clocks.min_clock):
                for d in sorted(self.deferred.pop(c, []), key=lambda d: (d.worker, d.flush_seq)):
                    self._apply(d.worker, d.flush_seq, d.table, d.rows, d.deltas)
        return advanced

    # -- reads ------------------------------------------------------------------------------------
    def admits(self, tables: Iterable[str], clock: int) -> bool:
        """Whether a worker at ``clock`` may read rows of ``tables`` now."""
        return all(ssp_admits(self.min_clock, clock, self.specs[t].staleness) for t in tables)

    def get(self, worker: int, requests: Mapping[str, np.ndarray], clock: int) -> Delivery | None:
        """The requested rows (and every changed cached row), or ``None`` while SSP says wait."""
        if not self.admits(requests, clock):
            return None
        view = self.views[worker]
        for table, rows in requests.items():
            view.subscribed[table].add(rows)
            view.changed[table].add(rows)
        return self.deliver(worker)

    def deliver(self, worker: int) -> Delivery:
        """Server push: every row ``worker`` has cached that changed since its last delivery."""
        view = self.views[worker]
        out: dict[str, tuple[np.ndarray, Any]] = {}
        nbytes = 0
        for table, store in self.stores.items():
            rows = view.changed[table].intersection(view.subscribed[table])
            view.changed[table].clear()
            if rows.size:
                out[table] = (rows, store.read(rows))
                nbytes += store.payload_bytes(rows)
        view.seq += 1
        return Delivery(self.shard, view.seq, self.min_clock, view.acked_flush, out, nbytes, self.generation)

    def has_news(self, worker: int) -> bool:
        """Whether a push to ``worker`` would carry any row."""
        view = self.views[worker]
        return any(view.changed[t].intersects(view.subscribed[t]) for t in self.stores)

    # -- membership -------------------------------------------------------------------------------
    def boundary(self, what: str) -> int:
        """The clock every worker is at, or ``PSError`` saying ``what`` must wait for a clock boundary."""
        clocks = self.clocks.clocks
        if len(set(clocks)) != 1 or any(self.deferred.values()):
            raise PSError(f"shard {self.shard}: {what} needs every worker at the same clock with nothing "
                          f"queued; worker clocks are {clocks}. Call it between clocks, when all workers wait.")
        return clocks[0]

    def resize(self, num_workers: int) -> None:
        """Serve ``num_workers`` workers from the current clock on (at a clock boundary only).

        Workers ``< num_workers`` keep their view (their cached rows keep being pushed, so a surviving
        client never serves a stale row); new ids start with an empty view; the highest ids leave.

        Examples
        --------
        >>> srv = BoundedStalenessServer([TableSpec("t", 2, 1)], num_workers=1)
        >>> srv.tick(0), srv.resize(3), srv.clocks.clocks
        (True, None, [1, 1, 1])
        """
        if num_workers < 1:
            raise PSError(f"shard {self.shard}: resize to num_workers={num_workers}; need >= 1.")
        clock = self.boundary("resize")
        self.views = self.views[:num_workers] + [self._fresh_view() for _ in range(len(self.views), num_workers)]
        self.num_workers = num_workers
        self.clocks = ClockTable(num_workers, clock)

    def forget_worker(self, worker: int) -> None:
        """Slot ``worker`` gets a new client (empty cache, deliveries numbered from 1): start its view afresh."""
        if not 0 <= worker < self.num_workers:
            raise PSError(f"shard {self.shard}: no worker {worker} to forget; workers are 0..{self.num_workers - 1}.")
        self.boundary("forget_worker")
        self.views[worker] = self._fresh_view()

    # -- persistence ------------------------------------------------------------------------------
    def checkpoint(self) -> ShardState:
        """Snapshot the tables; only when every worker is at the same clock and nothing is queued."""
        return ShardState(self.boundary("checkpoint"), {n: s.snapshot() for n, s in self.stores.items()})

    def restore(self, state: ShardState) -> None:
        """Load ``state``; every worker is back at ``state.clock`` and must drop its cache and oplog."""
        for name, store in self.stores.items():
            store.load(state.tables[name])
        self.generation += 1
        self._reset(state.clock)

    def load_table(self, name: str, values: Any) -> None:
        """Replace a table's contents (before workers start): a full dense array, or ``{row: {col: value}}``."""
        store = self.stores[name]
        if store.spec.kind == "dense" and np.shape(values) != (store.spec.num_rows, store.spec.width):
            raise PSError(f"table {name!r}: initial values must have shape ({store.spec.num_rows}, "
                          f"{store.spec.width}); got {np.shape(values)}.")
        store.load(values)

    def table(self, name: str) -> Any:
        """A copy of one table's contents (dense: an array; sparse: ``{row: {column: value}}``)."""
        return self.stores[name].snapshot()


@dataclass
class ShardGroup:
    """All shards of a server in one process (the local transport, and tests of the pure logic)."""

    shards: list[BoundedStalenessServer] = field(default_factory=list)

    @classmethod
    def create(cls, tables: Iterable[TableSpec], num_workers: int, num_shards: int, deterministic: bool = False
               ) -> ShardGroup:
        specs = list(tables)
        return cls([BoundedStalenessServer(specs, num_workers, shard=i, deterministic=deterministic)
                    for i in range(num_shards)])
