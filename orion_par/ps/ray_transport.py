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

Elastic runs (``run(..., elastic=Elastic(...))``): the clocks are cut into windows; after each window the
``Controller`` may ask for another worker count or for slots to be replaced, which happens at that clock
boundary: ``replace(w)`` starts a fresh actor in slot ``w`` (the shards forget its old view), ``resize(n)``
ends the highest slots or starts new ones at the current clock, and survivors keep their caches (the shards
keep pushing their cached rows).  ``Elastic(restart=True)`` does each transition by checkpoint-and-restart
instead (tables to disk, every actor and the Ray this object started stopped, all started again): the
baseline.  In deterministic mode both give the tables of a run with the same allocation sequence, faults
included.
"""

from __future__ import annotations

import copy
import numbers
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from orion_par.elastic.emulate import Emulation
from orion_par.elastic.policy import Controller, Decision, Elastic, ElasticError, ElasticLog, Window
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

    def resize(self, num_workers: int) -> None:
        self.server.resize(num_workers)

    def forget_worker(self, worker: int) -> None:
        self.server.forget_worker(worker)

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


Timing = list[tuple[float, float]]  # per clock: (work units, busy seconds including emulation padding)


def work_units(value: Any) -> float:
    """A program's work in one clock: its return value if that is a number (e.g. records), else 1."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return 1.0


class WorkerImpl:
    """Body of a worker actor: a ``PSClient`` and the loop that runs the user's program clock by clock.

    ``emulation`` and ``slowdown``: pad each clock's work to ``emulation``'s time for it, ``slowdown`` times.
    """

    def __init__(self, worker: int, specs: list[TableSpec], shards: Sequence[Any], options: ClientOptions,
                 clock: int, generation: int, num_workers: int | None = None, emulation: Emulation | None = None,
                 slowdown: float = 1.0) -> None:
        self.client = PSClient(worker, {s.name: s for s in specs}, RayChannel(shards), options, clock=clock,
                               generation=generation, num_workers=num_workers)
        self.emulation, self.slowdown = emulation, slowdown

    def ping(self) -> int:
        return self.client.worker

    def reset(self, clock: int, generation: int) -> None:
        self.client.reset(clock, generation)

    def set_num_workers(self, num_workers: int) -> None:
        self.client.num_workers = num_workers

    def emulate(self, emulation: Emulation | None, slowdown: float) -> None:
        self.emulation, self.slowdown = emulation, slowdown

    def run(self, program: Program, start: int, stop: int) -> tuple[list[Any], WorkerStats, Timing]:
        """Clocks ``start .. stop - 1``: the program's results, the client's stats, each clock's timing."""
        client = self.client
        if client.clock_now != start:
            raise PSError(f"worker {client.worker} is at clock {client.clock_now}, asked to run from {start}.")
        bucket = client.bucket
        flusher = (BackgroundFlusher(client, bucket, client.options.flush_interval_s).start()
                   if client.options.policy is not None and bucket is not None else None)
        out, timing = [], []
        try:
            for c in range(start, stop):
                t, blocked = time.perf_counter(), client.stats.blocked_s
                value = program(client, client.worker, c)
                units = work_units(value)
                # busy time: waiting for slower workers is not this worker's speed
                busy = time.perf_counter() - t - (client.stats.blocked_s - blocked)
                if self.emulation is not None:
                    busy += self.emulation.pad(units, busy, self.slowdown)
                out.append(value)
                timing.append((units, busy))
                client.clock()
            client.finish()
        finally:
            if flusher is not None:
                flusher.stop()
        return out, client.stats, timing


Fault = Callable[["RayPS", int], None]  # called with the RayPS and the current clock (see RayPS.run)


