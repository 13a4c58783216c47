"""The Ray executor: the same schedule on Ray actors, for more than one machine.

Each actor owns one space partition and a private copy of every array.  A task's changes are stamped with
the task's position in the serial order; the changes to arrays that other partitions touch travel with
the task's token (its time partition) as an object reference to the token's next user, who applies an
element only if its stamp is newer.  At the end the driver keeps, per element, the value with the newest
stamp.  Relaxed arrays are merged on the driver with the same arithmetic as the local executor, so the
results equal the local executor's.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from orion_par.accumulate import combine
from orion_par.codegen import CompiledBody, compile_body
from orion_par.elastic.emulate import Emulation
from orion_par.local import BlockData
from orion_par.plan import Plan
from orion_par.relaxed import merge_into, sync_every
from orion_par.schedule import Schedule

Changes = dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]  # name -> (flat index, stamp, value)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ModuleNotFoundError("backend='ray' needs the ray package: pip install ray==2.60.0") from e
    return ray


def changed_elements(before: np.ndarray, after: np.ndarray) -> np.ndarray:
    """Flat indices whose bytes differ (so NaNs and -0.0 count exactly)."""
    a = np.ascontiguousarray(before).reshape(-1).view(np.uint8).reshape(before.size, -1)
    b = np.ascontiguousarray(after).reshape(-1).view(np.uint8).reshape(after.size, -1)
    return np.flatnonzero((a != b).any(axis=1))


def newest(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Combine change sets, keeping for each index the value with the largest stamp."""
    idx = np.concatenate([p[0] for p in parts])
    st = np.concatenate([p[1] for p in parts])
    val = np.concatenate([p[2] for p in parts])
    order = np.lexsort((st, idx))
    idx, st, val = idx[order], st[order], val[order]
    last = np.ones(idx.size, bool)
    last[:-1] = idx[1:] != idx[:-1]
    return idx[last], st[last], val[last]


class BlockWorker:
    """State of one Ray actor: its array copies, element stamps, and the compiled body."""

    def __init__(self, spec: dict[str, Any], keys: np.ndarray, values: np.ndarray, params: dict[str, Any],
                 worker: int, slowdown: float = 1.0) -> None:
        self.keys, self.values, self.worker = keys, values, worker
        self.written: tuple[str, ...] = spec["written"]
        self.traveling: tuple[str, ...] = spec["traveling"]
        self.emulation: Emulation | None = spec.get("emulation")
        self.slowdown = slowdown
        self.reset(params, spec["seed"])
        names = spec["param_names"]
        args = (keys, values, 0, 0, *(self.params[n] for n in names))
        self.compiled: CompiledBody = compile_body(spec["name"], spec["source"], names, spec["injected"], args,
                                                   boundscheck=spec["boundscheck"], python_reason=spec["python_reason"])

    def reset(self, params: dict[str, Any], seed: int | None) -> None:
        """Start a new run from the driver's current arrays (actors are reused between runs)."""
        self.params = {n: np.array(v, copy=True) if isinstance(v, np.ndarray) else v for n, v in params.items()}
        self.stamp = {n: np.full(self.params[n].size, -1, np.int64) for n in self.written}
        self.seed, self.seeded = seed, False

    def run_task(self, serial: int, start: int, stop: int, token_state: Changes | None) -> tuple[Changes, float]:

        if self.seed is not None and not self.seeded:
            self.compiled.seed(self.seed + self.worker)  # numba's generator is per thread: seed in this one
            self.seeded = True
        for name, (idx, st, val) in (token_state or {}).items():
            newer = st > self.stamp[name][idx]
            self.params[name].reshape(-1)[idx[newer]] = val[newer]
            self.stamp[name][idx[newer]] = st[newer]
        before = {n: self.params[n].copy() for n in self.written}
        t0 = time.perf_counter()
        self.compiled.block(self.keys, self.values, start, stop, *(self.params[n] for n in self.compiled.param_names))
        busy = time.perf_counter() - t0
        if self.emulation is not None:
            busy += self.emulation.pad(stop - start, busy, self.slowdown)
        out: Changes = {}
        for n in self.written:
            idx = changed_elements(before[n], self.params[n])
            self.stamp[n][idx] = serial
            if n in self.traveling:
                mine = (idx, np.full(idx.size, serial, np.int64), self.params[n].reshape(-1)[idx])
                out[n] = newest([(token_state or {}).get(n, _empty(self.params[n])), mine])
        return out, busy

    def relaxed_copies(self, names: tuple[str, ...]) -> dict[str, np.ndarray]:
        return {n: self.params[n] for n in names}

    def set_relaxed(self, values: Mapping[str, np.ndarray]) -> None:
        for n, v in values.items():
            self.params[n][...] = v

    def load(self, keys: np.ndarray, values: np.ndarray, params: dict[str, Any], worker: int,
             partials: Mapping[str, np.ndarray]) -> None:
        """Elastic runs: become slot ``worker``, take a segment's records (block order), start from the driver's
        arrays, and from ``partials`` for the accumulators."""
        self.keys, self.values, self.worker = keys, values, worker
        seeded = self.seeded
        self.reset(params, self.seed)
        self.seeded = seeded  # one random stream per actor for its whole life
        self.set_relaxed(partials)

    def ping(self) -> int:
        return self.worker

    def collect(self, since: int = -1) -> Changes:
        """Per written array, the elements stamped after ``since``: (flat index, stamp, value)."""
        out: Changes = {}
        for n in self.written:
            idx = np.flatnonzero(self.stamp[n] > since)
            out[n] = (idx, self.stamp[n][idx], self.params[n].reshape(-1)[idx])
        return out


