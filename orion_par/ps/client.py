"""The worker side: cache stamped with clocks, oplog, read admission and flushing. No transport.

A ``PSClient`` talks to the shards through a ``Channel`` (in-process calls, or Ray actor calls) that only
moves messages; everything SSP decides is here and in ``param_server``.  A read returns

    cached server value  +  own increments sent but not yet acknowledged  +  own unsent increments (oplog)

so a worker always sees its own writes, and uses the cached value only while its stamp satisfies the
staleness bound (see ``param_server`` for the invariant).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from orion_par.ps.bandwidth import TokenBucket
from orion_par.ps.oplog import POLICIES, Batch, ConsumptionOrder, OpLog, pieces, priority_candidates, select
from orion_par.ps.param_server import Delivery
from orion_par.ps.stats import WorkerStats
from orion_par.ps.tables import (
    BadTableError,
    PSError,
    Stamps,
    Store,
    TableSpec,
    check_values,
    make_store,
    split_by_shard,
)


class Channel(Protocol):
    """How a client reaches the shards; deliveries come back through ``client.receive``."""

    num_shards: int

    def send_inc(self, client: PSClient, shard: int, batches: Sequence[Batch], flush_seq: int, clock: int
                 ) -> None: ...

    def send_tick(self, client: PSClient, shard: int) -> None: ...

    def fetch(self, client: PSClient, shard: int, requests: Mapping[str, np.ndarray]) -> None: ...


@dataclass(frozen=True)
class ClientOptions:
    """Knobs of one worker's client.

    bandwidth_bytes_per_s : float, optional
        Emulated link budget (``None``: unlimited).
    policy : {"magnitude", "absolute", "consumption", "random"}, optional
        Managed communication: spend spare budget between clocks on these rows first (``None``: plain
        SSP, everything waits for ``clock()``).
    burst_bytes : int, optional
        Token bucket depth (see ``TokenBucket``).
    flush_interval_s : float
        How often the managed-communication flusher looks for spare budget.
    async_send : bool
        ``clock()`` hands the oplog to a background sender (Bösen's communication thread) and returns at
        once; reads still wait for whatever the staleness bound needs.  Default: send before returning.
    resends_last : bool
        Managed communication: rows not yet sent early in this clock go before rows sent early already,
        whatever the policy's score (a row written again before the boundary must be sent then anyway, so
        resending it early spends link time without shrinking the boundary flush).  ``False``: the
        policy's score alone (Bösen's rule).
    ordered_boundary : bool
        Managed communication: the clock-boundary flush sends the oplog in the policy's order, in pieces
        of ``flush_interval_s`` of link time, so the first rows reach the server (and, pushed, the
        readers) before the whole burst has been carried.  ``False``: one message per shard.
    """

    bandwidth_bytes_per_s: float | None = None
    policy: str | None = None
    burst_bytes: int | None = None
    async_send: bool = False
    flush_interval_s: float = 0.002
    resends_last: bool = True
    ordered_boundary: bool = True

    def __post_init__(self) -> None:
        if self.policy is not None and self.policy not in POLICIES:
            raise PSError(f"ClientOptions(policy={self.policy!r}): use one of {POLICIES} or None (plain SSP).")
        if self.policy is not None and self.bandwidth_bytes_per_s is None:
            raise PSError(f"ClientOptions(policy={self.policy!r}) needs bandwidth_bytes_per_s: managed "
                          f"communication spends a bandwidth budget.")


class PSClient:
    """One worker's view of the parameter server: ``get``, ``inc``, ``clock``.

    Built by a transport (``LocalPS.client(w)``, or inside a Ray worker actor); see ``orion_par.ps``.
    ``num_workers`` is the job's current worker count (programs that split data by worker read it); the
    transport sets it, and updates it when an elastic job resizes.
    """

    def __init__(self, worker: int, specs: Mapping[str, TableSpec], channel: Channel,
                 options: ClientOptions | None = None, *, clock: int = 0, generation: int = 0,
                 num_workers: int | None = None) -> None:
        options = options or ClientOptions()
        self.worker, self.specs, self.channel, self.options = worker, dict(specs), channel, options
        self.num_workers = num_workers
        self.num_shards = channel.num_shards
        self.lock = threading.RLock()
        self.inbox_cond = threading.Condition()
        self.bucket = (TokenBucket(options.bandwidth_bytes_per_s, options.burst_bytes)
                       if options.bandwidth_bytes_per_s is not None else None)
        self.stats = WorkerStats(worker)
        self.order = ConsumptionOrder()
        self.reset(clock, generation)

    def reset(self, clock: int, generation: int) -> None:
        """Forget cache, oplog and in-flight state (after a restore); continue at ``clock``."""
        with self.lock, self.inbox_cond:
            self.clock_ = clock
            self.generation = generation
            self.cache: dict[str, Store] = {n: make_store(s) for n, s in self.specs.items()}
            self.stamps: dict[str, Stamps] = {n: Stamps(s) for n, s in self.specs.items()}
            self.pending: dict[str, Store] = {n: make_store(s) for n, s in self.specs.items()}
            self.oplog = OpLog(self.specs.values())
            self.inflight: list[deque[tuple[int, list[Batch]]]] = [deque() for _ in range(self.num_shards)]
            self.flush_seq = [0] * self.num_shards
            self.inbox: list[dict[int, Delivery]] = [{} for _ in range(self.num_shards)]
            self.next_seq = [1] * self.num_shards
            old: _Outbox | None = getattr(self, "outbox", None)
            if old is not None:
                old.close()
            self.outbox: _Outbox | None = _Outbox(self) if self.options.async_send else None

    @property
    def clock_now(self) -> int:
        """The clock this worker is in (updates made now are updates of this clock)."""
        return self.clock_

    def spec(self, table: str) -> TableSpec:
        if table not in self.specs:
            raise BadTableError(f"worker {self.worker}: no table named {table!r}; tables are {sorted(self.specs)}.")
        return self.specs[table]

    # -- reads ------------------------------------------------------------------------------------
    def get(self, table: str, rows: Any) -> Any:
        """Values of ``rows`` of ``table`` within the staleness bound (waits only when the cache is too old).

        Returns a ``(len(rows), width)`` array for dense tables, a list of ``{column: value}`` for sparse ones.
        """
        spec = self.spec(table)
        rows = spec.check_rows(rows)
        with self.lock:
            need = self.clock_ - spec.staleness if spec.staleness is not None else 0
            need = max(need, 0)  # a row must be cached at all (stamp >= 0) to be read
            self._drain()
            stale = rows[self.stamps[table].get(rows) < need]
            if stale.size:
                self._fetch(table, np.unique(stale), need)
            stamps = self.stamps[table].get(rows)
            self.stats.record_reads(stamps, self.clock_)
            if self.options.policy == "consumption":
                self.order.record(table, rows)
            return self._combine(spec, rows)

    def _fetch(self, table: str, rows: np.ndarray, need: int) -> None:
        t0 = time.perf_counter()
        self.stats.cache_misses += int(rows.size)
        for shard, pos in split_by_shard(rows, self.num_shards):
            self.stats.fetches += 1
            self.channel.fetch(self, shard, {table: rows[pos]})
        while np.any(self.stamps[table].get(rows) < need):  # replies may arrive behind earlier pushes
            self._drain(wait=True)
        self.stats.blocked_s += time.perf_counter() - t0

    def _combine(self, spec: TableSpec, rows: np.ndarray) -> Any:
        parts = [self.cache[spec.name].read(rows), self.pending[spec.name].read(rows), self.oplog.read(spec.name, rows)]
        if spec.kind == "dense":
            return parts[0] + parts[1] + parts[2]
        out = []
        for row_parts in zip(*parts, strict=True):
            merged: dict[int, float] = {}
            for p in row_parts:
                for c, x in p.items():
                    merged[c] = merged.get(c, 0.0) + x
            out.append({c: x for c, x in merged.items() if x != 0})
        return out

    # -- deliveries -------------------------------------------------------------------------------
    def receive(self, delivery: Delivery) -> None:
        """A shard's delivery (fetch reply or push); thread-safe, applied in order by the reader."""
        with self.inbox_cond:
            if delivery.generation == self.generation:
                self.inbox[delivery.shard][delivery.seq] = delivery
                self.inbox_cond.notify_all()

    def _drain(self, wait: bool = False) -> None:
        with self.inbox_cond:
            ready = self._pop_ready()
            if not ready and wait:
                self.inbox_cond.wait(0.05)
                ready = self._pop_ready()
        for d in ready:
            self._apply(d)

    def _pop_ready(self) -> list[Delivery]:
        ready = []
        for shard, box in enumerate(self.inbox):
            while self.next_seq[shard] in box:
                ready.append(box.pop(self.next_seq[shard]))
                self.next_seq[shard] += 1
        return ready

    def _apply(self, d: Delivery) -> None:
        self.stats.bytes_received += d.nbytes
        for table, (rows, values) in d.rows.items():
            self.cache[table].write(rows, values)
            self.stamps[table].set(rows, d.stamp)
        for table in self.specs:
            self.stamps[table].raise_cached(d.stamp, d.shard, self.num_shards)
        queue = self.inflight[d.shard]
        acked: list[Batch] = []
        while queue and queue[0][0] <= d.acked_flush:
            acked.extend(queue.popleft()[1])
        for b in acked:
            if queue:
                self.pending[b.table].add(b.rows, _negate(b.deltas))
            else:
                self.pending[b.table].zero(b.rows)  # nothing of this shard in flight: exactly zero, no residue

    # -- writes -----------------------------------------------------------------------------------
    def inc(self, table: str, rows: Any, deltas: Any) -> None:
        """Add ``deltas`` to ``rows``; coalesced in the oplog until ``clock()`` (or managed communication)."""
        spec = self.spec(table)
        rows = spec.check_rows(rows)
        deltas = check_values(spec, rows, deltas)
        with self.lock:
            self.oplog.add(table, rows, deltas)

    def clock(self) -> None:
        """End this worker's clock: send the whole oplog, then tell every shard."""
        with self.lock:
            if self.options.policy is not None and self.options.ordered_boundary and self.bucket is not None:
                cands = priority_candidates(self.oplog, self.cache, self.options.policy, self.order)
                piece = max(1, int(self.bucket.rate * self.options.flush_interval_s))
                for chosen in pieces(cands, piece):
                    self._send([self.oplog.take(t, rows) for t, rows in chosen], early=False)
            else:
                self._send(self.oplog.take_all(), early=False)
            self.oplog.next_clock()
            for shard in range(self.num_shards):
                if self.outbox is not None:
                    self.outbox.put(("tick", shard, None, 0, 0))
                else:
                    self.channel.send_tick(self, shard)
            self.clock_ += 1
            self.stats.clocks += 1
            self.order.next_clock()

    def has_dirty(self) -> bool:
        """Whether the oplog holds unsent updates."""
        return not self.oplog.empty()

    def sends_in_background(self) -> bool:
        """Whether messages leave through the background sender (``async_send``)."""
        return self.outbox is not None

    def link_idle(self) -> bool:
        """Whether nothing is waiting for the link (always true without a background sender)."""
        return self.outbox is None or self.outbox.idle()

    def flush_some(self, budget_bytes: int, prepaid: bool = False) -> int:
        """Managed communication: send the highest-priority dirty rows that fit in ``budget_bytes``.

        ``prepaid``: the caller pays the bandwidth budget for what is sent (it bought ``budget_bytes`` of
        link time and refunds the rest); otherwise each message pays on its way out, as every flush does.
        Returns the bytes sent.
        """
        policy = self.options.policy
        if policy is None:
            return 0
        with self.lock:
            if self.oplog.empty():
                return 0
            cands: dict[str, tuple[np.ndarray, ...]] = dict(priority_candidates(self.oplog, self.cache, policy,
                                                                                self.order))
            if self.options.resends_last:
                cands = {t: (*c, self.oplog.resent(t, c[0])) for t, c in cands.items()}
            chosen = select(cands, budget_bytes)
            batches = [self.oplog.take(t, rows, early=True) for t, rows in chosen]
            return self._send(batches, early=True, prepaid=prepaid)

    def _send(self, batches: list[Batch], early: bool, prepaid: bool = False) -> int:
        per_shard: list[list[Batch]] = [[] for _ in range(self.num_shards)]
        for b in batches:
            for shard, pos in split_by_shard(b.rows, self.num_shards):
                part = b if pos.size == b.rows.size else _subset(b, pos, self.specs[b.table])
                per_shard[shard].append(part)
        sent = 0
        for shard, parts in enumerate(per_shard):
            if not parts:
                continue
            nbytes = sum(p.nbytes for p in parts)
            self.flush_seq[shard] += 1
            self.inflight[shard].append((self.flush_seq[shard], parts))
            for p in parts:
                self.pending[p.table].add(p.rows, p.deltas)
            if self.outbox is not None:
                self.outbox.put(("inc" if not prepaid else "inc-prepaid", shard, parts, self.flush_seq[shard],
                                 self.clock_))
            else:
                self.transmit(shard, parts, self.flush_seq[shard], self.clock_, prepaid)
            sent += nbytes
            self.stats.messages_sent += 1
            if early:
                for p in parts:
                    self.stats.early_bytes_by_table[p.table] = self.stats.early_bytes_by_table.get(p.table, 0) + p.nbytes
        self.stats.bytes_sent += sent
        if early:
            self.stats.early_bytes += sent
        return sent


    def transmit(self, shard: int, parts: list[Batch], flush_seq: int, clock: int, prepaid: bool = False) -> None:
        """Spend the bandwidth budget on one message and hand it to the channel."""
        if self.bucket is not None and not prepaid:
            self.stats.throttled_s += self.bucket.take(sum(p.nbytes for p in parts))
        self.channel.send_inc(self, shard, parts, flush_seq, clock)

    def finish(self) -> None:
        """Wait until everything handed to the background sender has been sent."""
        if self.outbox is not None:
            self.outbox.join()


