"""Table specifications and row storage: dense rows (numpy) and sparse rows (column -> value dicts).

Everything above this module (server logic, client cache, oplog) handles rows through ``Store``,
``RowSet`` and ``Stamps``, so one implementation of the SSP logic serves both row kinds.  Dense tables
keep every row in one ``(num_rows, width)`` array so that reads, increments and priority scores are
vectorised; sparse rows (Bösen's ``SparseRow``) keep only their non-zero columns.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from orion_par.errors import OrionParError

ROW_ID_BYTES = 8  # every row on the wire carries its int64 id
SPARSE_ENTRY_BYTES = 12  # int32 column + float64 value


class PSError(OrionParError):
    """Base class of every error the parameter server raises on purpose."""


class BadTableError(PSError, ValueError):
    """A table specification, a row id or a delta that the parameter server cannot use."""


class RolledBack(PSError):
    """The server was restored from a checkpoint while this worker was running; restart the clock."""


SparseRow = dict[int, float]


@dataclass(frozen=True)
class TableSpec:
    """One table of the parameter server.

    Parameters
    ----------
    name : str
    num_rows : int
        Rows are ``0 .. num_rows - 1``.
    width : int
        Columns per row (for sparse rows: the largest column id + 1).
    staleness : int or None
        The SSP bound ``s``: 0 is BSP, ``None`` is ASP (reads never wait).
    kind : {"dense", "sparse"}
    dtype : str
        numpy dtype of dense rows (sparse rows hold floats).

    Examples
    --------
    >>> TableSpec("W", num_rows=4, width=2, staleness=1).row_bytes
    24
    """

    name: str
    num_rows: int
    width: int
    staleness: int | None = 0
    kind: Literal["dense", "sparse"] = "dense"
    dtype: str = "float64"

    def __post_init__(self) -> None:
        where = f"TableSpec({self.name!r})"
        if not isinstance(self.name, str) or not self.name:
            raise BadTableError(f"{where}: name must be a non-empty string.")
        for field in ("num_rows", "width"):
            value = getattr(self, field)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise BadTableError(f"{where}: {field}={value!r} must be an int >= 1.")
        if self.staleness is not None and (not isinstance(self.staleness, int) or self.staleness < 0):
            raise BadTableError(f"{where}: staleness={self.staleness!r} must be an int >= 0 (0 = BSP) or None (ASP).")
        if self.kind not in ("dense", "sparse"):
            raise BadTableError(f"{where}: kind={self.kind!r}; use 'dense' or 'sparse'.")
        np.dtype(self.dtype)  # raises TypeError naming the bad dtype

    @property
    def row_bytes(self) -> int:
        """Bytes of one dense row on the wire (its id plus its values)."""
        return ROW_ID_BYTES + self.width * np.dtype(self.dtype).itemsize

    def check_rows(self, rows: Any) -> np.ndarray:
        """Row ids as an int64 vector, or ``BadTableError`` naming the first bad one."""
        arr = np.asarray(rows)
        if arr.ndim == 0:
            arr = arr.reshape(1)
        if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            raise BadTableError(f"table {self.name!r}: rows must be a 1-D sequence of ints; got {arr.dtype} "
                                f"with shape {arr.shape}.")
        arr = arr.astype(np.int64, copy=False)
        bad = np.flatnonzero((arr < 0) | (arr >= self.num_rows))
        if bad.size:
            raise BadTableError(f"table {self.name!r}: row {int(arr[bad[0]])} is out of range 0..{self.num_rows - 1} "
                                f"(position {int(bad[0])}); make the table larger or fix the row id.")
        return arr


class Store:
    """Rows of one table; dense and sparse tables implement the same operations."""

    def __init__(self, spec: TableSpec) -> None:
        self.spec = spec

    def read(self, rows: np.ndarray) -> Any:
        raise NotImplementedError

    def write(self, rows: np.ndarray, values: Any) -> None:
        raise NotImplementedError

    def add(self, rows: np.ndarray, deltas: Any) -> None:
        raise NotImplementedError

    def zero(self, rows: np.ndarray) -> None:
        raise NotImplementedError

    def abs_sums(self, rows: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def payload_bytes(self, rows: np.ndarray) -> int:
        raise NotImplementedError

    def snapshot(self) -> Any:
        raise NotImplementedError

    def load(self, state: Any) -> None:
        raise NotImplementedError


class DenseStore(Store):
    """All rows in one ``(num_rows, width)`` array."""

    def __init__(self, spec: TableSpec) -> None:
        super().__init__(spec)
        self.values = np.zeros((spec.num_rows, spec.width), dtype=spec.dtype)

    def read(self, rows: np.ndarray) -> np.ndarray:
        span = contiguous(rows)
        out: np.ndarray = self.values[span].copy() if span is not None else self.values[rows]
        return out

    def write(self, rows: np.ndarray, values: Any) -> None:
        span = contiguous(rows)
        self.values[span if span is not None else rows] = values

    def add(self, rows: np.ndarray, deltas: Any) -> None:
        span = contiguous(rows)
        if span is not None:
            self.values[span] += deltas
        elif not increasing(rows) and np.unique(rows).size != rows.size:
            np.add.at(self.values, rows, deltas)  # repeated rows: every delta counts
        else:
            self.values[rows] += deltas

    def zero(self, rows: np.ndarray) -> None:
        span = contiguous(rows)
        self.values[span if span is not None else rows] = 0

    def abs_sums(self, rows: np.ndarray) -> np.ndarray:
        return np.abs(self.values[rows]).sum(axis=1, dtype=np.float64)  # type: ignore[no-any-return]

    def payload_bytes(self, rows: np.ndarray) -> int:
        return int(rows.size) * self.spec.row_bytes

    def snapshot(self) -> np.ndarray:
        return self.values.copy()

    def load(self, state: Any) -> None:
        self.values[...] = state


class SparseStore(Store):
    """Rows as ``{column: value}`` dicts holding non-zero columns only."""

    def __init__(self, spec: TableSpec) -> None:
        super().__init__(spec)
        self.rows: dict[int, SparseRow] = {}

    def read(self, rows: np.ndarray) -> list[SparseRow]:
        return [dict(self.rows.get(int(r), {})) for r in rows]

    def write(self, rows: np.ndarray, values: Any) -> None:
        for r, v in zip(rows, values, strict=True):
            self.rows[int(r)] = {c: x for c, x in v.items() if x != 0}

    def add(self, rows: np.ndarray, deltas: Any) -> None:
        for r, d in zip(rows, deltas, strict=True):
            row = self.rows.setdefault(int(r), {})
            for c, x in d.items():
                s = row.get(c, 0.0) + x
                if s == 0:
                    row.pop(c, None)  # keep rows sparse: a cancelled column disappears
                else:
                    row[c] = s

    def zero(self, rows: np.ndarray) -> None:
        for r in rows:
            self.rows.pop(int(r), None)

    def abs_sums(self, rows: np.ndarray) -> np.ndarray:
        return np.array([sum(abs(x) for x in self.rows.get(int(r), {}).values()) for r in rows], dtype=np.float64)

    def payload_bytes(self, rows: np.ndarray) -> int:
        return sum(ROW_ID_BYTES + SPARSE_ENTRY_BYTES * len(self.rows.get(int(r), {})) for r in rows)

    def snapshot(self) -> dict[int, SparseRow]:
        return {r: dict(v) for r, v in self.rows.items()}

    def load(self, state: Any) -> None:
        self.rows = {int(r): dict(v) for r, v in state.items()}


def increasing(rows: np.ndarray) -> bool:
    """Whether ``rows`` is strictly increasing (so free of repeats): O(n), unlike ``np.unique``."""
    return rows.size < 2 or bool(np.all(rows[1:] > rows[:-1]))


def contiguous(rows: np.ndarray) -> slice | None:
    """``rows`` as a slice when they are ``a, a+1, ..., b`` (reads and updates then skip fancy indexing).

    Examples
    --------
    >>> contiguous(np.array([3, 4, 5])), contiguous(np.array([3, 5, 4])), contiguous(np.array([], int))
    (slice(3, 6, None), None, None)
    """
    if not rows.size or int(rows[-1]) - int(rows[0]) + 1 != rows.size or not increasing(rows):
        return None
    return slice(int(rows[0]), int(rows[-1]) + 1)


def make_store(spec: TableSpec) -> Store:
    """A ``DenseStore`` or ``SparseStore`` for ``spec``."""
    return DenseStore(spec) if spec.kind == "dense" else SparseStore(spec)


def check_values(spec: TableSpec, rows: np.ndarray, values: Any) -> Any:
    """``values`` in the table's row format, or ``BadTableError`` saying what was expected."""
    if spec.kind == "dense":
        arr = np.asarray(values)
        if arr.shape != (rows.size, spec.width) and arr.size == rows.size * spec.width and arr.ndim <= 2:
            arr = arr.reshape(rows.size, spec.width)  # one row given as a flat vector
        if arr.shape != (rows.size, spec.width):
            raise BadTableError(f"table {spec.name!r}: expected values of shape ({rows.size}, {spec.width}) "
                                f"for {rows.size} rows; got {np.shape(values)}.")
        return arr
    vals = list(values)
    if len(vals) != rows.size or not all(isinstance(v, dict) for v in vals):
        raise BadTableError(f"table {spec.name!r} has sparse rows: pass one {{column: value}} dict per row "
                            f"({rows.size} rows, got {len(vals)} values of types "
                            f"{sorted({type(v).__name__ for v in vals})}).")
    for v in vals:
        for col in v:
            if not 0 <= int(col) < spec.width:
                raise BadTableError(f"table {spec.name!r}: column {col} is out of range 0..{spec.width - 1}.")
    return vals