def _empty(arr: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, arr.dtype)


def run_ray(compiled: CompiledBody, data: BlockData, sched: Schedule, epochs: int, plan: Plan,
            seed: int | None, pool: dict[str, Any], first_epoch: int = 0,
            epoch_values: list[dict[str, np.ndarray]] | None = None) -> list[float]:
    """Run like ``run_local`` on Ray actors; starts (and then stops) a local Ray if none is running.

    When Ray was already running, the actors stay in ``pool`` for the next run of the same schedule
    (``ParallelFor.close()`` or ``ray.shutdown()`` ends them).  The plan's accumulators (which must hold
    their identity in ``data.params``) are combined at the end of every epoch and appended to
    ``epoch_values``.
    """
    ray = _import_ray()
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=max(sched.num_workers, os.cpu_count() or 1), include_dashboard=False,
                 log_to_driver=False, configure_logging=False)
    relaxed = tuple(n for n in plan.relaxed if n in data.params) if sched.num_workers > 1 else ()
    key = (id(sched), compiled.source, relaxed, ray.get_runtime_context().get_job_id())
    actors: list[Any] = pool.get("actors", []) if pool.get("key") == key else []
    keep = False
    try:
        if actors:
            ray.get([a.reset.remote(ray.put(data.params), seed) for a in actors])
        else:
            close_pool(pool)
            actors = _start_actors(ray, compiled, data, sched, plan, relaxed, seed)
        accs = {n: op for n, op in plan.accumulators.items() if n in data.params}
        busy = _drive(ray, actors, data, sched, epochs, relaxed, sync_every(plan.relaxed), first_epoch, accs,
                      epoch_values if epoch_values is not None else [])
        _gather(ray, actors, data)
        keep = not started
        return busy
    finally:
        if keep:
            pool.update(key=key, actors=actors)
        else:
            pool.clear()
            for a in actors:
                ray.kill(a)
        if started:
            ray.shutdown()


def close_pool(pool: dict[str, Any]) -> None:
    """End the actors a previous run left for reuse."""
    actors = pool.pop("actors", [])
    pool.clear()
    if actors:
        ray = _import_ray()
        if ray.is_initialized():
            for a in actors:
                ray.kill(a)


