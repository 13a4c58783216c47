"""Run-time checks of the data against the plan, with messages that say how to fix the input."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from orion_par.access import Access, KeySub
from orion_par.errors import BadBodyError, DataOrderError


def check_bounds(accesses: Sequence[Access], key_names: Sequence[str], keys: np.ndarray,
                 params: Mapping[str, Any]) -> None:
    """Every ``key[j] + c`` subscript stays inside its array (compiled code does not check bounds).

    Raises
    ------
    BadBodyError
        Naming the array, the access and its line, the key range and the array's size.
    """
    if keys.shape[0] == 0:
        return
    lo_key, hi_key = keys.min(axis=0), keys.max(axis=0)
    for acc in accesses:
        arr = params.get(acc.array)
        if not isinstance(arr, np.ndarray):
            continue
        for d, sub in enumerate(acc.subs):
            if not isinstance(sub, KeySub) or d >= arr.ndim:
                continue
            lo, hi, size = int(lo_key[sub.dim]) + sub.lo, int(hi_key[sub.dim]) + sub.hi, arr.shape[d]
            if lo < 0 or hi >= size:
                name = key_names[sub.dim] if sub.dim < len(key_names) else ""
                raise BadBodyError(
                    f"{acc.text} (line {acc.line}) indexes dimension {d} of {acc.array} (size {size}) with "
                    f"key[{sub.dim}]{f' ({name})' if name else ''} + {sub.lo}..{sub.hi}, and the keys range over "
                    f"{int(lo_key[sub.dim])}..{int(hi_key[sub.dim])}: indices {lo}..{hi} do not fit. "
                    f"Make {acc.array} larger along dimension {d} or fix the keys (negative indices would wrap around "
                    "and make different keys touch one element)."
                )


def check_no_aliases(arrays: Mapping[str, np.ndarray], written: Sequence[str], values: np.ndarray) -> None:
    """No written array shares memory with another captured array or with the dataset's values.

    The analyzer tells arrays apart by name; two names for one memory would hide conflicts.

    Raises
    ------
    BadBodyError
        Naming both arrays.
    """
    for name in written:
        arr = arrays.get(name)
        if arr is None:
            continue
        others = [(n, a) for n, a in arrays.items() if n != name] + [("the dataset's values", values)]
        for other, b in others:
            if np.may_share_memory(arr, b):
                raise BadBodyError(
                    f"the body writes `{name}`, which may share memory with `{other}`: parallel_for tells "
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
