"""Data-parallel fallback for ``parallel_for``: the relaxed arrays live in the parameter server.

``parallel_for(..., allow_data_parallel=True)`` hands the arrays that block every scheme to the
parameter server, and a ``Buffer(array, max_delay=d)`` is an array whose updates may reach the other
workers ``d`` steps late.  ``run_data_parallel`` runs the executor's schedule (the same tasks and token
order as the local executor, so arrays that are *not* relaxed keep their exact serial semantics) with one
twist: each worker computes on its own replica of every relaxed array, and after every schedule step it
sends its changes as increments (rows that changed), ends its clock, and refreshes its replica from the
server.  A relaxed array with ``max_delay = d`` becomes a table with staleness ``d - 1``: a worker at step
``t`` sees every other worker's changes of steps ``< t - d + 1`` -- the Buffer's promise.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from orion_par.codegen import CompiledBody
from orion_par.local import BlockData
from orion_par.ps.client import ClientOptions, PSClient
from orion_par.ps.local import LocalPS
from orion_par.ps.tables import BadTableError, TableSpec
from orion_par.schedule import Schedule, Task


@dataclass(frozen=True)
class DataParallelOptions:
    """How relaxed arrays are served: the client options (budget, managed communication) and shards."""

    client: ClientOptions | None = None
    num_shards: int = 1


def table_specs(params: Mapping[str, Any], relaxed: Mapping[str, int]) -> list[TableSpec]:
    """One table per relaxed array: rows along axis 0, the rest flattened; staleness ``max_delay - 1``.

    Examples
    --------
    >>> [(t.name, t.num_rows, t.width, t.staleness) for t in table_specs({"H": np.zeros((5, 2, 3))}, {"H": 2})]
    [('H', 5, 6, 1)]
    """
    specs = []
    for name, delay in sorted(relaxed.items()):
        arr = params.get(name)
        if not isinstance(arr, np.ndarray) or arr.ndim == 0 or arr.size == 0:
            raise BadTableError(f"data-parallel array {name!r} must be a non-empty ndarray with at least one "
                                f"dimension to live in the parameter server; got {type(arr).__name__} "
                                f"{np.shape(arr) if arr is not None else ''}.")
        if not isinstance(delay, int) or delay < 1:
            raise BadTableError(f"relaxed array {name!r}: max_delay={delay!r} must be an int >= 1.")
        specs.append(TableSpec(name, int(arr.shape[0]), int(arr.size // arr.shape[0]), staleness=delay - 1,
                               dtype=str(arr.dtype)))
    return specs


class _Tokens:
    """The local executor's rule: a task waits until the previous use of its token has finished."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.done: dict[int, int] = {}
        self.failed = False

    def wait(self, task: Task, epoch: int, schedule: Schedule) -> None:
        index, per_epoch = schedule.token_use[task]
        with self.cond:
            self.cond.wait_for(lambda: self.failed or self.done.get(task.token, 0) >= epoch * per_epoch + index)
            if self.failed:
                raise threading.BrokenBarrierError  # another worker failed; its error is reported

    def finish(self, task: Task) -> None:
        with self.cond:
            self.done[task.token] = self.done.get(task.token, 0) + 1
            self.cond.notify_all()

    def fail(self) -> None:
        with self.cond:
            self.failed = True
            self.cond.notify_all()


