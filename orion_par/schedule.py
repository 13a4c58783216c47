"""The executor's static schedule: which block each worker runs at each step, and in what order.

Records are grouped into blocks (space part x time part); a ``Task`` is one worker running one block at
one step.  Every task holds a *token* (its time partition in 2D, its own sub-block otherwise); the uses
of a token are ordered by step and a task waits for the previous use to finish.  That one rule gives the
DSGD rotation (2D), independent workers (1D, none) and the wavefront (ordered 2D), and makes the run
equal to the serial run of the tasks in ``(epoch, step, worker)`` order: ``serial_order``.

Stratum order (unordered 2D).  The blocks one step runs form a *stratum*: no two share a space part (a
worker) or a time part (a token).  With ``stratum_seed=None`` every epoch runs the same rotation, worker
``p`` taking time part ``(p + k) % t`` at step ``k``.  With a seed, as in DSGD (Gemulla et al., KDD 2011),
epoch ``e`` draws its stratum sequence from ``np.random.default_rng([stratum_seed, e])``: a random
relabelling ``pi`` of the time parts and a random order ``sigma`` of the steps, so worker ``p`` takes time
part ``pi[(p + k) % t]`` at step ``sigma[k]``.  Each stratum is still conflict-free and each epoch still
runs every block once; only the order of the blocks changes, and it is the same for a given seed and
epoch on every executor.  A fixed rotation repeats the same sequence of (user part, item part) pairs
every epoch; on ``experiments.orion_vs_dataparallel`` it needs more epochs than serial SGD to reach the
later RMSE targets, and the random sequence reaches them sooner (results in
``experiments/results/orion_vs_dataparallel.md``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
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
    """One epoch's tasks, sorted by ``(step, worker)``; ``for_epoch(e)`` has epoch ``e``'s (see the module doc).

    Attributes
    ----------
    perm : ndarray
        Record indices grouped by block, data order inside each block.
    block_start, block_stop : ndarray
        Block ``b`` is ``perm[block_start[b]:block_stop[b]]``.
    epoch_barrier : bool
        Whether epoch ``e + 1`` may only start once epoch ``e`` is finished (wavefronts).
    stratum_seed : int or None
        Unordered 2D with more than one step: each epoch's stratum order is drawn from this seed; None
        repeats ``tasks`` (the fixed rotation) every epoch.  Other schemes always repeat ``tasks``.
    """

    scheme: ParallelScheme
    num_workers: int
    num_steps: int
    perm: np.ndarray
    block_start: np.ndarray
    block_stop: np.ndarray
    tasks: tuple[Task, ...]
    epoch_barrier: bool
    stratum_seed: int | None = None

    @property
    def randomised(self) -> bool:
        """Whether epochs differ in their stratum order."""
        return self.stratum_seed is not None and self.scheme is ParallelScheme.TWO_D and self.num_steps > 1

    def for_epoch(self, epoch: int) -> Schedule:
        """Epoch ``epoch``'s schedule: the same blocks, tasks in its stratum order (``self`` if fixed)."""
        if not self.randomised:
            return self
        cache = self._epochs
        if epoch not in cache:
            t = self.num_steps
            rng = np.random.default_rng([int(self.stratum_seed), epoch])  # type: ignore[arg-type]
            relabel, step_of = rng.permutation(t), rng.permutation(t)
            # In the rotation, task (p, k) holds token (p + k) % t and runs block p * t + token.
            tasks = sorted((Task(x.worker, int(step_of[x.step]), x.worker * t + int(relabel[x.token]),
                                 int(relabel[x.token])) for x in self.tasks), key=lambda x: (x.step, x.worker))
            cache[epoch] = replace(self, tasks=tuple(tasks), stratum_seed=None)
        return cache[epoch]

    @cached_property
    def _epochs(self) -> dict[int, Schedule]:
        return {}

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

    def serial_order(self, epochs: int = 1, first_epoch: int = 0) -> np.ndarray:
        """Record indices in the order of a serial run equivalent to the parallel one.

        The order of epochs ``first_epoch`` to ``first_epoch + epochs - 1``, one after another.
        """
        if not self.randomised:
            one = np.concatenate([self.block_records(t.block) for t in self.tasks] or [np.zeros(0, np.int64)])
            return np.tile(one, epochs)
        return np.concatenate([self.for_epoch(e).serial_order() for e in range(first_epoch, first_epoch + epochs)]
                              or [np.zeros(0, np.int64)])

    def worker_sizes(self) -> np.ndarray:
        """Records each worker processes per epoch."""
        sizes = np.zeros(self.num_workers, np.int64)
        for t in self.tasks:
            sizes[t.worker] += self.block_stop[t.block] - self.block_start[t.block]
        return sizes


def make_schedule(plan: Plan, keys: np.ndarray, num_workers: int, time_parts: int | None = None,
                  space_bytes: int = 0, stratum_seed: int | None = 0) -> Schedule:
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
    stratum_seed : int or None
        Unordered 2D: seed of the per-epoch random stratum order (default 0); None keeps the fixed
        rotation every epoch.  Ignored by other schemes and by a single-step schedule (one worker).
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
    return Schedule(plan.scheme, num_workers, steps, perm, stop - counts, stop, tuple(tasks), barrier,
                    stratum_seed if plan.scheme is ParallelScheme.TWO_D else None)


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
