"""Run-time checks of the data against the plan, with messages that say how to fix the input."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numba
import numpy as np

from orion_par.access import Access, Guard, KeySub
from orion_par.errors import BadBodyError, DataOrderError


def key_range(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Smallest and largest value of each key field (None without records).

    Examples
    --------
    >>> lo, hi = key_range(np.array([[3, 1], [0, 7]]))
    >>> lo.tolist(), hi.tolist()
    ([0, 1], [3, 7])
    """
    if keys.shape[0] == 0:
        return None
    return _column_range(keys.reshape(keys.shape[0], -1))


@numba.njit(cache=True)
def _column_range(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # One pass over the rows (numpy's min(axis=0) on a 2-column array is ~10x slower).
    lo, hi = keys[0].copy(), keys[0].copy()
    for n in range(1, keys.shape[0]):
        for j in range(keys.shape[1]):
            lo[j] = min(lo[j], keys[n, j])
            hi[j] = max(hi[j], keys[n, j])
    return lo, hi


def check_bounds(accesses: Sequence[Access], key_names: Sequence[str], keys: np.ndarray,
                 params: Mapping[str, Any], ranges: tuple[np.ndarray, np.ndarray] | None = None) -> None:
    """Every ``key[j] + c`` subscript stays inside its array (compiled code does not check bounds).

    ``ranges``: ``key_range(keys)`` if already known (the keys of a dataset do not change between runs).

    Raises
    ------
    BadBodyError
        Naming the array, the access and its line, the key range and the array's size.
    """
    if keys.shape[0] == 0:
        return
    # The key's range over the records that reach each access (all of them unless it is guarded).
    by_guards: dict[tuple[Guard, ...], tuple[np.ndarray, np.ndarray] | None] = {
        (): ranges if ranges is not None else key_range(keys)}
    for acc in accesses:
        arr = params.get(acc.array)
        if not isinstance(arr, np.ndarray):
            continue
        if acc.guards not in by_guards:
            by_guards[acc.guards] = key_range(keys[_meets(keys, acc.guards)])
        reach = by_guards[acc.guards]
        if reach is None:
            continue  # no record reaches this access
        lo_key, hi_key = reach
        for d, sub in enumerate(acc.subs):
            if not isinstance(sub, KeySub) or d >= arr.ndim:
                continue
            lo, hi, size = int(lo_key[sub.dim]) + sub.lo, int(hi_key[sub.dim]) + sub.hi, arr.shape[d]
            if lo < 0 or hi >= size:
                raise BadBodyError(_bounds_message(acc, d, sub, size, int(lo_key[sub.dim]), int(hi_key[sub.dim]),
                                                   key_names))


def _meets(keys: np.ndarray, guards: tuple[Guard, ...]) -> np.ndarray:
    """Records whose key meets every guard."""
    ok = np.ones(keys.shape[0], bool)
    for j, op, c in guards:
        col = keys[:, j]
        ok &= {"==": col == c, "!=": col != c, "<": col < c, "<=": col <= c, ">": col > c, ">=": col >= c}[op]
    return ok


def _bounds_message(acc: Access, d: int, sub: KeySub, size: int, lo_key: int, hi_key: int,
                    key_names: Sequence[str]) -> str:
    name = key_names[sub.dim] if sub.dim < len(key_names) and key_names[sub.dim] else f"key[{sub.dim}]"
    lo, hi = lo_key + sub.lo, hi_key + sub.hi
    head = (f"{acc.text} (line {acc.line}) indexes dimension {d} of {acc.array} (size {size}) with "
            f"{sub.describe(tuple(key_names))}, and {name} ranges over {lo_key}..{hi_key}")
    if lo < 0:
        first = -sub.lo  # the smallest key value whose index is >= 0
        return (f"{head}: records with {name} < {first} would index {lo}.., which wraps around to the end of the "
                f"array. Guard the access with `if {name} >= {first}:` (or handle those records in an `if "
                f"{name} < {first}: ... else: ...`), or shift the keys.")
    last = size - 1 - sub.hi  # the largest key value whose index fits
    return (f"{head}: indices up to {hi} do not fit. Make {acc.array} at least {hi + 1} along dimension {d}, or "
            f"guard the access with `if {name} <= {last}:`.")


def check_no_aliases(arrays: Mapping[str, np.ndarray], written: Mapping[str, int], values: np.ndarray) -> None:
    """No written array shares memory with another captured array or with the dataset's values.

    The analyzer tells arrays apart by name; two names for one memory would hide conflicts.  ``written``:
    each written array's first writing line.

    Raises
    ------
    BadBodyError
        Naming both arrays and the line.
    """
    for name, line in written.items():
        arr = arrays.get(name)
        if arr is None:
            continue
        others = [(n, a) for n, a in arrays.items() if n != name] + [("the dataset's values", values)]
        for other, b in others:
            if np.may_share_memory(arr, b):
                raise BadBodyError(
                    f"line {line} writes `{name}`, which may share memory with `{other}`: parallel_for tells "
                    "arrays apart by name, so conflicts between the two would go unseen. Use one name for "
                    "one array (or pass a copy)."
                )


def check_sorted(keys: np.ndarray) -> None:
    """Keys are in lexicographic order (a wavefront runs records in key order).

    Raises
    ------
    DataOrderError
        Naming the first record out of order and how to sort the data.
    """
    if keys.shape[0] < 2:
        return
    diff = np.diff(keys, axis=0)
    first = np.argmax(diff != 0, axis=1)
    lead = diff[np.arange(diff.shape[0]), first]
    bad = np.flatnonzero(lead < 0)
    if bad.size:
        r = int(bad[0])
        raise DataOrderError(
            f"ordered=True with a wavefront plan runs records in key order, but record {r + 1} has key "
            f"{tuple(keys[r + 1].tolist())} after {tuple(keys[r].tolist())}. Sort the data first: "
            "order = np.lexsort(keys.T[::-1]); DistArray.from_coo(keys[order], values[order])."
        )
