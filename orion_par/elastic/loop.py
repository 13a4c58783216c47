"""``parallel_for`` on Ray, elastic: add, remove and replace actors at window boundaries without a restart.

The run is a sequence of *segments*: a schedule over a set of records, run on the current actors.  A
segment is cut into windows of ``Elastic.window`` schedule steps (wavefront schedules: whole epochs).  At
the end of every window the driver gathers the elements each actor wrote since the window began (the
newest stamp wins, as at the end of a plain Ray run) and, with the accumulators' partial values, keeps
them as the *checkpoint*.  Then the controller may decide a transition: leaving actors are killed, new
ones started, a straggler's actor replaced, and every actor loads the segment's records and the
checkpoint's arrays.  A new count mid-epoch makes the records of the segment's remaining steps a new
segment, partitioned afresh for that count (a whole-epoch schedule restricted to them would leave its
steps unbalanced: their blocks were half done by the old count); with background starts the partitioning
is computed during the window before the transition, while the actors work.  A replacement keeps the
segment.  The next epoch starts a whole-epoch segment for the current count.

So the result is exactly the serial run of the executed segments' tasks, one after another
(``ElasticRun.serial_order()``), and a transition that changes nothing changes no value.  An actor
that dies (during a window or a transition) is replaced and the run continues from the checkpoint: the
windows are deterministic given their segment, so nothing is lost or applied twice.  Accumulators are
combined per segment in worker order, then over the epoch's segments in order.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from orion_par.accumulate import combine
from orion_par.codegen import CompiledBody
from orion_par.distarray import identity
from orion_par.elastic.policy import Controller, Decision, Elastic, ElasticError, ElasticLog, Window
from orion_par.local import BlockData
from orion_par.plan import Plan
from orion_par.ray_backend import BlockWorker, Changes, _import_ray, newest
from orion_par.schedule import Schedule

_MAX_RECOVERIES = 5  # consecutive failed attempts at one window or transition before giving up
_START_TIMEOUT_S = 300.0  # actors that cannot be placed (no free CPU) would otherwise be waited for forever


@dataclass
class Segment:
    """A schedule over ``records`` (indices into the dataset, data order), for epoch ``epoch``."""

    epoch: int
    sched: Schedule
    records: np.ndarray
    last_step: int = 0  # steps run so far (a transition may end a segment early)
    whole: bool = True  # the epoch's whole schedule for its count (else: the epoch's rest, partitioned for it)

    @cached_property
    def step_sizes(self) -> np.ndarray:
        """Records per schedule step (a partition of few records may leave steps empty)."""
        sizes = self.sched.block_stop - self.sched.block_start
        out = np.zeros(self.sched.num_steps, np.int64)
        for t in self.sched.tasks:
            out[t.step] += sizes[t.block]
        return out

    def next_work(self, step: int) -> int:
        """The first step at or after ``step`` with records (``num_steps`` if none)."""
        busy = np.flatnonzero(self.step_sizes[step:])
        return step + int(busy[0]) if busy.size else self.sched.num_steps

    @property
    def block_order(self) -> np.ndarray:
        out: np.ndarray = self.records[self.sched.perm]
        return out

    def steps_records(self, start: int, stop: int) -> np.ndarray:
        """Dataset indices of the tasks at steps ``start`` to ``stop - 1``, in serial (task) order."""
        parts = [self.records[self.sched.block_records(t.block)] for t in self.sched.tasks if start <= t.step < stop]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)


@dataclass
class ElasticRun(ElasticLog):
    """The log of an elastic ``parallel_for`` run, with the serial order its result equals."""

    segments: list[Segment] = field(default_factory=list)

    def serial_order(self) -> np.ndarray:
        """Dataset indices in the order of the serial run that the elastic run's arrays equal."""
        parts = [s.steps_records(0, s.last_step) for s in self.segments]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def allocations(self) -> list[tuple[int, int, int]]:
        """(epoch, workers, records) per executed segment."""
        return [(s.epoch, s.sched.num_workers, int(s.steps_records(0, s.last_step).size))
                for s in self.segments]


@dataclass
class _Checkpoint:
    params: dict[str, np.ndarray]  # written arrays as of the end of the last window
    partials: list[dict[str, np.ndarray]]  # accumulators' per-slot partial values in the current segment
    step: int  # next step of the current segment
    serial: int  # stamps of later tasks are larger


