"""The Ray transport: each shard is an actor, each worker is an actor; the SSP logic is the same classes.

A worker actor holds a ``PSClient`` whose channel turns messages into actor calls.  A shard actor runs
one call at a time, so it must never block: a read that SSP does not admit returns ``None`` and the
client asks again after a short back-off (the time counts as blocked).  Server push rides on replies:
every tick reply is a delivery (fresh rows plus the new stamp), and with managed communication so is
every flush reply.  Calls from one worker to one shard are made one at a time and in order, which is the
FIFO channel the SSP argument needs.

Faults (deterministic mode): the driver runs the clocks in segments and checkpoints the shards between
segments.  If a worker actor dies, the driver restores every shard to the last checkpoint (which makes
the surviving workers' calls raise ``RolledBack``), starts a new actor for the dead worker, resets every
client to the checkpoint's clock and runs the segment again -- nothing is lost, and since updates of a
clock are applied in worker order only once every worker finished it, nothing is applied twice.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from orion_par.ps.bandwidth import BackgroundFlusher
from orion_par.ps.client import ClientOptions, PSClient
from orion_par.ps.local import Checkpoint, Program, RunResult, merge_shards
from orion_par.ps.oplog import Batch
from orion_par.ps.param_server import BoundedStalenessServer, Delivery, ShardState
from orion_par.ps.stats import WorkerStats
from orion_par.ps.tables import PSError, RolledBack, TableSpec, specs_by_name

_BACKOFF_S = (0.0002, 0.005)  # first and longest pause between two asks of an unadmitted read


def import_ray() -> Any:
    try:
        import ray
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ModuleNotFoundError("the Ray transport needs the ray package: pip install ray==2.60.0") from e
    return ray


def ensure_ray(num_cpus: int | None = None) -> bool:
    """Start a local Ray unless one is running; returns whether this call started it (then shut it down)."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    ray.init(num_cpus=num_cpus or min(2, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
    return True


class ShardImpl:
    """Body of a shard actor: a ``BoundedStalenessServer`` whose methods return deliveries."""

    def __init__(self, specs: list[TableSpec], num_workers: int, shard: int, deterministic: bool) -> None:
        self.server = BoundedStalenessServer(specs, num_workers, shard=shard, deterministic=deterministic)

    def inc(self, worker: int, generation: int, batches: Sequence[Batch], flush_seq: int, clock: int,
            push: bool) -> Delivery | None:
        self.server.check(worker, generation)
        for b in batches:
            self.server.inc(worker, b.table, b.rows, b.deltas, flush_seq=flush_seq, clock=clock)
        return self.server.deliver(worker) if push and self.server.has_news(worker) else None

    def tick(self, worker: int, generation: int) -> Delivery:
        self.server.check(worker, generation)
        self.server.tick(worker)
        return self.server.deliver(worker)

    def get(self, worker: int, generation: int, requests: Mapping[str, np.ndarray], clock: int) -> Delivery | None:
        self.server.check(worker, generation)
        return self.server.get(worker, requests, clock)

    def checkpoint(self) -> ShardState:
        return self.server.checkpoint()

    def restore(self, state: ShardState) -> int:
        self.server.restore(state)
        return self.server.generation

    def table(self, name: str) -> Any:
        return self.server.table(name)

    def load_table(self, name: str, values: Any) -> None:
        self.server.load_table(name, values)


class RayChannel:
    """Moves a client's messages to shard actors (one blocking call at a time per message)."""

    def __init__(self, shards: Sequence[Any]) -> None:
        self.shards = list(shards)
        self.num_shards = len(self.shards)
        self.ray = import_ray()

    def send_inc(self, client: PSClient, shard: int, batches: Sequence[Batch], flush_seq: int, clock: int) -> None:
        push = client.options.policy is not None
        ref = self.shards[shard].inc.remote(client.worker, client.generation, list(batches), flush_seq, clock, push)
        self._receive(client, self.ray.get(ref))

    def send_tick(self, client: PSClient, shard: int) -> None:
        self._receive(client, self.ray.get(self.shards[shard].tick.remote(client.worker, client.generation)))

    def fetch(self, client: PSClient, shard: int, requests: Mapping[str, np.ndarray]) -> None:
        pause = _BACKOFF_S[0]
        while True:
            ref = self.shards[shard].get.remote(client.worker, client.generation, dict(requests), client.clock_)
            delivery = self.ray.get(ref)
            if delivery is not None:
                client.receive(delivery)
                return
            time.sleep(pause)
            pause = min(2 * pause, _BACKOFF_S[1])

    @staticmethod
    def _receive(client: PSClient, delivery: Delivery | None) -> None:
        if delivery is not None:
            client.receive(delivery)


class WorkerImpl:
    """Body of a worker actor: a ``PSClient`` and the loop that runs the user's program clock by clock."""

    def __init__(self, worker: int, specs: list[TableSpec], shards: Sequence[Any], options: ClientOptions,
                 clock: int, generation: int) -> None:
        self.client = PSClient(worker, {s.name: s for s in specs}, RayChannel(shards), options, clock=clock,
                               generation=generation)

    def ping(self) -> int:
        return self.client.worker

    def reset(self, clock: int, generation: int) -> None:
        self.client.reset(clock, generation)

    def run(self, program: Program, start: int, stop: int) -> tuple[list[Any], WorkerStats]:
        client = self.client
        if client.clock_now != start:
            raise PSError(f"worker {client.worker} is at clock {client.clock_now}, asked to run from {start}.")
        bucket = client.bucket
        flusher = (BackgroundFlusher(client, bucket, client.options.flush_interval_s).start()
                   if client.options.policy is not None and bucket is not None else None)
        out = []
        try:
            for c in range(start, stop):
                out.append(program(client, client.worker, c))
                client.clock()
            client.finish()
        finally:
            if flusher is not None:
                flusher.stop()
        return out, client.stats


