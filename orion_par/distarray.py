"""DistArray, keyed datasets and Buffer: numpy arrays that parallel_for knows how to share.

A ``DistArray`` is an ``ndarray`` view: wrapping never copies, and ``np.asarray(d)`` gives the values the
loop body wrote.  A keyed dataset (``DistArray.from_coo``) is a DistArray of record values with an integer
``keys`` matrix beside it, one row per record.  A ``Buffer`` marks an array whose updates may reach other
workers late (Orion's DistArrayBuffer).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from orion_par.errors import BadBodyError


class DistArray(np.ndarray):
    """An ndarray that a ``parallel_for`` body may read and write; wraps without copying.

    Parameters
    ----------
    array : array_like
        The values.  An ``ndarray`` is viewed, not copied, so writes show in the original.

    Examples
    --------
    >>> import numpy as np
    >>> base = np.zeros(3)
    >>> d = DistArray(base)
    >>> d[1] = 5.0
    >>> base.tolist()
    [0.0, 5.0, 0.0]
    >>> type(np.asarray(d)).__name__
    'ndarray'
    """

    keys: np.ndarray | None

    def __new__(cls, array: Any) -> DistArray:
        obj = np.asarray(array).view(cls)
        obj.keys = None
        return obj

    def __array_finalize__(self, obj: Any) -> None:
        # Slices and arithmetic results are plain values, never keyed datasets.
        self.keys = None

    def __reduce__(self) -> Any:
        # Pickle (Ray, multiprocessing) as a plain array plus the keys (and a Buffer's delay, an
        # Accumulator's op).
        return (_rebuild, (np.asarray(self), self.keys, type(self), getattr(self, "max_delay", None)),
                {"op": getattr(self, "op", None)})

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            if state.get("op") is not None:
                self.op = state["op"]
        else:
            super().__setstate__(state)

    @classmethod
    def from_coo(cls, keys: Any, values: Any) -> DistArray:
        """Make a keyed dataset: record ``r`` is ``(tuple(keys[r]), values[r])``.

        Parameters
        ----------
        keys : array_like of int, shape (n,) or (n, d)
            One key per record; a 1-D array means one key dimension.
        values : array_like, shape (n, ...)
            One value per record (a scalar, or a row for ``values.ndim > 1``).

        Returns
        -------
        DistArray
            The values, with ``.keys`` an ``int64`` array of shape (n, d).

        Raises
        ------
        BadBodyError
            If keys are not integers or the record counts differ.

        Examples
        --------
        >>> data = DistArray.from_coo([[0, 1], [2, 0]], [4.0, 3.5])
        >>> list(data.records())
        [((0, 1), 4.0), ((2, 0), 3.5)]
        """
        k = np.asarray(keys)
        v = np.asarray(values)
        if k.ndim == 1:
            k = k[:, None]
        if k.ndim != 2 or k.shape[1] == 0:
            raise BadBodyError(f"from_coo: keys must have shape (n,) or (n, d); got {k.shape}.")
        if k.size and not np.issubdtype(k.dtype, np.integer):
            k = _integral_keys(k)
        if v.ndim == 0 or v.shape[0] != k.shape[0]:
            raise BadBodyError(
                f"from_coo: {k.shape[0]} keys but values has shape {v.shape}; give one value per record."
            )
        data = cls(v)
        data.keys = np.ascontiguousarray(k, dtype=np.int64)
        return data

    @property
    def num_records(self) -> int:
        """Number of records of a keyed dataset (``len(keys)``)."""
        return 0 if self.keys is None else int(self.keys.shape[0])

    def records(self) -> Iterator[tuple[tuple[int, ...], Any]]:
        """Iterate ``(key, value)`` in data order, as a serial loop would.

        Examples
        --------
        >>> data = DistArray.from_coo([3, 1], [1.0, 2.0])
        >>> [k for k, _ in data.records()]
        [(3,), (1,)]
        """
        if self.keys is None:
            raise BadBodyError("records(): this DistArray is not a keyed dataset; build one with from_coo.")
        values = np.asarray(self)
        for r in range(self.keys.shape[0]):
            yield tuple(int(x) for x in self.keys[r]), values[r].item() if values.ndim == 1 else values[r]


class Buffer(DistArray):
    """An array whose updates a parallel body may apply late (at most ``max_delay`` steps).

    Inside a ``parallel_for`` body a Buffer reads and writes like an array, but each worker writes a
    private copy; every ``max_delay`` steps the workers' net changes are *added* to the shared values
    (in worker order) and the copies refreshed.  Use it for small global state such as LDA's topic counts,
    where a few steps of staleness do not hurt convergence.  With one worker it is exact.

    Parameters
    ----------
    array : array_like
        The shared values (viewed, not copied).
    max_delay : int, default 1
        Steps of the executor's schedule after which a worker's updates are visible to all.

    Examples
    --------
    >>> import numpy as np
    >>> counts = Buffer(np.zeros(4, dtype=np.int64), max_delay=2)
    >>> counts.max_delay
    2
    """

    max_delay: int

    def __new__(cls, array: Any, max_delay: int = 1) -> Buffer:
        if isinstance(max_delay, bool) or not isinstance(max_delay, (int, np.integer)) or max_delay < 1:
            raise BadBodyError(f"Buffer: max_delay must be an int >= 1; got {max_delay!r}.")
        obj = np.asarray(array).view(cls)
        obj.keys = None
        obj.max_delay = int(max_delay)
        return obj

    def __array_finalize__(self, obj: Any) -> None:
        self.keys = None
        self.max_delay = getattr(obj, "max_delay", 1)


def _integral_keys(k: np.ndarray) -> np.ndarray:
    """Keys of another dtype that hold whole numbers (1.0, True) as int64; anything else is an error."""
    try:
        as_float = k.astype(np.float64)
    except (TypeError, ValueError) as e:
        raise BadBodyError(
            f"from_coo: keys must be integer ids; got dtype {k.dtype}. Map them to ids with "
            "`ids = np.unique(col, return_inverse=True)[1]` for each key column."
        ) from e
    bad = np.flatnonzero(~np.isfinite(as_float) | (as_float != np.round(as_float)))
    if bad.size:
        r = int(bad[0]) // k.shape[1]
        raise BadBodyError(
            f"from_coo: keys must be integer ids, but record {r} has key {tuple(k[r].tolist())} (dtype {k.dtype}); "
            "casting would merge different keys. Map each key column to ids with "
            "`ids = np.unique(col, return_inverse=True)[1]`."
        )
    return as_float.astype(np.int64)


ACCUMULATOR_OPS = ("sum", "count", "min", "max")


class Accumulator(DistArray):
    """A value the loop reduces over its records: a sum, a count, a minimum or a maximum (Orion's
    accumulators), e.g. the training loss of an epoch.

    The body only updates it, one element at a time: ``LOSS[0] += err * err`` (``"sum"``, ``"count"``),
    ``BEST[0] = min(BEST[0], x)`` or ``max(...)``.  Every epoch starts it at the reduction's identity
    (0, +inf or -inf); each worker reduces its own records into a private copy, and the copies are combined
    in worker order at the end of the epoch.  With one worker that is the serial loop's value, bit for bit;
    with more it is the serial order's per-worker partial results, combined.  ``run`` returns every
    epoch's value (``RunStats.accumulated``); the array holds the last one.

    Parameters
    ----------
    op : {"sum", "count", "min", "max"}
    shape : int or tuple of int, default 1
        A scalar accumulator is one element (``LOSS[0]``); a histogram has more.
    dtype : numpy dtype, optional
        Default ``int64`` for ``"count"``, ``float64`` otherwise.

    Examples
    --------
    >>> loss = Accumulator("sum")
    >>> loss.op, loss.shape, float(loss[0])
    ('sum', (1,), 0.0)
    >>> float(Accumulator("min")[0])
    inf
    """

    op: str

    def __new__(cls, op: str = "sum", shape: int | tuple[int, ...] = 1, dtype: Any = None) -> Accumulator:
        if op not in ACCUMULATOR_OPS:
            raise BadBodyError(f"Accumulator(op={op!r}): choose one of {ACCUMULATOR_OPS}.")
        dt = np.dtype(dtype if dtype is not None else (np.int64 if op == "count" else np.float64))
        obj = np.zeros(shape, dt).view(cls)
        obj.keys = None
        obj.op = op
        obj.reset()
        return obj

    def __array_finalize__(self, obj: Any) -> None:
        self.keys = None
        self.op = getattr(obj, "op", "sum")

    def identity(self) -> Any:
        """The value every epoch starts from: 0 for sums and counts, the dtype's largest or smallest
        value for a minimum or maximum."""
        return identity(self.op, self.dtype)

    def reset(self) -> None:
        """Set every element to the identity."""
        np.ndarray.__setitem__(self, Ellipsis, self.identity())


def identity(op: str, dtype: np.dtype) -> Any:
    if op in ("sum", "count"):
        return dtype.type(0)
    big = np.inf if dtype.kind in "fc" else np.iinfo(dtype).max
    return dtype.type(big if op == "min" else -big if dtype.kind in "fc" else np.iinfo(dtype).min)


def _rebuild(values: np.ndarray, keys: np.ndarray | None, cls: type, max_delay: int | None) -> DistArray:
    obj: DistArray
    if cls is Buffer:
        obj = Buffer(values, max_delay or 1)
    elif cls is Accumulator:
        obj = np.asarray(values).view(Accumulator)
    else:
        obj = cls(values)
    obj.keys = keys
    return obj
