"""The embedded executor: one thread per worker, each running the compiled block on shared arrays.

numba's ``nogil=True`` releases the GIL inside the block, so the threads really run in parallel.  A task
waits until the previous use of its token has finished (see ``schedule``); relaxed arrays (Buffers,
data-parallel arrays) get one private copy per worker and are merged at a barrier every few steps.

Schedules without barriers (unordered 2D, 1D, independent records) run each worker's whole list of calls
in one compiled driver (``codegen``'s ``_orion_drive``): the token waits are acquire/release counters
(``sync``), so a hand-over costs a cache line instead of a Python condition variable, a wake-up and the
GIL.  A worker that waits longer than ``_SPIN_S`` sleeps in Python until its token arrives.  One worker runs
in the calling thread.  Barrier schedules and bodies numba cannot compile keep the Python path below.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from orion_par import sync
from orion_par.codegen import CompiledBody
from orion_par.relaxed import merge_into, sync_every
from orion_par.schedule import Schedule, Task


@dataclass
class BlockData:
    """The dataset permuted into block order, and the body's parameters by name."""

    keys: np.ndarray
    values: np.ndarray
    params: dict[str, Any]


Own = Sequence[Mapping[str, Sequence[np.ndarray]]]  # own[epoch][name][worker]: a worker's private array
_SPIN_S = 5e-5  # a worker spins this long for a token, then sleeps (its partner was probably descheduled)
_NAP_S = (5e-5, 5e-4)  # sleeps between looks at the token's count: the first, doubling up to the second


@dataclass
class _State:
    cond: threading.Condition = field(default_factory=threading.Condition)
    done: dict[int, int] = field(default_factory=dict)
    error: BaseException | None = None