Fault = Callable[["RayPS", int], None]  # called after a segment starting at that clock is submitted


class RayPS:
    """The parameter server on Ray: ``num_shards`` shard actors and ``num_workers`` worker actors.

    Same constructor and ``run`` / ``table`` / ``checkpoint`` / ``restore`` as ``LocalPS``; starts a local
    Ray (2 CPUs, no dashboard) if none is running, and ``close()`` ends the actors and the Ray it started.
    ``run(..., checkpoint_every=k)`` checkpoints every ``k`` clocks and survives worker actors dying.
    """

    def __init__(self, tables: Iterable[TableSpec], num_workers: int, *, num_shards: int = 1,
                 options: ClientOptions | None = None, deterministic: bool = False) -> None:
        self.specs = specs_by_name(tables)
        if num_workers < 1 or num_shards < 1:
            raise PSError(f"RayPS: num_workers={num_workers} and num_shards={num_shards} must be >= 1.")
        self.ray = import_ray()
        self.started_ray = ensure_ray()
        options = options or ClientOptions()
        self.num_workers, self.options, self.deterministic = num_workers, options, deterministic
        spec_list = list(self.specs.values())
        shard_cls = self.ray.remote(num_cpus=0)(ShardImpl)
        self.shards = [shard_cls.remote(spec_list, num_workers, i, deterministic) for i in range(num_shards)]
        self.worker_cls = self.ray.remote(num_cpus=0, max_restarts=0)(WorkerImpl)
        self.generation = 0
        self.clock = 0
        self.workers = [self._new_worker(w) for w in range(num_workers)]
        self.restarts = 0

    def _new_worker(self, w: int) -> Any:
        return self.worker_cls.remote(w, list(self.specs.values()), self.shards, self.options, self.clock,
                                      self.generation)

    def run(self, program: Program, clocks: int, *, checkpoint_every: int | None = None,
            fault: Fault | None = None) -> RunResult:
        """Run ``clocks`` clocks of ``program(client, worker, clock)`` on every worker actor."""
        if checkpoint_every is not None and not self.deterministic:
            raise PSError("RayPS.run(checkpoint_every=...) needs deterministic=True: only then is a re-run "
                          "segment guaranteed to produce the same updates.")
        t0 = time.perf_counter()
        stop_all = self.clock + clocks
        ckpt = self.checkpoint() if checkpoint_every else None
        results: list[list[Any]] = [[] for _ in range(self.num_workers)]
        stats: list[WorkerStats] = []
        while self.clock < stop_all:
            stop = min(self.clock + (checkpoint_every or clocks), stop_all)
            refs = [w.run.remote(program, self.clock, stop) for w in self.workers]
            if fault is not None:
                fault(self, self.clock)
            try:
                done = self.ray.get(refs)
            except (self.ray.exceptions.RayActorError, RolledBack) as e:
                if ckpt is None:
                    raise PSError(f"a worker failed at clock {self.clock} and there is no checkpoint to resume "
                                  f"from; pass checkpoint_every (deterministic=True).") from e
                self._recover(ckpt, refs)
                continue
            for w, (out, _st) in enumerate(done):
                results[w].extend(out)
            stats = [st for _, st in done]
            self.clock = stop
            if checkpoint_every:
                ckpt = self.checkpoint()
        return RunResult(time.perf_counter() - t0, stats, [], results)

    def _recover(self, ckpt: Checkpoint, refs: list[Any]) -> None:
        self.restore(ckpt)  # survivors' next call raises RolledBack, so their run ends
        self.ray.wait(refs, num_returns=len(refs))
        for w, actor in enumerate(self.workers):
            try:
                self.ray.get(actor.ping.remote())
            except self.ray.exceptions.RayActorError:
                self.workers[w] = self._new_worker(w)
                self.restarts += 1
        self.ray.get([a.reset.remote(ckpt.clock, self.generation) for a in self.workers])

    def initialize(self, name: str, values: Any) -> None:
        """Set a table's starting values (between runs)."""
        self.ray.get([s.load_table.remote(name, values) for s in self.shards])

    def table(self, name: str) -> Any:
        """A copy of one table, merged over shards."""
        return merge_shards(self.specs[name], self.ray.get([s.table.remote(name) for s in self.shards]))

    def tables(self) -> dict[str, Any]:
        return {n: self.table(n) for n in self.specs}

    def checkpoint(self) -> Checkpoint:
        """Every table at the current clock (between runs or segments)."""
        states = self.ray.get([s.checkpoint.remote() for s in self.shards])
        return Checkpoint(states[0].clock, states)

    def restore(self, ckpt: Checkpoint) -> None:
        """Shards back to ``ckpt``; worker actors drop caches and oplogs and continue at its clock."""
        gens = self.ray.get([s.restore.remote(st) for s, st in zip(self.shards, ckpt.shards, strict=True)])
        self.generation, self.clock = gens[0], ckpt.clock
        alive = []
        for a in self.workers:
            try:
                self.ray.get(a.ping.remote())
                alive.append(a)
            except self.ray.exceptions.RayActorError:
                continue  # replaced by _recover
        self.ray.get([a.reset.remote(ckpt.clock, self.generation) for a in alive])

    def close(self) -> None:
        """End the actors, and Ray itself if this object started it."""
        for a in [*self.workers, *self.shards]:
            self.ray.kill(a)
        self.workers, self.shards = [], []
        if self.started_ray:
            self.ray.shutdown()
