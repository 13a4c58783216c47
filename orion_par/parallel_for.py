"""``parallel_for``: the decorator that turns a serial loop body into a parallel, compiled loop."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numba
import numpy as np

from orion_par import bounds, checks, prefetch
from orion_par.access import Access
from orion_par.accumulate import RETURNED, check_usage, combine, returns_value
from orion_par.analyzer import analyze_body
from orion_par.body import is_missing, is_scalar_constant, load_body, resolve
from orion_par.checks import check_sorted, key_range
from orion_par.codegen import CompiledBody, compile_body, generate_source, injected_globals
from orion_par.distarray import Accumulator, DistArray, identity
from orion_par.elastic.policy import Elastic, ElasticLog
from orion_par.errors import BadBodyError
from orion_par.helpers import CallGraph, body_graph
from orion_par.local import BlockData, run_local
from orion_par.plan import Plan, make_plan
from orion_par.schedule import Schedule, make_schedule
from orion_par.scheme import ParallelScheme

BACKENDS = ("local", "ray")


@dataclass(frozen=True)
class RunStats:
    """What one ``run`` did: records processed, wall time, each worker's compute time."""

    backend: str
    scheme: str
    workers: int
    epochs: int
    records: int
    elapsed_s: float
    busy_s: tuple[float, ...]
    compiled: bool
    cpu_s: tuple[float, ...] = ()  # CPU seconds per worker in blocks (local backend)
    # Per accumulator (orion_par.Accumulator, by name), its value after each epoch: a number for a
    # one-element accumulator, else an array.
    accumulated: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    # Elastic runs (``run(elastic=...)``): windows, transitions and the serial order matched
    # (``orion_par.elastic.loop.ElasticRun``); None otherwise.
    elastic: ElasticLog | None = None

    @property
    def returned(self) -> tuple[float, ...]:
        """The sum of the body's return values over each epoch's records (empty if it returns nothing)."""
        return self.accumulated.get(RETURNED, ())

    @property
    def records_per_s(self) -> float:
        return self.records / self.elapsed_s if self.elapsed_s > 0 else float("inf")

    @property
    def records_per_s_per_worker(self) -> float:
        return self.records_per_s / self.workers


def parallel_for(data: DistArray, *, ordered: bool = False, allow_data_parallel: bool = False,
                 stratum_seed: int | None = 0) -> Callable[[Callable[[Any, Any], Any]], ParallelFor]:
    """Decorate a serial loop body ``def body(key, value)`` over the records of ``data``.

    The body reads and writes arrays (DistArrays, Buffers) reached through its globals or closure.  The
    result is a ``ParallelFor``: ``.plan`` says how it will run and why, ``.run(workers, epochs)`` runs it.

    Parameters
    ----------
    data : DistArray
        A keyed dataset from ``DistArray.from_coo``.
    ordered : bool
        The result must equal the serial loop in data order (which, for a wavefront plan, must be
        sorted by key).  Unordered loops may run in any serial order.
    allow_data_parallel : bool
        Arrays that block every scheme go to the parameter server (merged additively every step)
        instead of raising ``NotParallelizableError``.
    stratum_seed : int or None
        Unordered 2D plans: each block is cut into chunks laid out as Latin squares, so that a row meets a
        small random slice of the columns at each step, and the steps run in a random order; both are
        drawn once from ``stratum_seed`` and repeated every epoch, as the serial loop repeats its one
        order (redrawing every epoch acted like reshuffling the data every epoch and moved the RMSE curve
        away from the serial loop's: ``experiments/results/mf_convergence.orders.md``).  ``None``: no
        permutation, steps in rotation order.  One worker (one stratum) runs the serial loop in data order
        either way.

    Examples
    --------
    >>> import numpy as np
    >>> from orion_par import DistArray, parallel_for
    >>> sums = DistArray(np.zeros(3))
    >>> data = DistArray.from_coo([[0, 1], [2, 1], [2, 0]], [1.0, 2.0, 3.0])
    >>> @parallel_for(data)
    ... def add(key, value):
    ...     sums[key[0]] += value
    >>> add.plan.scheme == "1d"       # only records with the same key[0] touch the same element
    True
    >>> stats = add.run(workers=2)
    >>> sums.tolist()
    [1.0, 0.0, 5.0]
    """
    if not isinstance(data, DistArray) or data.keys is None:
        raise BadBodyError(
            f"parallel_for(data): data must be a keyed dataset from DistArray.from_coo(keys, values); "
            f"got {type(data).__name__}{'' if not isinstance(data, DistArray) else ' without keys'}."
        )

    def wrap(fn: Callable[[Any, Any], Any]) -> ParallelFor:
        return ParallelFor(fn, data, ordered=ordered, allow_data_parallel=allow_data_parallel,
                           stratum_seed=stratum_seed)

    return wrap