def run_local(compiled: CompiledBody, data: BlockData, schedule: Schedule, epochs: int,
              relaxed: Mapping[str, int], seed: int | None, cpu: list[float] | None = None,
              first_epoch: int = 0, own: Own | None = None) -> list[float]:
    """Run epochs ``first_epoch`` to ``first_epoch + epochs - 1`` of ``schedule``; returns each worker's busy
    seconds (wall time in blocks).

    ``cpu``, if given, receives each worker's CPU seconds in blocks (busy time minus time the OS gave
    the core to other processes).  ``own``: parameters each worker has its own copy of in each epoch
    (accumulators): ``own[epoch][name][worker]``.
    """
    if epochs == 0:
        if cpu is not None:
            cpu[:] = [0.0] * schedule.num_workers
        return [0.0] * schedule.num_workers
    own = own or [{} for _ in range(epochs)]
    workers = schedule.num_workers
    by_epoch = [schedule.for_epoch(first_epoch + e) for e in range(epochs)]  # each epoch's tasks (one order for all)
    private = _private_copies(data.params, relaxed, workers)
    base = {n: np.array(data.params[n], copy=True) for n in private}
    every = sync_every(relaxed) if private else None
    need_barrier = every is not None or (schedule.epoch_barrier and workers > 1)

    def merge() -> None:
        for name, copies in private.items():
            merge_into(data.params[name], base[name], copies)
            for c in copies:
                c[...] = data.params[name]

    if compiled.drive is not None and not need_barrier:
        return _run_driven(compiled, data, schedule, by_epoch, seed, cpu, own)
    barrier = threading.Barrier(workers, action=merge) if need_barrier else None
    state = _State()
    busy = [0.0] * workers
    cpu_s = [0.0] * workers
    threads = [
        threading.Thread(target=_worker, name=f"orion_par-worker-{w}",
                         args=(w, compiled, data, by_epoch, private, own, every, barrier, state, (busy, cpu_s), seed))
        for w in range(workers)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if state.error is not None:
        raise state.error
    if private:
        merge()
    if cpu is not None:
        cpu[:] = cpu_s
    return busy


def _private_copies(params: Mapping[str, Any], relaxed: Mapping[str, int], workers: int) -> dict[str, list[np.ndarray]]:
    if workers == 1:
        return {}  # one worker: updating the shared array directly is exact
    return {n: [np.array(params[n], copy=True) for _ in range(workers)] for n in relaxed if n in params}


def _worker(w: int, compiled: CompiledBody, data: BlockData, by_epoch: list[Schedule],
            private: Mapping[str, list[np.ndarray]], own: Own, every: int | None, barrier: threading.Barrier | None,
            state: _State, clocks: tuple[list[float], list[float]], seed: int | None) -> None:
    try:
        if seed is not None:
            compiled.seed(seed + w)
        for epoch, schedule in enumerate(by_epoch):
            mine = own[epoch]
            params = tuple(mine[n][w] if n in mine else private[n][w] if n in private else data.params[n]
                           for n in compiled.param_names)
            runs = _runs(schedule, w, merge=every is None)
            for step in range(schedule.num_steps):
                run = runs.get(step)
                if run is not None:
                    task, count, start, stop = run
                    _wait_turn(task, epoch, schedule, state)
                    t0, c0 = time.perf_counter(), time.thread_time()
                    compiled.block(data.keys, data.values, start, stop, *params)
                    clocks[0][w] += time.perf_counter() - t0
                    clocks[1][w] += time.thread_time() - c0
                    with state.cond:
                        state.done[task.token] = state.done.get(task.token, 0) + count
                        state.cond.notify_all()
                if barrier is not None and every is not None and (epoch * schedule.num_steps + step + 1) % every == 0:
                    barrier.wait()
            if barrier is not None and schedule.epoch_barrier:
                barrier.wait()
    except threading.BrokenBarrierError:
        return  # another worker failed; its error is reported
    except BaseException as e:
        with state.cond:
            state.error = state.error or e
            state.cond.notify_all()
        if barrier is not None:
            barrier.abort()


def _runs(schedule: Schedule, w: int, merge: bool) -> dict[int, tuple[Task, int, int, int]]:
    """Worker ``w``'s calls by first step (``Schedule.runs``)."""
    return schedule.runs(w, merge)


def _wait_turn(task: Task, epoch: int, schedule: Schedule, state: _State) -> None:
    index, per_epoch = schedule.token_use[task]
    expected = epoch * per_epoch + index
    with state.cond:
        state.cond.wait_for(lambda: state.error is not None or state.done.get(task.token, 0) >= expected)
        if state.error is not None:
            raise threading.BrokenBarrierError  # stop quietly; the first error is re-raised by run_local


def _run_driven(compiled: CompiledBody, data: BlockData, schedule: Schedule, by_epoch: list[Schedule],
                seed: int | None, cpu: list[float] | None, own: Own) -> list[float]:
    """``run_local`` for schedules without barriers: each worker's calls in one compiled driver."""
    workers = schedule.num_workers
    calls = [_calls(by_epoch, w) for w in range(workers)]
    done = np.zeros(max((t.token for t in schedule.tasks), default=0) + 1, np.int64)
    # Each worker's parameters in each epoch (its own accumulator copies, the shared arrays).
    params = [[tuple(mine[n][w] if n in mine else data.params[n] for n in compiled.param_names)
               for mine in (own if any(own) else own[:1])] for w in range(workers)]
    spin = int(_SPIN_S * _cycles_per_s())
    state = _State()
    busy = [0.0] * workers
    cpu_s = [0.0] * workers
    ends = [np.cumsum([s.calls[w].shape[0] for s in by_epoch]) for w in range(workers)]  # each epoch's last call + 1
    args = (compiled, data, calls, ends, done, spin, params, state, (busy, cpu_s), seed)
    if workers == 1:
        _drive_worker(0, *args)  # nothing to wait for: no thread
    else:
        threads = [threading.Thread(target=_drive_worker, name=f"orion_par-worker-{w}", args=(w, *args))
                   for w in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if state.error is not None:
        raise state.error
    if cpu is not None:
        cpu[:] = cpu_s
    return busy


def _calls(by_epoch: list[Schedule], w: int) -> np.ndarray:
    """Worker ``w``'s calls over the epochs, one row each: record start, stop, token, uses of the token that
    must have finished before it, tasks in the call (``Schedule.calls``, epoch after epoch)."""
    parts = []
    for epoch, schedule in enumerate(by_epoch):
        one = schedule.calls[w][:, :5].copy()
        one[:, 3] += epoch * schedule.calls[w][:, 5]
        parts.append(one)
    return np.concatenate(parts) if parts else np.zeros((0, 5), np.int64)


def _drive_worker(w: int, compiled: CompiledBody, data: BlockData, by_worker: list[np.ndarray],
                  ends: list[np.ndarray], done: np.ndarray, spin: int, by_worker_params: list[list[tuple[Any, ...]]],
                  state: _State, clocks: tuple[list[float], list[float]], seed: int | None) -> None:
    assert compiled.drive is not None
    clock = np.zeros(2, np.int64)  # cycles spent waiting for tokens, cycles in the driver
    wall = cpu = 0.0
    try:
        if seed is not None:
            compiled.seed(seed + w)
        c = 0
        # One driver call per epoch when its parameters change between epochs (accumulators), else one
        # for the whole run.
        epochs = by_worker_params[w]
        cuts = list(ends[w]) if len(epochs) > 1 else [by_worker[w].shape[0]]
        for epoch, n in enumerate(cuts):
            calls, params = by_worker[w][:n], epochs[epoch]
            while c < n:
                t0, c0 = time.perf_counter(), time.thread_time()
                c = compiled.drive(data.keys, data.values, calls, c, done, spin, clock, *params)
                wall += time.perf_counter() - t0
                cpu += time.thread_time() - c0
                if c < n:
                    _nap(done, int(calls[c, 2]), int(calls[c, 3]), state)
    except threading.BrokenBarrierError:
        pass  # another worker failed; its error is reported
    except BaseException as e:
        with state.cond:
            state.error = state.error or e
    # The share of the driver's cycles spent spinning for tokens; the rest ran blocks (a thread the OS
    # preempted is counted as preempted in both shares alike).
    working = 1.0 - float(clock[0]) / float(clock[1]) if clock[1] > 0 else 1.0
    clocks[0][w] = wall * working
    clocks[1][w] = cpu * working


def _nap(done: np.ndarray, token: int, need: int, state: _State) -> None:
    # Sleep until the token's count arrives (the driver re-reads it with acquire ordering).  The core this
    # frees can run the partner the OS preempted, which is what the wait was for.
    nap, longest = _NAP_S
    while done[token] < need:
        if state.error is not None:
            raise threading.BrokenBarrierError
        time.sleep(nap)
        nap = min(2 * nap, longest)


_CYCLES_PER_S: list[float] = []


def _cycles_per_s() -> float:
    """Rate of ``sync.cycles`` (measured once, over a millisecond)."""
    if not _CYCLES_PER_S:
        sync.now()
        t0, c0 = time.perf_counter(), sync.now()
        while time.perf_counter() - t0 < 1e-3:
            pass
        _CYCLES_PER_S.append(max((sync.now() - c0) / (time.perf_counter() - t0), 1e6))
    return _CYCLES_PER_S[0]
