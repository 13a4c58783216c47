"""The executor's static schedule: which block each worker runs at each step, and in what order.

Records are grouped into blocks (space part x time part); a ``Task`` is one worker running one block at
one step.  Every task holds a *token* (its time partition in 2D, its own sub-block otherwise); the uses
of a token are ordered by step and a task waits for the previous use to finish.  That one rule gives the
DSGD rotation (2D), independent workers (1D, none) and the wavefront (ordered 2D), and makes the run
equal to the serial run of the tasks in ``(epoch, step, worker)`` order: ``serial_order``.

Fine strata (unordered 2D).  The serial loop visits its records in one order every epoch, typically a
random one.  To stay statistically close to it, each block (worker ``p``'s space part x time part ``g``)
is cut into ``m`` *chunks*: ``p``'s part into ``m`` space sub-parts ``a``, ``g`` into ``m`` time sub-parts
``b``, and chunk ``j`` holds the pairs with ``(pi[b] + rho[a]) % m == j`` (a Latin square: in one chunk each
space sub-part meets one time sub-part, and over the ``m`` chunks it meets each once).  An epoch has
``t * m`` steps; at each, worker ``p`` runs one chunk of the block whose time part it holds in the rotation
(``(p + k) % t`` at coarse step ``k``), in runs of ``_RUN`` consecutive chunks of one block (so a token
changes hands every ``_RUN`` steps), and the runs in a random order.  So a key value meets a small random
slice of the other field's values at each step, as in a random order, instead of all of one time part in
one burst.  ``pi``, ``rho`` and the step order are drawn once from
``np.random.default_rng(stratum_seed)`` and repeated every epoch, like the serial loop's one order
(``stratum_seed=None``: identity permutations and steps in rotation order).  Measured on MF at lr 0.03
(``experiments/results/mf_convergence.orders.md``): drawing them anew each epoch behaves like reshuffling
the data every epoch, which lowers the RMSE of epochs 2-4 and of the last one by 0.2-0.9% against a serial
loop that keeps its order; coarse blocks (``m = 1``) let key values fit one slice of the other field for a
whole step and lag the serial loop by about an epoch in the steep phase.  ``m`` is as large as keeps a
chunk above ``_MIN_CHUNK`` records (at most ``_MAX_CHUNKS``), so each step still amortises its hand-over;
plans with relaxed arrays (merged at a barrier every few steps) keep whole blocks (``m = 1``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from orion_par.partition import Partitioning, partition_by_key, partition_by_position, partition_by_whole_key
from orion_par.plan import Plan
from orion_par.scheme import ParallelScheme

_MIN_CHUNK = 4096  # records per chunk at least: a step's hand-over of the token costs tens of microseconds
_MAX_CHUNKS = 64  # chunks per block at most (finer brings no measured gain on MF)
_RUN = 4  # chunks of one block at consecutive steps: a worker hands its token over every _RUN steps
_CACHE_BYTES = 256 * 1024  # whole blocks (no chunks): rows a run of records should touch, well inside L2


@dataclass(frozen=True)
class Task:
    """Worker ``worker`` runs block ``block`` at ``step``, holding token ``token``."""

    worker: int
    step: int
    block: int
    token: int


@dataclass(frozen=True)
class Schedule:
    """One epoch's tasks, sorted by ``(step, worker)``; every epoch runs them in this order.

    Attributes
    ----------
    perm : ndarray
        Record indices grouped by block, data order inside each block.
    block_start, block_stop : ndarray
        Block ``b`` is ``perm[block_start[b]:block_stop[b]]``.
    epoch_barrier : bool
        Whether epoch ``e + 1`` may only start once epoch ``e`` is finished (wavefronts).
    stratum_seed : int or None
        Unordered 2D: the seed the chunks and the step order were drawn from (None: not drawn).
    chunks : int
        Unordered 2D: chunks per block (``m`` in the module doc); 1 otherwise.
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
    chunks: int = 1

    def for_epoch(self, epoch: int) -> Schedule:
        """Epoch ``epoch``'s schedule: ``self`` (every epoch repeats one order, as the serial loop does)."""
        return self

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

    def runs(self, w: int, merge: bool = True) -> dict[int, tuple[Task, int, int, int]]:
        """Worker ``w``'s calls by first step: (first task, tasks in the call, record start, record stop).

        With ``merge``, tasks at consecutive steps that are consecutive uses of one token over adjacent
        record ranges (a 2D block's chunks in one run) become one call: no other task can use the token in
        between, so the run is the same, with one wait and one hand-over instead of one per task.
        """
        out: dict[int, tuple[Task, int, int, int]] = {}
        first = last = -1
        for step in range(self.num_steps):
            task = self.by_worker[w].get(step)
            if task is None:
                continue
            start, stop = int(self.block_start[task.block]), int(self.block_stop[task.block])
            if first >= 0:
                head, count, s0, s1 = out[first]
                if (merge and last == step - 1 and head.token == task.token and s1 == start
                        and self.token_use[task][0] == self.token_use[head][0] + count):
                    out[first], last = (head, count + 1, s0, stop), step
                    continue
            out[step], first, last = (task, 1, start, stop), step, step
        return out

    @cached_property
    def calls(self) -> tuple[np.ndarray, ...]:
        """Per worker, one epoch's merged calls (``runs``) as int64 rows: record start, record stop, token,
        uses of the token before it in the epoch, tasks in the call, uses of the token per epoch."""
        out = []
        for w in range(self.num_workers):
            rows = [(start, stop, task.token, *self.token_use[task][:1], count, self.token_use[task][1])
                    for task, count, start, stop in self.runs(w).values()]
            out.append(np.array(rows, np.int64).reshape(-1, 6))
        return tuple(out)

    def block_records(self, block: int) -> np.ndarray:
        return self.perm[self.block_start[block]:self.block_stop[block]]

    def serial_order(self, epochs: int = 1, first_epoch: int = 0) -> np.ndarray:
        """Record indices in the order of a serial run equivalent to the parallel one.

        The order of epochs ``first_epoch`` to ``first_epoch + epochs - 1``, one after another.
        """
        one = np.concatenate([self.block_records(t.block) for t in self.tasks] or [np.zeros(0, np.int64)])
        return np.tile(one, epochs)

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
        Bytes of the arrays that stay with their space partition: an unordered 2D block that is not cut
        into chunks (relaxed arrays) visits its records in finer space parts of about ``_CACHE_BYTES``.
    stratum_seed : int or None
        Unordered 2D: seed of the chunks' Latin squares and of the step order, drawn once and repeated
        every epoch (default 0); None: identity permutations, steps in rotation order.  Ignored by other
        schemes.  An unordered 2D plan on one worker with default time partitions is one block in data
        order.
    """
    if num_workers < 1:
        raise ValueError(f"workers must be >= 1; got {num_workers}")
    two_d = plan.scheme is ParallelScheme.TWO_D
    # One worker on an unordered 2D plan: one block in data order, i.e. exactly the serial loop (nothing
    # runs beside it, so rotation and cache-sized sub-blocks would only change the order).
    t_parts = time_parts or (1 if two_d and num_workers == 1 else 2 * num_workers)
    if plan.scheme in (ParallelScheme.TWO_D, ParallelScheme.TWO_D_ORDERED) and t_parts < num_workers:
        raise ValueError(f"time_partitions ({t_parts}) must be >= workers ({num_workers}) for a 2D plan")
    if plan.scheme is ParallelScheme.TWO_D_ORDERED:
        space = partition_by_key(keys, plan.space_dim, num_workers, contiguous=True)  # type: ignore[arg-type]
        time = partition_by_key(keys, plan.time_dim, t_parts, contiguous=True)  # type: ignore[arg-type]
        tasks = [Task(i, i + j, i * t_parts + j, j) for i in range(num_workers) for j in range(t_parts)]
        steps, barrier = num_workers + t_parts - 1, True
    elif plan.scheme is ParallelScheme.TWO_D:
        return _fine_2d(plan, keys, num_workers, t_parts, stratum_seed, space_bytes)
    else:
        space = _independent_parts(plan, keys, num_workers)
        time = _sub_blocks(space, t_parts)
        tasks = [Task(p, k, p * t_parts + k, p * t_parts + k) for p in range(num_workers) for k in range(t_parts)]
        steps, barrier = t_parts, False
    return _assemble(plan.scheme, num_workers, steps, space.part * t_parts + time.part, num_workers * t_parts,
                     tasks, barrier)


def _assemble(scheme: ParallelScheme, num_workers: int, steps: int, block: np.ndarray, num_blocks: int,
              tasks: list[Task], barrier: bool, stratum_seed: int | None = None, chunks: int = 1,
              within: np.ndarray | None = None) -> Schedule:
    # Group the records by block (and by `within` inside a block), keeping data order inside each group.
    key = block if within is None else block * (int(within.max(initial=0)) + 1) + within
    perm = np.argsort(key, kind="stable").astype(np.int64)
    counts = np.bincount(block, minlength=num_blocks) if block.size else np.zeros(num_blocks, np.int64)
    stop = np.cumsum(counts)
    tasks.sort(key=lambda t: (t.step, t.worker))
    return Schedule(scheme, num_workers, steps, perm, stop - counts, stop, tuple(tasks), barrier, stratum_seed, chunks)


def num_chunks(plan: Plan, num_records: int, num_workers: int, t_parts: int) -> int:
    """Chunks per block of an unordered 2D schedule: as many as keep a chunk above ``_MIN_CHUNK`` records.

    One when a single block is the whole epoch (the serial loop in data order), and with relaxed arrays
    (Buffers, data-parallel arrays): they are merged every few *steps*, at a barrier, and finer steps would
    multiply the barriers.
    """
    if (num_workers == 1 and t_parts == 1) or plan.relaxed:
        return 1
    return int(np.clip(num_records // (num_workers * t_parts * _MIN_CHUNK), 1, _MAX_CHUNKS))


def _sub_parts(keys: np.ndarray, dim: int, coarse: np.ndarray, num_coarse: int, m: int) -> np.ndarray:
    # Within each coarse part, m finer parts of the key field (balanced by counts, ranges when as balanced).
    sub = np.zeros(keys.shape[0], np.int64)
    if m == 1:
        return sub
    for c in range(num_coarse):
        idx = np.flatnonzero(coarse == c)
        if idx.size:
            sub[idx] = partition_by_key(keys[idx], dim, m, prefer_ranges=True).part
    return sub


def _fine_2d(plan: Plan, keys: np.ndarray, num_workers: int, t_parts: int, stratum_seed: int | None,
             space_bytes: int) -> Schedule:
    """Unordered 2D: blocks cut into Latin-square chunks, steps in a seeded random order (module doc)."""
    space = partition_by_key(keys, plan.space_dim, num_workers, prefer_ranges=True)  # type: ignore[arg-type]
    time = partition_by_key(keys, plan.time_dim, t_parts, prefer_ranges=True)  # type: ignore[arg-type]
    m = num_chunks(plan, keys.shape[0], num_workers, t_parts)
    within = None
    if m == 1 and t_parts > 1:
        # Whole blocks (relaxed arrays): a block visits its records by finer space parts of about
        # _CACHE_BYTES of rows each, so the rows a stretch of records touches fit in a core's L2 cache.
        sub = int(np.clip(-(-space_bytes // (num_workers * _CACHE_BYTES)), 1, 64))
        fine = partition_by_key(keys, plan.space_dim, num_workers * sub, prefer_ranges=True)  # type: ignore[arg-type]
        space, within = Partitioning(plan.space_dim, num_workers, fine.part % num_workers), fine.part // num_workers
    a = _sub_parts(keys, plan.space_dim, space.part, num_workers, m)  # type: ignore[arg-type]
    b = _sub_parts(keys, plan.time_dim, time.part, t_parts, m)  # type: ignore[arg-type]
    run = max(1, min(_RUN, m))
    runs = -(-m // run)  # run r of a block: its chunks r * run ... (r + 1) * run - 1, at consecutive steps
    if stratum_seed is None:
        pi, rho, seq = np.arange(m), np.arange(m), np.arange(t_parts * runs)
    else:
        rng = np.random.default_rng(stratum_seed)
        pi, rho, seq = rng.permutation(m), rng.permutation(m), rng.permutation(t_parts * runs)
    # seq: the order of the runs (k, r), numbered k * runs + r; a run's chunks follow each other.
    length = np.minimum(run, m - (np.arange(t_parts * runs) % runs) * run)
    start = np.empty(t_parts * runs, np.int64)
    start[seq] = np.cumsum(length[seq]) - length[seq]
    step_of = np.array([start[k * runs + j // run] + j % run for k in range(t_parts) for j in range(m)], np.int64)
    # Block (p, g) = worker p's space part x time part g; its chunk j is block id (p * t + g) * m + j.
    block = (space.part * t_parts + time.part) * m + (pi[b] + rho[a]) % m
    tasks = []
    for p in range(num_workers):
        for k in range(t_parts):
            g = (p + k) % t_parts  # the rotation: worker p holds time part g at coarse step k
            tasks += [Task(p, int(step_of[k * m + j]), (p * t_parts + g) * m + j, g) for j in range(m)]
    return _assemble(ParallelScheme.TWO_D, num_workers, t_parts * m, block, num_workers * t_parts * m, tasks,
                     False, stratum_seed, m, within)


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
