"""The executor's static schedule: which block each worker runs at each step, and in what order.

Records are grouped into blocks (space part x time part); a ``Task`` is one worker running one block at
one step.  Every task holds a *token* (its time partition in 2D, its own sub-block otherwise); the uses
of a token are ordered by step and a task waits for the previous use to finish.  That one rule gives the
DSGD rotation (2D), independent workers (1D, none) and the wavefront (ordered 2D), and makes the run
equal to the serial run of the tasks in ``(epoch, step, worker)`` order: ``serial_order``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from orion_par.partition import Partitioning, partition_by_key, partition_by_position, partition_by_whole_key
from orion_par.plan import Plan
from orion_par.scheme import ParallelScheme

_CACHE_BYTES = 256 * 1024  # rows a run of records should touch: well inside a core's L2


@dataclass(frozen=True)
class Task:
    """Worker ``worker`` runs block ``block`` at ``step``, holding token ``token``."""

    worker: int
    step: int
    block: int
    token: int


@dataclass(frozen=True)
class Schedule:
    """One epoch's tasks, sorted by ``(step, worker)``; the same tasks repeat every epoch.

    Attributes
    ----------
    perm : ndarray
        Record indices grouped by block, data order inside each block.
    block_start, block_stop : ndarray
        Block ``b`` is ``perm[block_start[b]:block_stop[b]]``.
    epoch_barrier : bool
        Whether epoch ``e + 1`` may only start once epoch ``e`` is finished (wavefronts).
    """

    scheme: ParallelScheme
    num_workers: int
    num_steps: int
    perm: np.ndarray
    block_start: np.ndarray
    block_stop: np.ndarray
    tasks: tuple[Task, ...]
    epoch_barrier: bool

    @cached_property
    def by_worker(self) -> tuple[dict[int, Task], ...]:
        out: list[dict[int, Task]] = [{} for _ in range(self.num_workers)]
        for t in self.tasks:
            out[t.worker][t.step] = t
        return tuple(out)

    @cached_property
    def token_use(self) -> dict[Task, tuple[int, int]]:
        """For each task: (index of this use of its token within an epoch, uses of the token per epoch)."""
        uses: dict[int, list[Task]] = {}
        for t in self.tasks:  # tasks are sorted by step, so uses come in step order
            uses.setdefault(t.token, []).append(t)
        return {t: (i, len(us)) for us in uses.values() for i, t in enumerate(us)}

    def block_records(self, block: int) -> np.ndarray:
        return self.perm[self.block_start[block]:self.block_stop[block]]

    def serial_order(self, epochs: int = 1) -> np.ndarray:
        """Record indices in the order of a serial run equivalent to the parallel one."""
        one = np.concatenate([self.block_records(t.block) for t in self.tasks] or [np.zeros(0, np.int64)])
        return np.tile(one, epochs)

    def worker_sizes(self) -> np.ndarray:
        """Records each worker processes per epoch."""
        sizes = np.zeros(self.num_workers, np.int64)
        for t in self.tasks:
            sizes[t.worker] += self.block_stop[t.block] - self.block_start[t.block]
        return sizes


def make_schedule(plan: Plan, keys: np.ndarray, num_workers: int, time_parts: int | None = None,
                  space_bytes: int = 0) -> Schedule:
    """Partition the records and lay out the tasks for ``plan``.

    Parameters
    ----------
    plan : Plan
    keys : ndarray, shape (n, d)
    num_workers : int
    time_parts : int, optional
        Time partitions (2D) or sub-blocks per worker (other schemes); default ``2 * num_workers``, more
        than the workers so a slow block delays its neighbours less (an unordered 2D plan on one worker:
        1, so that the run is the serial loop in data order).
    space_bytes : int
        Bytes of the arrays that stay with their space partition (2D): a block visits its records in
        finer space parts of about ``_CACHE_BYTES`` each.
    """
    if num_workers < 1:
        raise ValueError(f"workers must be >= 1; got {num_workers}")
    two_d = plan.scheme is ParallelScheme.TWO_D
    # One worker on an unordered 2D plan: one block in data order, i.e. exactly the serial loop (nothing
    # runs beside it, so rotation and cache-sized sub-blocks would only change the order).
    t_parts = time_parts or (1 if two_d and num_workers == 1 else 2 * num_workers)
    if plan.scheme in (ParallelScheme.TWO_D, ParallelScheme.TWO_D_ORDERED) and t_parts < num_workers:
        raise ValueError(f"time_partitions ({t_parts}) must be >= workers ({num_workers}) for a 2D plan")
    n = keys.shape[0]
    within = np.zeros(n, np.int64)
    if plan.scheme is ParallelScheme.TWO_D_ORDERED:
        space = partition_by_key(keys, plan.space_dim, num_workers, contiguous=True)  # type: ignore[arg-type]
        time = partition_by_key(keys, plan.time_dim, t_parts, contiguous=True)  # type: ignore[arg-type]
        tasks = [Task(i, i + j, i * t_parts + j, j) for i in range(num_workers) for j in range(t_parts)]
        steps, barrier = num_workers + t_parts - 1, True
    elif plan.scheme is ParallelScheme.TWO_D:
        # Each worker's space part is cut into `sub` finer parts and a block runs them one after
        # another, so the rows a stretch of records touches fit in a core's L2 cache.  Any order inside
        # a block is a serial order of an unordered loop, and serial_order() reports this one.
        sub = int(np.clip(-(-space_bytes // (num_workers * _CACHE_BYTES)), 1, 64)) if t_parts > 1 else 1
        fine = partition_by_key(keys, plan.space_dim, num_workers * sub, prefer_ranges=True)  # type: ignore[arg-type]
        space = Partitioning(plan.space_dim, num_workers, fine.part % num_workers)
        within = fine.part // num_workers
        time = partition_by_key(keys, plan.time_dim, t_parts, prefer_ranges=True)  # type: ignore[arg-type]
        tasks = [Task(p, k, p * t_parts + (p + k) % t_parts, (p + k) % t_parts)
                 for p in range(num_workers) for k in range(t_parts)]
        steps, barrier = t_parts, False
    else:
        space = _independent_parts(plan, keys, num_workers)
        time = _sub_blocks(space, t_parts)
        tasks = [Task(p, k, p * t_parts + k, p * t_parts + k) for p in range(num_workers) for k in range(t_parts)]
        steps, barrier = t_parts, False
    block = space.part * t_parts + time.part
    perm = np.argsort(block * (int(within.max(initial=0)) + 1) + within, kind="stable").astype(np.int64)
    counts = np.bincount(block, minlength=num_workers * t_parts) if n else np.zeros(num_workers * t_parts, np.int64)
    stop = np.cumsum(counts)
    tasks.sort(key=lambda t: (t.step, t.worker))
    return Schedule(plan.scheme, num_workers, steps, perm, stop - counts, stop, tuple(tasks), barrier)


def _independent_parts(plan: Plan, keys: np.ndarray, num_workers: int) -> Partitioning:
    if plan.scheme is ParallelScheme.ONE_D:
        return partition_by_key(keys, plan.space_dim, num_workers, prefer_ranges=True)  # type: ignore[arg-type]
    if plan.dependences:  # only records with identical keys conflict: keep them together
        return partition_by_whole_key(keys, num_workers)
    return partition_by_position(keys.shape[0], num_workers)


def _sub_blocks(space: Partitioning, t_parts: int) -> Partitioning:
    # Split each worker's records, in data order, into t_parts consecutive runs.
    part = np.zeros(space.part.size, np.int64)
    for p in range(space.num_parts):
        idx = np.flatnonzero(space.part == p)
        part[idx] = partition_by_position(idx.size, t_parts).part
    return Partitioning(None, t_parts, part)