class ParallelFor:
    """A loop body bound to its dataset; call it like the body, or ``run`` the whole loop.

    ``epochs_run`` counts the epochs that ``run`` has done; the next ``run`` starts at that epoch's stratum
    order (set it to 0 to replay the orders from the start).  ``stratum_seed`` may be changed between runs.
    """

    def __init__(self, fn: Callable[[Any, Any], Any], data: DistArray, *, ordered: bool,
                 allow_data_parallel: bool, stratum_seed: int | None = 0) -> None:
        self.fn = fn
        self.data = data
        self.ordered = ordered
        self.allow_data_parallel = allow_data_parallel
        self.stratum_seed = stratum_seed
        self.epochs_run = 0
        self.body = load_body(fn)
        self._keys: np.ndarray = data.keys  # type: ignore[assignment]  # checked by parallel_for
        self._key_range: tuple[np.ndarray, np.ndarray] | None = None  # of self._keys, found at the first run
        self._plan: tuple[tuple[Any, ...], Plan] | None = None
        self._schedules: dict[tuple[int, int | None, int | None], tuple[Schedule, BlockData]] = {}
        self._compiled: dict[tuple[Any, ...], CompiledBody] = {}
        self._ray_pool: dict[str, Any] = {}
        self.graph = CallGraph()  # the functions the body calls, found by captured()
        self._returned = Accumulator("sum")  # the sum of the body's return values (accumulate.RETURNED)
        functools.update_wrapper(self, fn)

    def __call__(self, key: Any, value: Any) -> Any:
        return self.fn(key, value)

    def close(self) -> None:
        """End Ray actors kept for reuse between runs (nothing to do for the local backend)."""
        if self._ray_pool:
            from orion_par.ray_backend import close_pool

            close_pool(self._ray_pool)

    # -- plan --------------------------------------------------------------------------------------
    def captured(self) -> dict[str, Any]:
        """Current values of the body's free names and of the data its helpers reach (re-read at every
        run; ``helpers`` gives those their names)."""
        out = {}
        for name in self.body.captured:
            value = resolve(self.fn, name)
            if not is_missing(value):
                out[name] = value
        self.graph = body_graph(self.body, out)
        out.update(self.graph.values())
        return out

    @property
    def plan(self) -> Plan:
        """The parallel plan for the current arrays; ``print(f.plan)`` explains it."""
        return self._current_plan(self.captured())

    def _current_plan(self, captured: dict[str, Any]) -> Plan:
        fingerprint = (tuple(sorted((n, _fingerprint(v)) for n, v in captured.items())),
                       tuple(sorted(self.graph.helpers)))  # the functions it calls (rebinding one replans)
        if self._plan is None or self._plan[0] != fingerprint:
            plan = make_plan(self.body, captured, self._keys, np.asarray(self.data), ordered=self.ordered,
                             allow_data_parallel=self.allow_data_parallel)
            self._plan = (fingerprint, plan)
            self._schedules.clear()
        return self._plan[1]

    def schedule(self, workers: int, time_partitions: int | None = None) -> Schedule:
        """The executor's schedule for ``workers``.

        ``serial_order(epochs, first_epoch)`` is the serial run equal to ``run(workers, epochs)`` started
        when ``epochs_run == first_epoch``.
        """
        return self._prepared(self.plan, workers, time_partitions)[0]

    def _prepared(self, plan: Plan, workers: int, time_partitions: int | None) -> tuple[Schedule, BlockData]:
        key = (workers, time_partitions, self.stratum_seed)
        if key not in self._schedules:
            keys = self._keys
            if plan.scheme is ParallelScheme.TWO_D_ORDERED:
                check_sorted(keys)
            captured = self.captured()
            sched = make_schedule(plan, keys, workers, time_partitions, _space_bytes(plan, captured), self.stratum_seed)
            values = np.ascontiguousarray(np.asarray(self.data)[sched.perm])
            self._schedules[key] = (sched, BlockData(np.ascontiguousarray(keys[sched.perm]), values, {}))
        return self._schedules[key]

    # -- compile -----------------------------------------------------------------------------------
    def _params(self, captured: dict[str, Any], returns: bool = False) -> dict[str, Any]:
        params = {}
        for name, value in captured.items():
            if isinstance(value, np.ndarray):
                params[name] = np.asarray(value)  # numba takes plain ndarrays, not subclasses
            elif is_scalar_constant(value):
                params[name] = value
        if returns:
            params[RETURNED] = np.asarray(self._returned)
        return params

    def compiled_body(self, keys: np.ndarray, values: np.ndarray, params: dict[str, Any],
                      accesses: tuple[Access, ...] = (), boundscheck: bool = False,
                      python_reason: str = "", captured: dict[str, Any] | None = None) -> CompiledBody:
        """The numba-compiled block function for these argument types (or the Python fallback).

        ``accesses`` (the analyzer's): the rows they index with the key are prefetched a few records ahead.
        ``boundscheck``: compiled with every subscript checked.  ``python_reason``: do not compile (numba
        would get this body wrong, ``BodyAnalysis.miscompiles``); run it as Python and say why.  ``captured``:
        ``self.captured()`` if the caller has it (finding the helpers again reads their source).
        """
        names = tuple(sorted(params))
        args = (keys, values, 0, 0, *(params[n] for n in names))
        rows = prefetch.rows(accesses, params)
        if captured is None:
            captured = self.captured()  # also finds the helpers (self.graph)
        source = generate_source(self.body, names, keys.shape[1], rows, self.graph)
        sig = (tuple(numba.typeof(a) for a in args), source, boundscheck, python_reason)  # type: ignore[no-untyped-call]
        if sig not in self._compiled:
            injected = injected_globals(self.body, captured, names, self.graph)
            self._compiled[sig] = compile_body(self.body.name, source, names, injected, args, self.body.line_text,
                                               boundscheck, python_reason)
        return self._compiled[sig]

    # -- run ---------------------------------------------------------------------------------------
    def run(self, workers: int = 1, epochs: int = 1, backend: str = "local", *,
            time_partitions: int | None = None, seed: int | None = None, check_bounds: bool = False,
            elastic: Elastic | None = None) -> RunStats:
        """Run the loop ``epochs`` times over the data with ``workers`` workers.

        Parameters
        ----------
        workers : int
            Threads (``"local"``) or Ray actors (``"ray"``).
        epochs : int
        backend : {"local", "ray"}
            ``"ray"`` starts a local Ray if none is running (and shuts it down afterwards).
        time_partitions : int, optional
            Time partitions (2D) or sub-blocks per worker; default ``2 * workers``.
        seed : int, optional
            Seeds each worker's ``np.random`` stream (``seed + worker``) for reproducible runs.  The
            order of the blocks is set by ``stratum_seed`` and ``epochs_run``, not by this.
        check_bounds : bool
            Compile with every subscript checked.  Subscripts tied to the key are always checked before
            the run; without this, a subscript computed from data that falls outside its array reads or
            writes memory it does not own (wrong values, or the process dies).  With it, such a subscript
            raises ``BadBodyError`` naming the body's line and the record, and the arrays are left as they
            were before the run.  Checked code runs slower.
        elastic : orion_par.elastic.Elastic, optional
            Resize the job while it runs (``backend="ray"``): ``workers`` is the starting count, the
            policy changes it at window boundaries and replaces stragglers; ``RunStats.elastic`` logs every
            transition, and its ``serial_order()`` is the serial run the result equals.

        Returns
        -------
        RunStats
        """
        if backend not in BACKENDS:
            raise BadBodyError(f"run(backend={backend!r}): choose one of {BACKENDS}.")
        if not isinstance(epochs, int) or epochs < 0:
            raise BadBodyError(f"run(epochs={epochs!r}): epochs must be an int >= 0.")
        captured = self.captured()
        plan = self._current_plan(captured)
        if elastic is not None:
            return self._run_elastic(captured, plan, workers, epochs, backend, time_partitions, seed, check_bounds,
                                     elastic)
        sched, data, compiled = self._ready_to_run(captured, plan, workers, time_partitions, check_bounds)
        snapshot = bounds.snapshot(data.params) if check_bounds else None
        cpu: list[float] = []
        accs = {n: op for n, op in plan.accumulators.items() if n in data.params}
        epoch_values: list[dict[str, np.ndarray]] = []
        t0 = time.perf_counter()
        try:
            busy = self._run_backend(backend, compiled, data, sched, epochs, plan, seed, cpu, accs, epoch_values)
        except IndexError as e:
            if snapshot is None:
                raise
            order = sched.serial_order(epochs, self.epochs_run)
            raise bounds.locate(self.body, compiled, snapshot, data.params, self._keys, np.asarray(self.data), order) from e
        elapsed = time.perf_counter() - t0
        self.epochs_run += epochs
        return RunStats(backend, str(plan.scheme), workers, epochs, int(sched.perm.size) * epochs, elapsed,
                        tuple(busy), compiled.compiled, tuple(cpu), _per_epoch(epoch_values))

    def _ready_to_run(self, captured: dict[str, Any], plan: Plan, workers: int, time_partitions: int | None,
                      check_bounds: bool) -> tuple[Schedule, BlockData, CompiledBody]:
        """The schedule, the block data with this run's parameters (subscripts checked) and the compiled body."""
        sched, data = self._prepared(plan, workers, time_partitions)
        data.params = self._params(captured, RETURNED in plan.accumulators)
        if self._key_range is None:
            self._key_range = key_range(self._keys)
        checks.check_bounds(plan.accesses, plan.key_names, data.keys, data.params, self._key_range)
        compiled = self.compiled_body(data.keys, data.values, data.params, plan.accesses, check_bounds,
                                      plan.miscompiles, captured)
        return sched, data, compiled

    def _run_elastic(self, captured: dict[str, Any], plan: Plan, workers: int, epochs: int, backend: str,
                     time_partitions: int | None, seed: int | None, check_bounds: bool, elastic: Any) -> RunStats:
        from orion_par.elastic.loop import ElasticDriver, check_elastic

        elastic = check_elastic(elastic, backend, plan, workers)
        _, data, compiled = self._ready_to_run(captured, plan, workers, time_partitions, check_bounds)

        space_bytes = _space_bytes(plan, captured)

        def make(count: int, records: np.ndarray | None = None) -> Schedule:
            """A count's whole-epoch schedule (cached, like plain runs'), or one over ``records`` only."""
            if records is None:
                return self._prepared(plan, count, time_partitions)[0]
            return make_schedule(plan, self._keys[records], count, time_partitions, space_bytes, self.stratum_seed)

        accs = {n: op for n, op in plan.accumulators.items() if n in data.params}
        _reset(accs, data.params)
        driver = ElasticDriver(compiled, data, plan, make, self._keys, np.asarray(self.data), elastic, seed)
        epoch_values: list[dict[str, np.ndarray]] = []
        t0 = time.perf_counter()
        busy = driver.run(workers, epochs, self.epochs_run, epoch_values)
        elapsed = time.perf_counter() - t0
        self.epochs_run += driver.epochs_started  # fewer than ``epochs`` if Elastic.stop ended it early
        records = int(sum(w.work for w in driver.log.windows))
        return RunStats(backend, str(plan.scheme), workers, driver.epochs_started, records, elapsed,
                        tuple(busy), compiled.compiled, (), _per_epoch(epoch_values), driver.log)

    def _run_backend(self, backend: str, compiled: CompiledBody, data: BlockData, sched: Schedule, epochs: int,
                     plan: Plan, seed: int | None, cpu: list[float], accs: Mapping[str, str],
                     epoch_values: list[dict[str, np.ndarray]]) -> list[float]:
        workers = sched.num_workers
        if backend == "ray":
            from orion_par.ray_backend import run_ray

            _reset(accs, data.params)
            busy = run_ray(compiled, data, sched, epochs, plan, seed, self._ray_pool, first_epoch=self.epochs_run,
                           epoch_values=epoch_values)
        else:
            # Every epoch's accumulators start at the identity, in private copies per worker.
            own = [{n: [np.full_like(data.params[n], identity(op, data.params[n].dtype)) for _ in range(workers)]
                    for n, op in accs.items()} for _ in range(epochs)] if accs else None
            busy = self._run_local(compiled, data, sched, epochs, plan, seed, cpu, self.epochs_run, own)
            for mine in own or []:
                for n, copies in mine.items():
                    combine(accs[n], copies, data.params[n])
                epoch_values.append({n: np.array(data.params[n], copy=True) for n in accs})
        return busy

    def _run_local(self, compiled: CompiledBody, data: BlockData, sched: Schedule, epochs: int, plan: Plan,
                   seed: int | None, cpu: list[float], first_epoch: int,
                   own: list[dict[str, list[np.ndarray]]] | None) -> list[float]:
        if plan.data_parallel and sched.num_workers > 1:
            # Arrays no scheme can partition live in the parameter server (orion_par.ps), one table each.
            from orion_par.ps.data_parallel import run_data_parallel

            return run_data_parallel(compiled, data, sched, epochs, plan.relaxed, seed, first_epoch=first_epoch,
                                     own=own)
        return run_local(compiled, data, sched, epochs, plan.relaxed, seed, cpu, first_epoch=first_epoch, own=own)

    def run_serial(self, order: np.ndarray | None = None, epochs: int = 1, *, seed: int | None = None,
                   check_bounds: bool = False) -> RunStats:
        """Run the compiled body serially in this thread, over ``order`` (default: data order).

        With ``order=f.schedule(w).serial_order(epochs, f.epochs_run)`` this is the serial run that
        ``run(workers=w, epochs=epochs)`` equals.  It does not advance ``epochs_run``.  ``check_bounds``
        as in ``run``.
        """
        captured = self.captured()
        returns = returns_value(self.body)
        params = self._params(captured, returns)
        analysis = analyze_body(self.body, captured, self._keys.shape[1], np.ndim(self.data), self.graph)
        accs = {n: v.op for n, v in captured.items() if isinstance(v, Accumulator)}
        check_usage(self.body, accs, {a.array: a.line for a in analysis.accesses if a.via and a.array in accs})
        if returns:
            accs[RETURNED] = "sum"
        t0 = time.perf_counter()  # gathering the records in `order` is part of the serial run's work
        idx = np.arange(self.data.num_records) if order is None else np.asarray(order, dtype=np.int64)
        keys = np.ascontiguousarray(self._keys[idx])
        values = np.ascontiguousarray(np.asarray(self.data)[idx])
        gathered = time.perf_counter() - t0
        checks.check_bounds(analysis.accesses, analysis.key_names, keys, params)
        compiled = self.compiled_body(keys, values, params, analysis.accesses, check_bounds, analysis.miscompiles,
                                      captured)
        snapshot = bounds.snapshot(params) if check_bounds else None
        if seed is not None:
            compiled.seed(seed)
        args = tuple(params[n] for n in compiled.param_names)
        epoch_values = []
        t0 = time.perf_counter()
        try:
            for _ in range(epochs):
                _reset(accs, params)
                compiled.block(keys, values, 0, keys.shape[0], *args)
                epoch_values.append({n: np.array(params[n], copy=True) for n in accs})
        except IndexError as e:
            if snapshot is None:
                raise
            raise bounds.locate(self.body, compiled, snapshot, params, self._keys, np.asarray(self.data),
                                np.tile(idx, epochs)) from e
        elapsed = time.perf_counter() - t0 + gathered
        return RunStats("serial", "serial", 1, epochs, int(idx.size) * epochs, elapsed, (elapsed,), compiled.compiled,
                        accumulated=_per_epoch(epoch_values))


def _reset(accs: Mapping[str, str], params: Mapping[str, Any]) -> None:
    for name, op in accs.items():
        params[name][...] = identity(op, params[name].dtype)


def _space_bytes(plan: Plan, captured: Mapping[str, Any]) -> int:
    """Bytes of the arrays that stay with their space partition (``make_schedule``'s ``space_bytes``)."""
    return sum(int(captured[n].nbytes) for n in plan.space_arrays if n in captured)


def _per_epoch(values: list[dict[str, np.ndarray]]) -> dict[str, tuple[Any, ...]]:
    names = values[0].keys() if values else ()
    return {n: tuple(v[n].reshape(-1)[0].item() if v[n].size == 1 else v[n] for v in values) for n in names}


def _fingerprint(value: Any) -> Any:
    # What the plan depends on: array ranks and buffer delays, and integer constants (they fold into
    # subscripts such as key[0] + OFFSET).
    if isinstance(value, np.ndarray):
        return ("array", value.ndim, type(value).__name__, getattr(value, "max_delay", None), getattr(value, "op", None))
    if isinstance(value, (int, np.integer)):
        return ("int", int(value))
    return (type(value).__name__,)