def run_data_parallel(compiled: CompiledBody, data: BlockData, schedule: Schedule, epochs: int,
                      relaxed: Mapping[str, int], seed: int | None = None,
                      options: DataParallelOptions | None = None, first_epoch: int = 0,
                      own: Sequence[Mapping[str, Sequence[np.ndarray]]] | None = None) -> list[float]:
    """Run ``epochs`` epochs of ``schedule`` with the ``relaxed`` arrays in a parameter server.

    Parameters
    ----------
    compiled : CompiledBody
        The executor's compiled block (``block(keys, values, start, stop, *params)``).
    data : BlockData
        Records in block order and the body's parameters; relaxed arrays are updated in place at the end.
    schedule : Schedule
    epochs : int
    relaxed : mapping of str to int
        Array name -> ``max_delay`` (``Plan.relaxed``: Buffers' delays, 1 for data-parallel arrays).
    seed : int, optional
        Seeds worker ``w``'s random stream with ``seed + w``.
    options : DataParallelOptions, optional
    first_epoch : int
        Number of the first epoch (it picks the stratum order of a randomised 2D schedule).
    own : list of mappings of str to list of ndarray, optional
        Parameters each worker has its own copy of in each epoch (accumulators): ``own[epoch][name][worker]``.

    Returns
    -------
    list of float
        Each worker's busy seconds (compute only, as ``run_local`` reports).
    """
    options = options or DataParallelOptions()
    names = [n for n in compiled.param_names if n in relaxed]
    ps = LocalPS(table_specs(data.params, {n: relaxed[n] for n in names}), schedule.num_workers,
                 num_shards=options.num_shards, options=options.client)
    for n in names:
        ps.initialize(n, np.asarray(data.params[n]).reshape(ps.specs[n].num_rows, -1))
    tokens = _Tokens()
    by_epoch = [schedule.for_epoch(first_epoch + e) for e in range(epochs)]
    barrier = threading.Barrier(schedule.num_workers) if schedule.epoch_barrier else None
    busy = [0.0] * schedule.num_workers
    errors: list[BaseException] = []
    threads = [threading.Thread(target=_guarded, name=f"orion_par-dp-worker-{w}",
                                args=(errors, tokens, barrier, _worker, w, ps.client(w), compiled, data, by_epoch,
                                      names, tokens, barrier, busy, seed,
                                      [{n: c[w] for n, c in mine.items()} for mine in own or [{}] * epochs]))
               for w in range(schedule.num_workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    for n in names:
        data.params[n][...] = ps.table(n).reshape(np.shape(data.params[n]))
    return busy


def _guarded(errors: list[BaseException], tokens: _Tokens, barrier: threading.Barrier | None, fn: Any,
             *args: Any) -> None:
    try:
        fn(*args)
    except threading.BrokenBarrierError:
        return
    except BaseException as e:
        errors.append(e)
        tokens.fail()
        if barrier is not None:
            barrier.abort()


def _worker(w: int, client: PSClient, compiled: CompiledBody, data: BlockData, by_epoch: list[Schedule],
            names: list[str], tokens: _Tokens, barrier: threading.Barrier | None, busy: list[float],
            seed: int | None, own: list[dict[str, np.ndarray]]) -> None:
    if seed is not None:
        compiled.seed(seed + w)
    replicas = {n: np.array(data.params[n], copy=True) for n in names}
    flat = {n: replicas[n].reshape(replicas[n].shape[0], -1) for n in names}
    base = {n: flat[n].copy() for n in names}
    every_row = {n: np.arange(flat[n].shape[0]) for n in names}
    for epoch, schedule in enumerate(by_epoch):
        accs = own[epoch]
        args = tuple(replicas[n] if n in replicas else accs[n] if n in accs else data.params[n]
                     for n in compiled.param_names)
        mine = schedule.by_worker[w]
        for step in range(schedule.num_steps):
            task = mine.get(step)
            if task is not None:
                tokens.wait(task, epoch, schedule)
                t0 = time.perf_counter()
                compiled.block(data.keys, data.values, int(schedule.block_start[task.block]),
                               int(schedule.block_stop[task.block]), *args)
                busy[w] += time.perf_counter() - t0
                tokens.finish(task)
            _sync(client, names, flat, base, every_row)
        if barrier is not None:
            barrier.wait()
    client.finish()


def _sync(client: PSClient, names: list[str], flat: dict[str, np.ndarray], base: dict[str, np.ndarray],
          every_row: dict[str, np.ndarray]) -> None:
    # Send this step's changes, end the clock, and read back what the staleness bound guarantees.
    for n in names:
        delta = flat[n] - base[n]
        rows = np.flatnonzero(np.any(delta != 0, axis=1))
        if rows.size:
            client.inc(n, rows, delta[rows])
    client.clock()
    for n in names:
        flat[n][...] = client.get(n, every_row[n])
        base[n][...] = flat[n]