class RayPS:
    """The parameter server on Ray: ``num_shards`` shard actors and ``num_workers`` worker actors.

    Same constructor and ``run`` / ``table`` / ``checkpoint`` / ``restore`` as ``LocalPS``; starts a local
    Ray (2 CPUs, no dashboard) if none is running, and ``close()`` ends the actors and the Ray it started.
    ``run(..., checkpoint_every=k)`` checkpoints every ``k`` clocks and survives worker actors dying;
    ``run(..., elastic=Elastic(...))`` resizes and replaces workers at window boundaries (``resize``,
    ``replace``), and leaves its log in ``elastic_log`` (the latest elastic run's; ``RunResult`` unchanged).

    ``emulation``: every worker actor gets the next *start number* (0, 1, 2, ... over this object's life,
    replacements and additions included) and pads its work to ``emulation.slowdown(start number)`` times
    the emulated time (``orion_par.elastic.emulate``).
    """

    def __init__(self, tables: Iterable[TableSpec], num_workers: int, *, num_shards: int = 1,
                 options: ClientOptions | None = None, deterministic: bool = False,
                 emulation: Emulation | None = None) -> None:
        self.specs = specs_by_name(tables)
        if num_workers < 1 or num_shards < 1:
            raise PSError(f"RayPS: num_workers={num_workers} and num_shards={num_shards} must be >= 1.")
        self.ray = import_ray()
        self.started_ray = ensure_ray()
        options = options or ClientOptions()
        self.num_workers, self.num_shards = num_workers, num_shards
        self.options, self.deterministic, self.emulation = options, deterministic, emulation
        self.generation = 0
        self.clock = 0
        self.restarts = 0
        self.started = 0  # worker actors started so far: the next one's start number
        self.start_numbers: list[int] = []  # each slot's actor's start number
        self.elastic_log: ElasticLog | None = None
        self.ready: dict[int, tuple[Any, int]] = {}  # slot -> (actor started in the background, start number)
        self.pending: Decision | None = None  # the decision waiting for them
        self.pinged: list[Any] = []
        self.prestarted = 0.0
        self.spares: dict[int, tuple[Any, int]] = {}  # slot -> workers started for the policy's next count
        self.spare_t = self.run_t0 = 0.0
        self.spare_log: ElasticLog | None = None
        self._start_actors()

    def _start_actors(self) -> None:
        self.shard_cls = self.ray.remote(num_cpus=0)(ShardImpl)
        self.worker_cls = self.ray.remote(num_cpus=0, max_restarts=0)(WorkerImpl)
        spec_list = list(self.specs.values())
        self.shards = [self.shard_cls.remote(spec_list, self.num_workers, i, self.deterministic)
                       for i in range(self.num_shards)]
        self.workers: list[Any] = []
        self.start_numbers = []
        self.workers = [self._new_worker(w) for w in range(self.num_workers)]
        self._ready(self.workers)

    def _ready(self, actors: Sequence[Any]) -> None:
        """Wait until new actors run (so their start-up counts where they were started, not in a window)."""
        for actor in actors:
            try:
                self.ray.get(actor.ping.remote())
            except self.ray.exceptions.RayActorError:
                pass  # died already: the next segment fails and restarts it from the checkpoint

    def _new_worker(self, w: int, fresh: tuple[Any, int] | None = None) -> Any:
        """A worker actor for slot ``w``: ``fresh`` (an actor started in the background and its start number,
        brought to the current clock) or a new one."""
        actor, number = fresh if fresh is not None else self._start_worker(w)
        if w < len(self.start_numbers):
            self.start_numbers[w] = number
        else:
            self.start_numbers.append(number)
        if fresh is not None:
            self.ray.get([actor.reset.remote(self.clock, self.generation),
                          actor.set_num_workers.remote(self.num_workers)])
        return actor

    def _start_worker(self, w: int) -> tuple[Any, int]:
        number, self.started = self.started, self.started + 1
        slowdown = self.emulation.slowdown(number) if self.emulation is not None else 1.0
        return self.worker_cls.remote(w, list(self.specs.values()), self.shards, self.options, self.clock,
                                      self.generation, self.num_workers, self.emulation, slowdown), number

    # -- running ----------------------------------------------------------------------------------
    def run(self, program: Program, clocks: int, *, checkpoint_every: int | None = None,
            fault: Fault | None = None, elastic: Elastic | None = None,
            fault_in_transition: Fault | None = None) -> RunResult:
        """Run ``clocks`` clocks of ``program(client, worker, clock)`` on every worker actor.

        Parameters
        ----------
        checkpoint_every : int, optional
            Checkpoint every ``k`` clocks (and after every transition); a worker that dies is restarted
            and the clocks since the last checkpoint run again.  Needs ``deterministic=True``.
        fault : callable, optional
            ``fault(ps, clock)`` right after each segment (the clocks between two checkpoints or window
            ends) starting at ``clock`` is submitted: tests kill workers from it.
        elastic : Elastic, optional
            Cut the run into windows of ``elastic.window`` clocks and resize or replace workers between
            them as its policy and straggler rule decide; the windows and transitions are logged in
            ``self.elastic_log``.  ``results[w]`` then holds what slot ``w`` returned, in clock order, for
            the clocks the slot existed in.
        fault_in_transition : callable, optional
            ``fault(ps, clock)`` at the end of each transition, once the new actors are started.
        """
        if checkpoint_every is not None and not self.deterministic:
            raise PSError("RayPS.run(checkpoint_every=...) needs deterministic=True: only then is a re-run "
                          "segment guaranteed to produce the same updates.")
        if checkpoint_every is not None and checkpoint_every < 1:
            raise PSError(f"RayPS.run(checkpoint_every={checkpoint_every}): a segment is at least one clock.")
        controller = self._controller(elastic, fault_in_transition)
        t0 = self.run_t0 = time.perf_counter()
        stop_all = self.clock + clocks
        restarts_before = self.restarts
        ckpt = self.checkpoint() if checkpoint_every else None
        results: list[list[Any]] = [[] for _ in range(self.num_workers)]
        stats: list[WorkerStats] = []
        window = _WindowTally(0, self.clock, t0, self.num_workers)
        if controller is not None and elastic is not None:
            self._speculate(elastic, controller.log)
        while self.clock < stop_all:
            stop = min(self.clock + (checkpoint_every or clocks), stop_all)
            if elastic is not None:
                stop = min(stop, window.start_clock + elastic.window_for(window.workers))
            done = self._segment(program, stop, ckpt, fault)
            if done is None:
                continue  # recovered: run the segment again from the checkpoint
            for w, (out, _st, timing) in enumerate(done):
                results[w].extend(out)
                window.add(w, timing)
            stats = [st for _, st, _ in done]
            self.clock = stop
            if checkpoint_every:
                ckpt = self.checkpoint()
            if controller is None or elastic is None or self.clock not in (
                    window.start_clock + elastic.window_for(window.workers), stop_all):
                continue
            observed = window.close(time.perf_counter(), t0, elastic)
            if elastic.stop is not None and elastic.stop(observed):
                controller.log.windows.append(observed)
                controller.log.stopped = True
                break
            decision = self._decide(controller, observed, elastic, self.clock >= stop_all)
            if decision is not None:
                if elastic.restart and self.started_ray:  # what Ray handed out dies with it: keep copies
                    results, stats = copy.deepcopy(results), copy.deepcopy(stats)
                at = time.perf_counter()
                started = at - self.prestarted if self.ready else 0.0
                self._transition(decision, elastic.restart, fault_in_transition)
                if ckpt is not None:
                    ckpt = self.checkpoint()  # the one to recover from (and, after a restart, on the new Ray)
                controller.record(decision, observed, at - t0, time.perf_counter() - at, started)
                if decision.workers > observed.workers:
                    self._speculate(elastic, controller.log)
                results += [[] for _ in range(len(results), self.num_workers)]
            window = _WindowTally(observed.index + 1, self.clock, time.perf_counter(), self.num_workers)
        if controller is not None:
            controller.log.recoveries += self.restarts - restarts_before
        self._drop_ready()
        return RunResult(time.perf_counter() - t0, stats, [], results)

    def _decide(self, controller: Controller, window: Window, elastic: Elastic, final: bool) -> Decision | None:
        """The transition to make now, if any.  New actors (additions, replacements) start in the background
        first: the decision waits, the current workers going on window after window, until they are up."""
        if final:  # after the run's last window there is nothing to resize
            controller.log.windows.append(window)
            return None
        if self.pending is not None:
            controller.log.windows.append(window)
            done, _ = self.ray.wait(self.pinged, num_returns=len(self.pinged), timeout=0)
            if len(done) < len(self.pinged):
                return None
            ready, self.pending = self.pending, None
            return ready
        decision = controller.observe(window)
        next_count = getattr(elastic.policy, "next_count", None)
        if self.spares and (decision is not None and decision.workers <= self.num_workers
                            or next_count is not None and next_count(self.num_workers) is None):
            self._drop_spares(controller.log)  # the policy will not grow now
        if decision is None or elastic.restart or not elastic.background:
            return decision
        slots = [w for w in decision.replace if w < decision.workers] + list(range(self.num_workers, decision.workers))
        if not slots:
            return decision
        additions = [w for w in slots if w in self.spares]
        self.prestarted = self.spare_t if additions else time.perf_counter()
        self.ready = {w: self.spares.pop(w) if w in additions else self._start_worker(w) for w in slots}
        self._drop_spares(controller.log)
        self.pinged = [a.ping.remote() for a, _ in self.ready.values()]
        self.pending = decision
        return None

    def _speculate(self, elastic: Elastic, log: ElasticLog) -> None:
        """At the start and after growing, start the workers of the policy's next count (``Elastic.speculate``)."""
        next_count = getattr(elastic.policy, "next_count", None)
        nxt = next_count(self.num_workers) if next_count is not None and elastic.speculate else None
        if nxt is None or nxt <= self.num_workers or elastic.restart or not elastic.background:
            return
        self.spares = {w: self._start_worker(w) for w in range(self.num_workers, nxt)}
        self.spare_t = time.perf_counter()
        self.spare_log = log

    def _drop_spares(self, log: ElasticLog | None = None) -> None:
        if self.spares:
            now = time.perf_counter()
            log = log or self.spare_log
            if log is not None:
                log.spares.append((self.spare_t - self.run_t0, now - self.run_t0, len(self.spares)))
            for actor, _ in self.spares.values():
                self.ray.kill(actor)
            self.spares = {}

    def _drop_ready(self) -> None:
        self._drop_spares()
        for actor, _ in self.ready.values():
            self.ray.kill(actor)
        self.ready, self.pending, self.pinged = {}, None, []

    def _controller(self, elastic: Elastic | None, fault_in_transition: Fault | None) -> Controller | None:
        if elastic is None:
            if fault_in_transition is not None:
                raise PSError("RayPS.run(fault_in_transition=...) without elastic=...: there are no transitions.")
            return None
        if not isinstance(elastic, Elastic):
            raise ElasticError(f"RayPS.run(elastic={elastic!r}): pass an orion_par.elastic.Elastic.")
        if elastic.emulation is not None and elastic.emulation != self.emulation:
            if self.emulation is not None:
                raise ElasticError("RayPS(emulation=...) and Elastic(emulation=...) differ; give one of them.")
            self.emulation = elastic.emulation
            self.ray.get([a.emulate.remote(self.emulation, self.emulation.slowdown(n))
                          for a, n in zip(self.workers, self.start_numbers, strict=True)])
        controller = Controller(elastic)
        self.elastic_log = controller.log
        return controller

    def _segment(self, program: Program, stop: int, ckpt: Checkpoint | None, fault: Fault | None
                 ) -> list[tuple[list[Any], WorkerStats, Timing]] | None:
        """Run every worker to ``stop``; None if a worker failed and all went back to ``ckpt``."""
        refs = [w.run.remote(program, self.clock, stop) for w in self.workers]
        if fault is not None:
            fault(self, self.clock)
        try:
            done: list[tuple[list[Any], WorkerStats, Timing]] = self.ray.get(refs)
            return done
        except (self.ray.exceptions.RayActorError, RolledBack) as e:
            if ckpt is None:
                raise PSError(f"a worker failed at clock {self.clock} and there is no checkpoint to resume "
                              f"from; pass checkpoint_every (deterministic=True).") from e
            self._recover(ckpt, refs)
            return None

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

    # -- elastic transitions ----------------------------------------------------------------------
    def _transition(self, decision: Decision, restart: bool, fault: Fault | None) -> None:
        if restart:
            self._restart(decision.workers)
        else:
            for w in decision.replace:
                if w < decision.workers:  # a slot that leaves now needs no new actor
                    self.replace(w)
            if decision.workers != self.num_workers:
                self.resize(decision.workers)
        if fault is not None:
            fault(self, self.clock)

    def replace(self, worker: int) -> None:
        """A fresh actor (empty cache, the next start number) in slot ``worker``; at a clock boundary only."""
        if not 0 <= worker < self.num_workers:
            raise PSError(f"RayPS.replace({worker}): slots are 0..{self.num_workers - 1}.")
        self.ray.kill(self.workers[worker])
        self.ray.get([s.forget_worker.remote(worker) for s in self.shards])
        self.workers[worker] = self._new_worker(worker, self.ready.pop(worker, None))
        self._ready(self.workers[worker:worker + 1])

    def resize(self, num_workers: int) -> None:
        """Go on with ``num_workers`` workers from the current clock (between runs or segments).

        The highest slots leave (their actors finished their clocks and flushed, so they are ended); new
        slots get new actors at the current clock; every client's ``num_workers`` is updated.
        """
        if num_workers < 1:
            raise PSError(f"RayPS.resize({num_workers}): need at least one worker.")
        old = self.num_workers
        self.ray.get([s.resize.remote(num_workers) for s in self.shards])  # PSError unless at a clock boundary
        for actor in self.workers[num_workers:]:
            self.ray.kill(actor)
        del self.workers[num_workers:], self.start_numbers[num_workers:]
        self.num_workers = num_workers
        self.workers += [self._new_worker(w, self.ready.pop(w, None)) for w in range(old, num_workers)]
        for actor in self.workers[:min(old, num_workers)]:
            try:
                self.ray.get(actor.set_num_workers.remote(num_workers))
            except self.ray.exceptions.RayActorError:
                pass  # died: the next segment fails and restarts it from the checkpoint with the new count
        self._ready(self.workers[old:])

    def _restart(self, num_workers: int) -> None:
        """Checkpoint-and-restart: tables to disk, every actor (and the Ray we started) stopped, all anew."""
        ckpt = self.checkpoint()
        fd, path = tempfile.mkstemp(prefix="orion_par-ps-", suffix=".npz")
        os.close(fd)
        try:
            tables = [merge_shards(spec, [st.tables[name] for st in ckpt.shards]) for name, spec in self.specs.items()]
            np.savez(path, *[v if isinstance(v, np.ndarray) else np.array(v, dtype=object) for v in tables])
            clock = ckpt.clock
            del ckpt, tables
            self.close()
            if self.started_ray:
                ensure_ray()
            self.num_workers, self.clock = num_workers, clock
            self.shard_cls = self.ray.remote(num_cpus=0)(ShardImpl)
            spec_list = list(self.specs.values())
            self.shards = [self.shard_cls.remote(spec_list, num_workers, i, self.deterministic)
                           for i in range(self.num_shards)]
            with np.load(path, allow_pickle=True) as saved:  # our own file: sparse tables are pickled dicts
                loaded = {name: np.array(saved[f"arr_{i}"]) if spec.kind == "dense" else saved[f"arr_{i}"].item()
                          for i, (name, spec) in enumerate(self.specs.items())}
            state = ShardState(clock, loaded)
            self.generation = self.ray.get([s.restore.remote(state) for s in self.shards])[0]
            self.worker_cls = self.ray.remote(num_cpus=0, max_restarts=0)(WorkerImpl)
            self.start_numbers = []
            self.workers = [self._new_worker(w) for w in range(num_workers)]
            self._ready(self.workers)
        finally:
            os.remove(path)

    # -- tables -----------------------------------------------------------------------------------
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
        self._drop_ready()
        for a in [*self.workers, *self.shards]:
            self.ray.kill(a)
        self.workers, self.shards = [], []
        if self.started_ray:
            self.ray.shutdown()


class _WindowTally:
    """One window's work and busy seconds per worker slot, as its segments finish."""

    def __init__(self, index: int, start_clock: int, t: float, workers: int) -> None:
        self.index, self.start_clock, self.t, self.workers = index, start_clock, t, workers
        self.units = [0.0] * workers
        self.seconds = [0.0] * workers

    def add(self, worker: int, timing: Timing) -> None:
        for units, seconds in timing:
            self.units[worker] += units
            self.seconds[worker] += seconds

    def close(self, now: float, t0: float, elastic: Elastic) -> Window:
        rates = tuple(u / s if s > 0 else 0.0 for u, s in zip(self.units, self.seconds, strict=True))
        progress = elastic.progress() if elastic.progress is not None else None
        return Window(self.index, self.t - t0, now - self.t, self.workers, sum(self.units), rates, progress)