class RowSet:
    """A set of row ids of one table (a bool vector for dense tables, a Python set for sparse ones)."""

    def __init__(self, spec: TableSpec) -> None:
        self.dense = spec.kind == "dense"
        self.mask = np.zeros(spec.num_rows if self.dense else 0, dtype=bool)
        self.ids: set[int] = set()

    def add(self, rows: np.ndarray) -> None:
        if self.dense:
            self.mask[rows] = True
        else:
            self.ids.update(int(r) for r in rows)

    def discard(self, rows: np.ndarray) -> None:
        if self.dense:
            self.mask[rows] = False
        else:
            self.ids.difference_update(int(r) for r in rows)

    def members(self) -> np.ndarray:
        if self.dense:
            return np.flatnonzero(self.mask)
        return np.array(sorted(self.ids), dtype=np.int64)

    def contains(self, rows: np.ndarray) -> np.ndarray:
        if self.dense:
            out: np.ndarray = self.mask[rows]
            return out
        return np.array([int(r) in self.ids for r in rows], dtype=bool)

    def intersection(self, other: RowSet) -> np.ndarray:
        """Sorted rows in both sets (a mask ``and`` for dense tables; no sorting of member lists)."""
        if self.dense:
            return np.flatnonzero(self.mask & other.mask)
        return np.array(sorted(self.ids & other.ids), dtype=np.int64)

    def intersects(self, other: RowSet) -> bool:
        if self.dense:
            return bool(np.any(self.mask & other.mask))
        return not self.ids.isdisjoint(other.ids)

    def clear(self) -> None:
        self.mask[:] = False
        self.ids.clear()