def _start_actors(ray: Any, compiled: CompiledBody, data: BlockData, sched: Schedule, plan: Plan,
                  relaxed: tuple[str, ...], seed: int | None) -> list[Any]:
    written = tuple(n for n in plan.written if n in data.params and n not in relaxed and n not in plan.accumulators)
    spec = dict(name=compiled.name, source=compiled.source, param_names=compiled.param_names,
                injected=compiled.injected, boundscheck=compiled.boundscheck,
                python_reason="" if compiled.compiled else compiled.fallback_reason, written=written,
                traveling=tuple(n for n in written if n not in plan.space_arrays), seed=seed)
    cpus = float(ray.cluster_resources().get("CPU", 1.0))
    actor_cls = ray.remote(num_cpus=min(1.0, cpus / sched.num_workers))(BlockWorker)
    keys_ref, values_ref = ray.put(data.keys), ray.put(data.values)
    params_ref = ray.put(data.params)
    return [actor_cls.remote(spec, keys_ref, values_ref, params_ref, w) for w in range(sched.num_workers)]


def _drive(ray: Any, actors: list[Any], data: BlockData, schedule: Schedule, epochs: int,
           relaxed: tuple[str, ...], every: int | None, first_epoch: int, accs: Mapping[str, str],
           epoch_values: list[dict[str, np.ndarray]]) -> list[float]:
    base = {n: np.array(data.params[n], copy=True) for n in relaxed}
    start = {n: np.array(data.params[n], copy=True) for n in accs}  # the identities
    tokens: dict[int, Any] = {}
    busy = [0.0] * schedule.num_workers
    for epoch in range(epochs):
        sched = schedule.for_epoch(first_epoch + epoch)  # this epoch's tasks, as the local executor runs them
        serial_of = {t: i for i, t in enumerate(sched.tasks)}
        timings: list[tuple[int, Any]] = []
        for step in range(sched.num_steps):
            for w in range(sched.num_workers):
                task = sched.by_worker[w].get(step)
                if task is None:
                    continue
                state, seconds = actors[w].run_task.options(num_returns=2).remote(
                    epoch * len(sched.tasks) + serial_of[task], int(sched.block_start[task.block]),
                    int(sched.block_stop[task.block]), tokens.get(task.token))
                tokens[task.token] = state  # the token's next user waits for this object
                timings.append((w, seconds))
            if relaxed and every is not None and (epoch * sched.num_steps + step + 1) % every == 0:
                _merge(ray, actors, data, relaxed, base)
        # Waiting on the small timing objects surfaces a failed task at once; it is also the epoch barrier
        # that wavefronts need.
        for (w, _), s in zip(timings, ray.get([t for _, t in timings]), strict=True):
            busy[w] += s
        if accs:
            names = tuple(accs)
            partials = ray.get([a.relaxed_copies.remote(names) for a in actors])
            for n, op in accs.items():
                combine(op, [p[n] for p in partials], data.params[n])
            epoch_values.append({n: np.array(data.params[n], copy=True) for n in accs})
            fresh = ray.put(start)
            ray.get([a.set_relaxed.remote(fresh) for a in actors])
    if relaxed:
        _merge(ray, actors, data, relaxed, base)
    return busy


def _merge(ray: Any, actors: list[Any], data: BlockData, names: tuple[str, ...], base: dict[str, np.ndarray]) -> None:
    copies = ray.get([a.relaxed_copies.remote(names) for a in actors])
    for n in names:
        merge_into(data.params[n], base[n], [c[n] for c in copies])
    fresh = ray.put({n: data.params[n] for n in names})
    ray.get([a.set_relaxed.remote(fresh) for a in actors])


def _gather(ray: Any, actors: list[Any], data: BlockData) -> None:
    results = ray.get([a.collect.remote() for a in actors])
    for name in results[0] if results else ():
        idx, _, val = newest([r[name] for r in results])
        target = data.params[name]
        flat = target.reshape(-1)  # a view when contiguous; written back below otherwise
        flat[idx] = val
        if not np.shares_memory(flat, target):
            target[...] = flat.reshape(target.shape)
