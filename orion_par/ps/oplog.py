"""The client's oplog (increments coalesced per row) and managed communication's row priorities.

Between clocks, a worker's increments to one row are summed into a single delta, so a row is sent once
however often it was updated.  Managed communication (Bösen, SoCC'15) sends part of the oplog before the
clock boundary when there is bandwidth to spare; which rows go first is the policy:

* ``"magnitude"``: largest relative change first, ``sum |delta| / sum |value|`` (Bösen's choice: rows whose
  updates matter most to readers).  A row with small values scores high for a small change: in LDA those
  are the rows of rare words, which few tokens read (``experiments/managed_comm`` measured it);
* ``"consumption"``: the rows that will be read soonest first, estimated by the order in which this worker
  first read each row during its previous clock (P3, SysML'19: layers consumed first are sent first);
* ``"absolute"``: largest accumulated change first, ``sum |delta|`` (rows whose values moved most);
* ``"random"``: no priority, dirty rows in random order (Bösen's baseline for prioritisation).

Whatever the policy, by default (``ClientOptions.resends_last``) rows not yet sent early in the current
clock go before rows sent early already: a row the worker writes again before the boundary has to be sent
then anyway, so resending it early costs link time without shrinking the clock-boundary flush.  In MF every
chunk rewrites all of ``H`` while a chunk's ``W`` rows are final, and the scores of the two are alike, so
under a binding budget Bösen's score alone spent it on ``H`` resends and left ``W`` for the boundary burst
(``experiments/managed_comm``).  The boundary flush itself goes in the policy's order, in pieces
(``pieces``; ``ClientOptions.ordered_boundary``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from orion_par.ps.tables import BadTableError, RowSet, Store, TableSpec, increasing, make_store

Policy = Literal["magnitude", "absolute", "consumption", "random"]
POLICIES: tuple[str, ...] = ("magnitude", "absolute", "consumption", "random")
_TINY = 1e-12  # a row whose cached value is all zeros still gets a finite, very high priority


@dataclass(frozen=True)
class Batch:
    """Rows of one table taken from the oplog, ready to send."""

    table: str
    rows: np.ndarray
    deltas: Any
    nbytes: int


class OpLog:
    """Coalesced, not yet sent increments of one worker, per table.

    Examples
    --------
    >>> import numpy as np
    >>> log = OpLog([TableSpec("t", 4, 2)])
    >>> log.add("t", np.array([1, 3, 1]), np.ones((3, 2)))
    >>> log.dirty("t").tolist(), log.read("t", np.array([1]))[0].tolist()
    ([1, 3], [2.0, 2.0])
    >>> [b.rows.tolist() for b in log.take_all()], log.dirty("t").tolist()
    ([[1, 3]], [])
    """

    def __init__(self, specs: Iterable[TableSpec]) -> None:
        self.specs = {s.name: s for s in specs}
        self.deltas: dict[str, Store] = {n: make_store(s) for n, s in self.specs.items()}
        self.dirty_rows: dict[str, RowSet] = {n: RowSet(s) for n, s in self.specs.items()}
        self.sent: dict[str, RowSet] = {n: RowSet(s) for n, s in self.specs.items()}  # sent early this clock
        self.coalesced = 0  # increments merged into a row that was already dirty
        self.rng = np.random.default_rng(0)  # the "random" policy's order

    def add(self, table: str, rows: np.ndarray, deltas: Any) -> None:
        already = int(np.count_nonzero(self.dirty_rows[table].contains(rows)))
        self.coalesced += already + (0 if increasing(rows) else int(rows.size - np.unique(rows).size))
        self.deltas[table].add(rows, deltas)
        self.dirty_rows[table].add(rows)

    def dirty(self, table: str) -> np.ndarray:
        return self.dirty_rows[table].members()

    def read(self, table: str, rows: np.ndarray) -> Any:
        return self.deltas[table].read(rows)

    def take(self, table: str, rows: np.ndarray, early: bool = False) -> Batch:
        """Remove ``rows`` from the oplog and return their deltas (``early``: sent before the clock boundary)."""
        store = self.deltas[table]
        out = Batch(table, rows, store.read(rows), store.payload_bytes(rows))
        store.zero(rows)
        self.dirty_rows[table].discard(rows)
        if early:
            self.sent[table].add(rows)
        return out

    def resent(self, table: str, rows: np.ndarray) -> np.ndarray:
        """Which of ``rows`` were already sent early since the last clock boundary (``next_clock``).

        Sending such a row again does not shrink the clock-boundary flush when the worker writes it again
        before the boundary (it is dirty again by then), so it costs link time that first sends save.
        """
        return self.sent[table].contains(rows)

    def next_clock(self) -> None:
        """The clock boundary: no row has been sent early in the new clock yet."""
        for t in self.specs:
            self.sent[t].clear()

    def take_all(self) -> list[Batch]:
        return [self.take(t, rows) for t in self.specs if (rows := self.dirty(t)).size]

    def empty(self) -> bool:
        return not any(self.dirty(t).size for t in self.specs)

    def clear(self) -> None:
        for t in self.specs:
            self.deltas[t].zero(self.dirty(t))
            self.dirty_rows[t].clear()
            self.sent[t].clear()


class ConsumptionOrder:
    """Position of each row's first read in the current clock; the previous clock's order predicts the next.

    Positions are kept per table in arrays indexed by row (``-1``: not read), so recording a read and
    ranking the dirty rows are vectorised: both run on the worker's path (``get`` records every read, and
    the flusher ranks while it holds the client's lock).

    Examples
    --------
    >>> import numpy as np
    >>> o = ConsumptionOrder()
    >>> o.record("t", np.array([5, 2, 5])); o.record("t", np.array([7, 2]))
    >>> o.next_clock()
    >>> o.positions("t", np.array([2, 7, 5, 9])).tolist()   # row 9 was never read: last
    [1.0, 2.0, 0.0, 4.0]
    """

    def __init__(self) -> None:
        self.current: dict[str, np.ndarray] = {}
        self.previous: dict[str, np.ndarray] = {}
        self.n_current = 0
        self.n_previous = 0

    def record(self, table: str, rows: np.ndarray) -> None:
        rows = np.asarray(rows, dtype=np.int64).ravel()
        if not rows.size:
            return
        pos = self.current.get(table)
        need = int(rows.max()) + 1
        if pos is None or pos.size < need:
            grown = np.full(max(need, 2 * (0 if pos is None else pos.size)), -1, dtype=np.int64)
            if pos is not None:
                grown[:pos.size] = pos
            pos = self.current[table] = grown
        fresh = rows[pos[rows] < 0]
        if fresh.size:
            unique, first = np.unique(fresh, return_index=True)
            unique = unique[np.argsort(first, kind="stable")]  # in the order they were first read
            pos[unique] = self.n_current + np.arange(unique.size)
            self.n_current += int(unique.size)

    def next_clock(self) -> None:
        if self.n_current:
            self.previous, self.n_previous = self.current, self.n_current
            self.current, self.n_current = {}, 0

    def positions(self, table: str, rows: np.ndarray) -> np.ndarray:
        """Expected read position of each row (rows never read come last)."""
        rows = np.asarray(rows, dtype=np.int64)
        out = np.full(rows.size, float(self.n_previous + self.n_current + 1))
        for source in (self.current, self.previous):  # the previous clock's order wins where it has the row
            pos = source.get(table)
            if pos is None:
                continue
            inside = rows < pos.size
            found = np.zeros(rows.size, dtype=bool)
            found[inside] = pos[rows[inside]] >= 0
            out[found] = pos[rows[found]]
        return out


def magnitude_scores(deltas: Store, values: Store, rows: np.ndarray) -> np.ndarray:
    """``sum |delta| / sum |value|`` per row (Bösen's relative magnitude).

    Examples
    --------
    >>> import numpy as np
    >>> spec = TableSpec("t", 2, 2)
    >>> d, v = make_store(spec), make_store(spec)
    >>> d.add(np.array([0, 1]), np.array([[1.0, 1.0], [1.0, 1.0]]))
    >>> v.add(np.array([0, 1]), np.array([[10.0, 10.0], [1.0, 1.0]]))
    >>> magnitude_scores(d, v, np.array([0, 1])).round(2).tolist()
    [0.1, 1.0]
    """
    out: np.ndarray = deltas.abs_sums(rows) / np.maximum(values.abs_sums(rows), _TINY)
    return out


def _ranked(candidates: Mapping[str, tuple[np.ndarray, ...]]
            ) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every candidate row in priority order: ``(tables, rows, table index, bytes, order)``."""
    tables = sorted(candidates)
    rows = np.concatenate([candidates[t][0] for t in tables])
    scores = np.concatenate([candidates[t][1] for t in tables])
    nbytes = np.concatenate([candidates[t][2] for t in tables])
    resent = np.concatenate([candidates[t][3] if len(candidates[t]) > 3 else np.zeros(candidates[t][0].size, bool)
                             for t in tables])
    tix = np.concatenate([np.full(candidates[t][0].size, i) for i, t in enumerate(tables)])
    order = np.lexsort((rows, tix, -scores, resent))
    return tables, rows, tix, nbytes, order


def _grouped(tables: list[str], rows: np.ndarray, tix: np.ndarray, chosen: np.ndarray) -> list[tuple[str, np.ndarray]]:
    return [(t, np.sort(rows[chosen[tix[chosen] == i]])) for i, t in enumerate(tables) if np.any(tix[chosen] == i)]


def select(candidates: Mapping[str, tuple[np.ndarray, ...]], budget_bytes: int) -> list[tuple[str, np.ndarray]]:
    """Highest-scoring rows (across tables) whose payload fits in ``budget_bytes``.

    Parameters
    ----------
    candidates : mapping
        ``table -> (rows, scores, bytes per row)`` or ``(rows, scores, bytes per row, resent)``; higher
        score goes first, ties by table then row.  ``resent`` (bool per row) marks rows already sent
        since the last clock boundary: every row not yet sent goes before every resent one (see
        ``OpLog.resent``).
    budget_bytes : int

    Returns
    -------
    list of (table, rows)
        Rows taken in priority order, grouped per table; a row that does not fit ends the selection,
        so no lower-priority row overtakes a higher one.

    Examples
    --------
    >>> import numpy as np
    >>> c = {"a": (np.array([0, 1]), np.array([1.0, 5.0]), np.array([10, 10])),
    ...      "b": (np.array([7]), np.array([3.0]), np.array([10]))}
    >>> [(t, r.tolist()) for t, r in select(c, budget_bytes=25)]
    [('a', [1]), ('b', [7])]
    >>> c["a"] += (np.array([False, True]),)   # row 1 of "a" was sent already: it goes last
    >>> [(t, r.tolist()) for t, r in select(c, budget_bytes=25)]
    [('a', [0]), ('b', [7])]
    """
    if budget_bytes < 0:
        raise BadTableError(f"select: budget_bytes={budget_bytes} must be >= 0.")
    if not candidates:
        return []
    tables, rows, tix, nbytes, order = _ranked(candidates)
    fits = np.cumsum(nbytes[order]) <= budget_bytes
    n = int(np.argmin(fits)) if not fits.all() else fits.size
    return _grouped(tables, rows, tix, order[:n])


def pieces(candidates: Mapping[str, tuple[np.ndarray, ...]], piece_bytes: int) -> list[list[tuple[str, np.ndarray]]]:
    """All candidate rows in priority order, cut into consecutive pieces of about ``piece_bytes`` each.

    The clock-boundary flush of managed communication sends its oplog this way: the first piece reaches
    the server (and is pushed to readers) after its own transmission time, not the whole burst's.

    Examples
    --------
    >>> import numpy as np
    >>> c = {"a": (np.array([0, 1, 2]), np.array([1.0, 5.0, 3.0]), np.array([10, 10, 10]))}
    >>> [[(t, r.tolist()) for t, r in p] for p in pieces(c, piece_bytes=20)]
    [[('a', [1, 2])], [('a', [0])]]
    """
    if piece_bytes < 1:
        raise BadTableError(f"pieces: piece_bytes={piece_bytes} must be >= 1.")
    if not candidates:
        return []
    tables, rows, tix, nbytes, order = _ranked(candidates)
    cut = (np.cumsum(nbytes[order]) - 1) // piece_bytes  # piece number of each row, in priority order
    return [_grouped(tables, rows, tix, order[cut == k]) for k in np.unique(cut).tolist()]


def row_bytes(store: Store, rows: np.ndarray) -> np.ndarray:
    """Bytes each row's delta takes on the wire."""
    if store.spec.kind == "dense":
        return np.full(rows.size, store.spec.row_bytes, dtype=np.int64)
    return np.array([store.payload_bytes(rows[i:i + 1]) for i in range(rows.size)], dtype=np.int64)


def priority_candidates(log: OpLog, values: Mapping[str, Store], policy: str, order: ConsumptionOrder
                        ) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Scores of every dirty row under ``policy`` (see ``select``)."""
    if policy not in POLICIES:
        raise BadTableError(f"managed communication policy {policy!r} is unknown; use one of {POLICIES}.")
    out = {}
    for table in log.specs:
        rows = log.dirty(table)
        if not rows.size:
            continue
        if policy == "magnitude":
            scores = magnitude_scores(log.deltas[table], values[table], rows)
        elif policy == "absolute":
            scores = log.deltas[table].abs_sums(rows)
        elif policy == "random":
            scores = log.rng.random(rows.size)
        else:
            scores = -order.positions(table, rows)
        out[table] = (rows, scores, row_bytes(log.deltas[table], rows))
    return out