class Stamps:
    """Per row: the server's min clock when the cached value was delivered (-1: not cached)."""

    def __init__(self, spec: TableSpec) -> None:
        self.dense = spec.kind == "dense"
        self.arr = np.full(spec.num_rows if self.dense else 0, -1, dtype=np.int64)
        self.map: dict[int, int] = {}

    def get(self, rows: np.ndarray) -> np.ndarray:
        if self.dense:
            out: np.ndarray = self.arr[rows]
            return out
        return np.array([self.map.get(int(r), -1) for r in rows], dtype=np.int64)

    def set(self, rows: np.ndarray, stamp: int) -> None:
        if self.dense:
            self.arr[rows] = stamp
        else:
            self.map.update((int(r), stamp) for r in rows)

    def raise_cached(self, stamp: int, shard: int = 0, num_shards: int = 1) -> None:
        """Cached rows of ``shard`` get a stamp of at least ``stamp`` (its delivery vouches for all of them)."""
        if self.dense:
            part = self.arr[shard::num_shards]
            np.maximum(part, stamp, out=part, where=part >= 0)
        else:
            for r, s in self.map.items():
                if r % num_shards == shard:
                    self.map[r] = max(s, stamp)

    def clear(self) -> None:
        self.arr[:] = -1
        self.map.clear()


def specs_by_name(tables: Iterable[TableSpec]) -> dict[str, TableSpec]:
    """Tables keyed by name; ``BadTableError`` on duplicates or non-``TableSpec`` entries."""
    out: dict[str, TableSpec] = {}
    for t in tables:
        if not isinstance(t, TableSpec):
            raise BadTableError(f"tables must be TableSpec instances; got {type(t).__name__}.")
        if t.name in out:
            raise BadTableError(f"two tables are named {t.name!r}; table names must be unique.")
        out[t.name] = t
    if not out:
        raise BadTableError("a parameter server needs at least one TableSpec.")
    return out


def shard_of(rows: np.ndarray, num_shards: int) -> np.ndarray:
    """Shard of each row: ``row % num_shards`` (rows spread evenly whatever their access pattern)."""
    return rows % num_shards


def split_by_shard(rows: np.ndarray, num_shards: int) -> Sequence[tuple[int, np.ndarray]]:
    """``(shard, positions in rows)`` for each shard that owns at least one of ``rows``."""
    if num_shards == 1:
        return [(0, np.arange(rows.size))]
    owner = shard_of(rows, num_shards)
    return [(s, np.flatnonzero(owner == s)) for s in range(num_shards) if np.any(owner == s)]