Message = tuple[str, int, Any, int, int]  # kind, shard, batches, flush_seq, clock


class _Outbox:
    """The background sender: messages leave in the order they were queued (the FIFO SSP relies on)."""

    def __init__(self, client: PSClient) -> None:
        self.client = client
        self.queue: deque[Message] = deque()
        self.cond = threading.Condition()
        self.busy = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="orion_par-ps-sender", daemon=True)
        self.thread.start()

    def put(self, msg: Message) -> None:
        with self.cond:
            if self.error is not None:
                raise self.error
            self.queue.append(msg)
            self.cond.notify_all()

    def idle(self) -> bool:
        with self.cond:
            return not self.queue and not self.busy

    def join(self) -> None:
        with self.cond:
            self.cond.wait_for(lambda: (not self.queue and not self.busy) or self.error is not None)
            if self.error is not None:
                raise self.error

    def close(self) -> None:
        """Drop what is queued (a restore made it obsolete) and end the thread."""
        with self.cond:
            self.queue.clear()
            self.queue.append(("stop", 0, None, 0, 0))
            self.cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: bool(self.queue))
                kind, shard, parts, seq, clock = self.queue.popleft()
                if kind == "stop":
                    return
                self.busy = True
            try:
                if kind.startswith("inc"):
                    self.client.transmit(shard, parts, seq, clock, prepaid=kind == "inc-prepaid")
                else:
                    self.client.channel.send_tick(self.client, shard)
            except BaseException as e:
                with self.cond:
                    self.error, self.busy = e, False
                    self.cond.notify_all()
                return
            with self.cond:
                self.busy = False
                self.cond.notify_all()


def _negate(deltas: Any) -> Any:
    if isinstance(deltas, np.ndarray):
        return -deltas
    return [{c: -x for c, x in d.items()} for d in deltas]


def _subset(b: Batch, pos: np.ndarray, spec: TableSpec) -> Batch:
    rows = b.rows[pos]
    deltas = b.deltas[pos] if isinstance(b.deltas, np.ndarray) else [b.deltas[i] for i in pos.tolist()]
    store = make_store(spec)
    store.add(rows, deltas)
    return Batch(b.table, rows, deltas, store.payload_bytes(rows))
