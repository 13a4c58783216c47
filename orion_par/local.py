"""The embedded executor: one thread per worker, each running the compiled block on shared arrays.

numba's ``nogil=True`` releases the GIL inside the block, so the threads really run in parallel.  A task
waits until the previous use of its token has finished (see ``schedule``); relaxed arrays (Buffers,
data-parallel arrays) get one private copy per worker and are merged at a barrier every few steps.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from orion_par.codegen import CompiledBody
from orion_par.relaxed import merge_into, sync_every
from orion_par.schedule import Schedule, Task


@dataclass
class BlockData:
    """The dataset permuted into block order, and the body's parameters by name."""

    keys: np.ndarray
    values: np.ndarray
    params: dict[str, Any]


@dataclass
class _State:
    cond: threading.Condition = field(default_factory=threading.Condition)
    done: dict[int, int] = field(default_factory=dict)
    error: BaseException | None = None


def run_local(compiled: CompiledBody, data: BlockData, schedule: Schedule, epochs: int,
              relaxed: Mapping[str, int], seed: int | None, cpu: list[float] | None = None,
              first_epoch: int = 0) -> list[float]:
    """Run epochs ``first_epoch`` to ``first_epoch + epochs - 1`` of ``schedule``; returns each worker's busy
    seconds (wall time in blocks).

    ``cpu``, if given, receives each worker's CPU seconds in blocks (busy time minus time the OS gave
    the core to other processes).
    """
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

    barrier = threading.Barrier(workers, action=merge) if need_barrier else None
    state = _State()
    busy = [0.0] * workers
    cpu_s = [0.0] * workers
    threads = [
        threading.Thread(target=_worker, name=f"orion_par-worker-{w}",
                         args=(w, compiled, data, by_epoch, private, every, barrier, state, (busy, cpu_s), seed))
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
            private: Mapping[str, list[np.ndarray]], every: int | None, barrier: threading.Barrier | None,
            state: _State, clocks: tuple[list[float], list[float]], seed: int | None) -> None:
    try:
        if seed is not None:
            compiled.seed(seed + w)
        params = tuple(private[n][w] if n in private else data.params[n] for n in compiled.param_names)
        for epoch, schedule in enumerate(by_epoch):
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
    except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
        with state.cond:
            state.error = state.error or e
            state.cond.notify_all()
        if barrier is not None:
            barrier.abort()


def _runs(schedule: Schedule, w: int, merge: bool) -> dict[int, tuple[Task, int, int, int]]:
    """Worker ``w``'s calls by first step: (first task, tasks in the call, record start, record stop).

    With ``merge``, tasks at consecutive steps that are consecutive uses of one token over adjacent record
    ranges (a 2D block's chunks in one run) become one call: no other task can use the token in between,
    so the run is the same, with one wait and one hand-over instead of one per task.
    """
    out: dict[int, tuple[Task, int, int, int]] = {}
    first = last = -1
    for step in range(schedule.num_steps):
        task = schedule.by_worker[w].get(step)
        if task is None:
            continue
        start, stop = int(schedule.block_start[task.block]), int(schedule.block_stop[task.block])
        if first >= 0:
            head, count, s0, s1 = out[first]
            if (merge and last == step - 1 and head.token == task.token and s1 == start
                    and schedule.token_use[task][0] == schedule.token_use[head][0] + count):
                out[first], last = (head, count + 1, s0, stop), step
                continue
        out[step], first, last = (task, 1, start, stop), step, step
    return out


def _wait_turn(task: Task, epoch: int, schedule: Schedule, state: _State) -> None:
    index, per_epoch = schedule.token_use[task]
    expected = epoch * per_epoch + index
    with state.cond:
        state.cond.wait_for(lambda: state.error is not None or state.done.get(task.token, 0) >= expected)
        if state.error is not None:
            raise threading.BrokenBarrierError  # stop quietly; the first error is re-raised by run_local