class ElasticDriver:
    """Runs ``epochs`` epochs elastically; see the module doc.  One instance per run."""

    def __init__(self, compiled: CompiledBody, data: BlockData, plan: Plan,
                 make: Callable[[int, np.ndarray | None], Schedule],
                 keys: np.ndarray, values: np.ndarray, elastic: Elastic, seed: int | None) -> None:
        self.ray = _import_ray()
        self.compiled, self.data, self.plan, self.make = compiled, data, plan, make
        self.keys, self.values, self.elastic, self.seed, self.hook = keys, values, elastic, seed, elastic.fault
        self.accs = {n: op for n, op in plan.accumulators.items() if n in data.params}
        self.written = tuple(n for n in plan.written if n in data.params and n not in plan.accumulators)
        self.spec = dict(name=compiled.name, source=compiled.source, param_names=compiled.param_names,
                         injected=compiled.injected, boundscheck=compiled.boundscheck,
                         python_reason="" if compiled.compiled else compiled.fallback_reason, written=self.written,
                         traveling=tuple(n for n in self.written if n not in plan.space_arrays), seed=seed,
                         emulation=elastic.emulation)
        self.actors: list[Any] = []
        self.started = 0  # actors started so far: the next one's start number
        self.log = ElasticRun()
        self.busy: list[float] = []
        self.t0 = time.perf_counter()
        self.started_ray = False
        self.actor_cls: Any = None
        self.cap = 1
        self.tokens: dict[int, Any] = {}
        self.whole_refs: dict[int, tuple[Any, Any]] = {}
        self.everything = np.zeros(0, np.int64)
        self.ready: dict[int, Any] = {}  # slot -> actor started in the background for the pending decision
        self.pinged: list[Any] = []
        self.pending: Decision | None = None
        self.prestarted = 0.0
        self.spares: dict[int, Any] = {}  # slot -> actor started for the policy's next count (``_speculate``)
        self.spare_t = 0.0
        self.epochs_started = 0
        self.prepare: int | None = None  # a worker count whose whole-epoch schedule to compute ahead
        self.rest_for: int | None = None  # a count to partition the epoch's rest for, during the next window
        self.rest: tuple[Segment, int, Segment] | None = None  # (segment, step, its rest for rest_for)

    # -- actors -----------------------------------------------------------------------------------
    def _init_ray(self, cap: int) -> None:
        if not self.ray.is_initialized():
            # Room for the actors started in the background beside the running ones (additions, replacements).
            self.ray.init(num_cpus=max(2 * cap, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False,
                          configure_logging=False)
            self.started_ray = True
        self.actor_cls = self.ray.remote(num_cpus=1, max_restarts=0)(BlockWorker)

    def _new_actor(self, slot: int, refs: tuple[Any, Any, Any]) -> Any:
        slowdown = self.elastic.emulation.slowdown(self.started) if self.elastic.emulation else 1.0
        self.started += 1
        return self.actor_cls.remote(self.spec, refs[0], refs[1], refs[2], slot, slowdown)

    def _free_cpus(self) -> int:
        return int(float(self.ray.available_resources().get("CPU", 0.0)))

    def capacity(self) -> int:
        """Actors the cluster has CPUs for, one CPU each (its total: a killed actor frees its CPU only later)."""
        if self.started_ray:  # the Ray this run started has twice the CPUs it needs, for background starts
            return self.cap
        return int(float(self.ray.cluster_resources().get("CPU", 1.0)))

    def _alive(self, actor: Any) -> bool:
        try:
            self.ray.get(actor.ping.remote())
            return True
        except self.ray.exceptions.RayActorError:
            return False

    def _records(self, seg: Segment) -> tuple[Any, Any]:
        """Object refs of ``seg``'s keys and values in block order (a whole epoch's are kept per count)."""
        whole = seg.whole
        key = seg.sched.num_workers
        if whole and key in self.whole_refs:
            return self.whole_refs[key]
        refs = (self.ray.put(self.keys[seg.block_order]), self.ray.put(self.values[seg.block_order]))
        if whole:
            self.whole_refs[key] = refs
        return refs

    def _establish(self, seg: Segment, ckpt: _Checkpoint, workers: int, replace: Sequence[int] = (),
                   fresh: dict[int, Any] | None = None) -> None:
        """Exactly ``workers`` live actors, each holding ``seg``'s records and the checkpoint's state.

        Slots in ``replace`` get new actors: ``fresh``'s (started in the background) where given; so do new
        slots.  A dead actor is found when its load fails, and replaced on the next attempt.
        """
        fresh = dict(fresh or {})
        try:
            for attempt in range(_MAX_RECOVERIES + 1):
                try:
                    keys, values = self._records(seg)
                    params = self.ray.put({**self.data.params, **ckpt.params})
                    for a in self.actors[workers:]:
                        self.ray.kill(a)
                    del self.actors[workers:]
                    for slot in range(workers):
                        dead = attempt > 0 and slot < len(self.actors) and not self._alive(self.actors[slot])
                        if slot < len(self.actors) and (slot in fresh or slot in replace or dead):
                            self.ray.kill(self.actors[slot])
                            self.actors[slot] = fresh.pop(slot, None) or self._new_actor(slot, (keys, values, params))
                        elif slot >= len(self.actors):
                            self.actors.append(fresh.pop(slot, None) or self._new_actor(slot, (keys, values, params)))
                    replace = ()
                    if self.hook is not None:
                        self.hook("transition", len(self.log.windows), self.actors)
                    partials = ckpt.partials if self.accs else [{} for _ in self.actors]
                    loads = [a.load.remote(keys, values, params, slot, p)
                             for slot, (a, p) in enumerate(zip(self.actors, partials, strict=True))]
                    try:
                        self.ray.get(loads, timeout=_START_TIMEOUT_S)
                    except self.ray.exceptions.GetTimeoutError as e:
                        raise ElasticError(
                            f"elastic run: {workers} actors did not start within {_START_TIMEOUT_S:.0f} s; the Ray "
                            f"cluster has {self.ray.cluster_resources().get('CPU', 0)} CPUs and each actor takes one: "
                            f"start Ray with more (ray.init(num_cpus=...)) or lower the policy's max_workers.") from e
                    self.tokens = {}
                    return
                except self.ray.exceptions.RayActorError:
                    if attempt == _MAX_RECOVERIES:
                        raise
                    self.log.recoveries += 1
        finally:
            for a in fresh.values():  # started for slots that went away meanwhile
                self.ray.kill(a)

    def _prestart(self, decision: Decision, seg: Segment) -> None:
        """Start the actors ``decision`` needs in the background, while the current ones keep working (taking
        the spares ``_speculate`` started where it can)."""
        keys, values = self._records(seg)
        refs = (keys, values, self.ray.put(self.data.params))
        slots = [*decision.replace, *range(len(self.actors), decision.workers)]
        additions = [s for s in slots if s >= len(self.actors) and s in self.spares]
        self.prestarted = self.spare_t if additions else time.perf_counter()
        self.ready = {slot: self.spares.pop(slot) if slot in additions else self._new_actor(slot, refs)
                      for slot in slots}
        self._drop_spares()
        self.pinged = [a.ping.remote() for a in self.ready.values()]
        self.prepare = decision.workers

    def _speculate(self, seg: Segment) -> None:
        """At the start and after growing, start the actors of the policy's next count, so that trying it costs
        no start-up."""
        next_count = getattr(self.elastic.policy, "next_count", None)
        nxt = next_count(len(self.actors)) if next_count is not None and self.elastic.speculate else None
        if nxt is None or nxt <= len(self.actors) or self.elastic.restart or not self.elastic.background:
            return
        keys, values = self._records(seg)
        refs = (keys, values, self.ray.put(self.data.params))
        last = min(nxt, self.capacity(), len(self.actors) + self._free_cpus())
        self.spares = {slot: self._new_actor(slot, refs) for slot in range(len(self.actors), last)}
        self.spare_t = time.perf_counter()
        self.prepare = last
        if self.spares:  # and partition each window's rest for them: if the policy asks, the transition is at once
            self.rest_for = last

    def _drop_spares(self) -> None:
        self.rest_for = None
        if self.spares:
            now = time.perf_counter()
            self.log.spares.append((self.spare_t - self.t0, now - self.t0, len(self.spares)))
            for a in self.spares.values():
                self.ray.kill(a)
            self.spares = {}

    def _started(self) -> bool:
        """Whether every pre-started actor is up (an actor that died starting is replaced at the transition)."""
        done, _ = self.ray.wait(self.pinged, num_returns=len(self.pinged), timeout=0)
        return len(done) == len(self.pinged)

    # -- the run ----------------------------------------------------------------------------------
    def run(self, workers: int, epochs: int, first_epoch: int, epoch_values: list[dict[str, np.ndarray]]
            ) -> list[float]:
        self.cap = max(workers, int(getattr(self.elastic.policy, "max_workers", workers)))
        self._init_ray(self.cap)
        self.controller = Controller(self.elastic)
        self.controller.log = self.log
        self.everything = np.arange(self.keys.shape[0], dtype=np.int64)
        self.identities = {n: np.full_like(self.data.params[n], identity(op, self.data.params[n].dtype))
                           for n, op in self.accs.items()}
        ckpt = _Checkpoint({n: np.array(self.data.params[n], copy=True) for n in self.written},
                           self._fresh_partials(workers), 0, -1)
        seg = Segment(first_epoch, self.make(workers, None), self.everything)
        self.busy = [0.0] * workers
        self.last_epoch = first_epoch + epochs - 1
        try:
            self._establish(seg, ckpt, workers)
            self._speculate(seg)
            for epoch in range(first_epoch, first_epoch + epochs):
                if seg.epoch != epoch:  # no transition at the last epoch's end: the same actors go on
                    ckpt.step = 0
                    if seg.whole and seg.sched.num_workers == len(self.actors):
                        seg = Segment(epoch, seg.sched, self.everything)  # the same records in place
                    else:
                        seg = Segment(epoch, self.make(len(self.actors), None), self.everything)
                        self._establish(seg, ckpt, len(self.actors))
                seg, ckpt, values = self._epoch(seg, ckpt)
                self.epochs_started += 1
                for n, op in self.accs.items():
                    combine(op, [v[n] for v in values], self.data.params[n])
                if self.accs:
                    epoch_values.append({n: np.array(self.data.params[n], copy=True) for n in self.accs})
                if self.log.stopped:
                    break
            for n in self.written:
                self.data.params[n][...] = ckpt.params[n]
        finally:
            self.close()
        return self.busy

    def _fresh_partials(self, count: int) -> list[dict[str, np.ndarray]]:
        return [dict(self.identities) for _ in range(count)]

    def _epoch(self, seg: Segment, ckpt: _Checkpoint
               ) -> tuple[Segment, _Checkpoint, list[dict[str, np.ndarray]]]:
        """Run ``seg``'s epoch to its end, with the transitions the controller decides; returns the segment the
        next epoch starts from, the checkpoint, and the epoch's accumulator values per segment."""
        epoch = seg.epoch
        self.log.segments.append(seg)
        values: list[dict[str, np.ndarray]] = []
        while True:
            ckpt.step = seg.next_work(ckpt.step)
            if ckpt.step == seg.sched.num_steps:  # only empty steps left
                seg.last_step = ckpt.step
                break
            ckpt, window = self._window(seg, ckpt)
            seg.last_step = ckpt.step
            if self.elastic.stop is not None and self.elastic.stop(window):
                self.log.stopped = True
                self.log.windows.append(window)
                break
            at_end = ckpt.step == seg.sched.num_steps
            decision = self._decide(window, seg, ckpt.step, at_end, at_end and epoch == self.last_epoch)
            if decision is None and at_end:
                break
            if decision is None:
                continue
            t0 = time.perf_counter()
            if self.accs:  # the segment's accumulators, combined over its actors before they change
                values.append(self._combine(ckpt.partials))
                ckpt.partials = self._fresh_partials(decision.workers)
            if at_end:  # the next epoch's whole segment, for the new count
                seg = Segment(epoch + 1, self.make(decision.workers, None), self.everything)
                ckpt.step = 0
            elif decision.workers != seg.sched.num_workers:  # the rest of this epoch, partitioned for the new count
                seg = self._take_rest(seg, ckpt.step, decision.workers)
                self.log.segments.append(seg)
                ckpt.step = 0
            # (a replacement alone: the segment goes on, the new actor taking over its slot's blocks)
            self.rest, self.rest_for = None, None
            if self.elastic.restart:
                self._restart(ckpt)
            started = t0 - self.prestarted if self.ready else 0.0
            fresh, self.ready = self.ready, {}
            self._establish(seg, ckpt, decision.workers, decision.replace, fresh)
            self.busy += [0.0] * max(0, decision.workers - len(self.busy))
            self.controller.record(decision, window, t0 - self.t0, time.perf_counter() - t0, started)
            if decision.workers > window.workers:
                self._speculate(seg)
            if at_end:
                return seg, ckpt, values
        if self.accs:
            values.append(self._combine(ckpt.partials))
            ckpt.partials = self._fresh_partials(len(self.actors))
            self.ray.get([a.set_relaxed.remote(self.identities) for a in self.actors])
        return seg, ckpt, values

    def _decide(self, window: Window, seg: Segment, step: int, at_end: bool, final: bool) -> Decision | None:
        """The transition to make now, if any.  With background starts, the decision waits (the current actors
        keep working, window after window) until its new actors are up and, for a new count mid-epoch, the
        epoch's rest is partitioned for it (during the window after the decision)."""
        if final:  # after the run's last window there is nothing to resize
            self.controller.log.windows.append(window)
            return None
        if self.pending is None:
            decision: Decision | None = self.controller.observe(window)
            if decision is not None:
                decision = self._bounded(decision, window)
            next_count = getattr(self.elastic.policy, "next_count", None)
            if self.spares and (decision is not None and decision.workers <= len(self.actors)
                                or next_count is not None and next_count(len(self.actors)) is None):
                self._drop_spares()  # the policy will not grow now
            if decision is None or self.elastic.restart or not self.elastic.background:
                return decision
            needed = len(decision.replace) + max(0, decision.workers - len(self.actors) - len(self.spares))
            if (decision.replace or decision.workers > len(self.actors)) and needed <= self._free_cpus():
                # (without a free CPU for each new actor, they start in the transition, after the old ones stop)
                self._prestart(decision, seg)
            self.pending = decision
        else:
            self.controller.log.windows.append(window)
        decision = self.pending
        rest_ready = True
        if not at_end and decision.workers != len(self.actors):
            self.rest_for = decision.workers  # each window partitions its rest for it, until the transition
            rest_ready = self._prepared_rest(seg, step, decision.workers) is not None
        if not rest_ready or self.pinged and not self._started():
            return None
        self.pending, self.pinged = None, []
        return decision

    def _rest(self, seg: Segment, step: int, count: int) -> Segment:
        """The records of ``seg``'s steps from ``step`` on (data order), partitioned for ``count`` workers."""
        records = np.sort(seg.steps_records(step, seg.sched.num_steps))
        return Segment(seg.epoch, self.make(count, records), records, whole=False)

    def _prepared_rest(self, seg: Segment, step: int, count: int) -> Segment | None:
        """The rest of ``seg`` from ``step`` for ``count`` workers, if the last window computed it."""
        if self.rest is not None and self.rest[0] is seg and self.rest[1] == step:
            if self.rest[2].sched.num_workers == count:
                return self.rest[2]
        return None

    def _take_rest(self, seg: Segment, step: int, count: int) -> Segment:
        """The rest computed during the last window if it fits, else computed now (inside the transition)."""
        return self._prepared_rest(seg, step, count) or self._rest(seg, step, count)

    def _bounded(self, decision: Decision, window: Window) -> Decision | None:
        # The cluster may not have CPUs for every actor the policy wants: take what there is.
        want = decision.workers
        if want > window.workers:
            want = min(want, self.capacity())
        if want == window.workers and not decision.replace:
            return None
        if want != decision.workers:
            return Decision(want, decision.replace, f"{decision.reason} (the cluster has CPUs for {want})")
        return decision

    def _window(self, seg: Segment, ckpt: _Checkpoint) -> tuple[_Checkpoint, Window]:
        sched = seg.sched
        width = sched.num_steps if sched.epoch_barrier else self.elastic.window_for(sched.num_workers)
        busy = np.flatnonzero(seg.step_sizes[ckpt.step:]) + ckpt.step  # a window is ``width`` steps with records
        stop = int(busy[width - 1]) + 1 if busy.size > width else sched.num_steps
        index = len(self.log.windows)
        for attempt in range(_MAX_RECOVERIES + 1):
            try:
                return self._try_window(seg, ckpt, stop, index)
            except self.ray.exceptions.RayActorError:
                if attempt == _MAX_RECOVERIES:
                    raise
                self.log.recoveries += 1
                self._establish(seg, ckpt, len(self.actors))
        raise AssertionError("unreachable")

    def _try_window(self, seg: Segment, ckpt: _Checkpoint, stop: int, index: int) -> tuple[_Checkpoint, Window]:
        sched, ray = seg.sched, self.ray
        t0 = time.perf_counter()
        if self.hook is not None:
            self.hook("window", index, self.actors)
        serial = ckpt.serial
        timings: list[tuple[int, int, Any]] = []
        for step in range(ckpt.step, stop):
            for w in range(sched.num_workers):
                task = sched.by_worker[w].get(step)
                if task is None or sched.block_stop[task.block] == sched.block_start[task.block]:
                    continue  # (an empty block: the token's state waits for its next user as it is)
                serial += 1
                start, end = int(sched.block_start[task.block]), int(sched.block_stop[task.block])
                state, seconds = self.actors[w].run_task.options(num_returns=2).remote(
                    serial, start, end, self.tokens.get(task.token))
                self.tokens[task.token] = state
                timings.append((w, end - start, seconds))
        # While the actors work: the partitioning a coming transition will need.
        if self.rest_for is not None and stop < sched.num_steps:
            self.rest = (seg, stop, self._rest(seg, stop, self.rest_for))
        elif self.prepare is not None:
            self.make(self.prepare, None)
            self.prepare = None
        spent = ray.get([t for _, _, t in timings])
        changes: list[Changes] = ray.get([a.collect.remote(ckpt.serial) for a in self.actors])
        partials = (ray.get([a.relaxed_copies.remote(tuple(self.accs)) for a in self.actors]) if self.accs
                    else ckpt.partials)
        elapsed = time.perf_counter() - t0
        params = {n: np.array(v, copy=True) for n, v in ckpt.params.items()}
        for n in self.written:
            idx, _, val = newest([c[n] for c in changes])
            params[n].reshape(-1)[idx] = val
        work = np.zeros(sched.num_workers)
        secs = np.zeros(sched.num_workers)
        for (w, n_rec, _), s in zip(timings, spent, strict=True):
            work[w] += n_rec
            secs[w] += s
            self.busy[w] += s
        per_worker = tuple(float(r / s) if r > 0 and s > 0 else float("nan") for r, s in zip(work, secs, strict=True))
        progress = None
        if self.elastic.progress is not None:
            for n in self.written:  # the user's measure reads the arrays as of this window
                self.data.params[n][...] = params[n]
            progress = float(self.elastic.progress())
        window = Window(index, t0 - self.t0, elapsed, sched.num_workers, float(work.sum()), per_worker, progress)
        return _Checkpoint(params, [dict(p) for p in partials], stop, serial), window

    def _combine(self, partials: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        out = {}
        for n, op in self.accs.items():
            out[n] = np.empty_like(self.data.params[n])
            combine(op, [p[n] for p in partials], out[n])
        return out

    def _restart(self, ckpt: _Checkpoint) -> None:
        """Checkpoint-and-restart: the state to disk, every actor (and Ray, if this run started it) stopped,
        started again, the state read back."""
        folder = tempfile.mkdtemp(prefix="orion_par-restart-")
        try:
            path = os.path.join(folder, "state.npz")
            arrays: dict[str, Any] = {f"p_{n}": v for n, v in ckpt.params.items()}
            arrays.update({f"a{i}_{n}": v for i, p in enumerate(ckpt.partials) for n, v in p.items()})
            np.savez(path, **arrays)
            ours = self.started_ray
            self.close()
            self.whole_refs = {}  # the object store goes with Ray
            if ours:
                self._init_ray(self.cap)
            else:
                self.actor_cls = self.ray.remote(num_cpus=1, max_restarts=0)(BlockWorker)
            with np.load(path) as saved:
                ckpt.params = {n: saved[f"p_{n}"] for n in ckpt.params}
                ckpt.partials = [{n: saved[f"a{i}_{n}"] for n in p} for i, p in enumerate(ckpt.partials)]
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def close(self) -> None:
        self._drop_spares()
        for a in [*self.actors, *self.ready.values()]:
            self.ray.kill(a)
        self.actors, self.ready, self.pending = [], {}, None
        if self.started_ray:
            self.ray.shutdown()
            self.started_ray = False


def check_elastic(elastic: object, backend: str, plan: Plan, workers: int) -> Elastic:
    """The ``elastic=`` argument of ``run``, checked."""
    if not isinstance(elastic, Elastic):
        raise ElasticError(f"run(elastic={elastic!r}): pass an orion_par.elastic.Elastic, e.g. "
                           f"Elastic(ScalingEfficiency(max_workers=8)).")
    if backend != "ray":
        raise ElasticError(f"run(elastic=..., backend={backend!r}): elastic runs resize Ray actors; use "
                           f"backend='ray'.")
    if plan.relaxed:
        raise ElasticError(f"run(elastic=...): arrays {sorted(plan.relaxed)} are merged additively (Buffers or "
                           f"data-parallel arrays), which elastic runs do not carry across a resize yet; run "
                           f"without elastic, or use orion_par.ps's RayPS.run(elastic=...) for data-parallel "
                           f"training.")
    if not isinstance(workers, int) or workers < 1:
        raise ElasticError(f"run(workers={workers!r}, elastic=...): the starting worker count must be an int >= 1.")
    return elastic

