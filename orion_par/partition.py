"""Split a keyed dataset into parts of balanced record counts, keeping equal keys together.

Parts are balanced by *record counts* per key value, not by key ranges, so a few heavy keys (a
power-law user, a frequent word) do not leave one worker with most of the data.  Unordered schemes use
greedy longest-processing-time assignment (heaviest key value to the lightest part; the largest part
is at most ``total / num_parts + max_count``); ordered schemes need contiguous key ranges and cut the
cumulative counts at equal quantiles.  ``prefer_ranges`` takes contiguous ranges whenever they are as
balanced as the greedy assignment (within 1%): neighbouring rows then stay with one worker, which keeps
a worker's rows together in memory and stops two workers from writing rows that share a cache line.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np


@dataclass(frozen=True)
class Partitioning:
    """Part id of every record.

    Attributes
    ----------
    dim : int or None
        The key field partitioned by; None when split by record position or by whole key.
    num_parts : int
    part : ndarray of int64, shape (n,)
    """

    dim: int | None
    num_parts: int
    part: np.ndarray

    @property
    def sizes(self) -> np.ndarray:
        """Records per part."""
        return np.bincount(self.part, minlength=self.num_parts)


@numba.njit(cache=True)
def _lpt(counts: np.ndarray, num_parts: int) -> np.ndarray:
    # counts sorted heaviest first; each goes to the currently lightest part (ties: lowest index).
    loads = np.zeros(num_parts, np.int64)
    out = np.empty(counts.shape[0], np.int64)
    for i in range(counts.shape[0]):
        p = 0
        for q in range(1, num_parts):
            if loads[q] < loads[p]:
                p = q
        out[i] = p
        loads[p] += counts[i]
    return out


def _assign(counts: np.ndarray, num_parts: int, contiguous: bool) -> np.ndarray:
    """Part of each distinct value, given its record count (values in ascending order)."""
    if counts.size == 0:
        return np.zeros(0, np.int64)
    if contiguous:
        total = counts.sum()
        mid = np.cumsum(counts) - counts / 2.0  # where each value's records sit in the cumulative order
        parts: np.ndarray = np.minimum((mid * num_parts / total).astype(np.int64), num_parts - 1)
        return parts
    order = np.argsort(-counts, kind="stable")
    parts = np.empty(counts.size, np.int64)
    parts[order] = _lpt(counts[order].astype(np.int64), num_parts)
    return parts


_RANGES_SLACK = 1.01  # contiguous ranges may be this much less balanced than LPT and still be preferred


def partition_by_key(keys: np.ndarray, dim: int, num_parts: int, *, contiguous: bool = False,
                     prefer_ranges: bool = False) -> Partitioning:
    """Partition records by ``keys[:, dim]``; records with equal values land in the same part.

    Parameters
    ----------
    keys : ndarray of int, shape (n, d)
    dim : int
        Key field to partition by.
    num_parts : int
    contiguous : bool
        Parts are ranges of key values, in order (wavefronts need this).
    prefer_ranges : bool
        Use ranges of key values when their largest part is within 1% of the greedy assignment's
        largest part, else the greedy assignment.

    Returns
    -------
    Partitioning

    Examples
    --------
    >>> keys = np.array([[0], [0], [0], [0], [1], [2], [3], [4]])
    >>> partition_by_key(keys, 0, 2).sizes.tolist()     # the heavy key 0 alone, the rest together
    [4, 4]
    >>> partition_by_key(keys, 0, 2, contiguous=True).part.tolist()
    [0, 0, 0, 0, 1, 1, 1, 1]
    >>> partition_by_key(np.array([[0], [1], [2], [3]]), 0, 2, prefer_ranges=True).part.tolist()
    [0, 0, 1, 1]
    """
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1; got {num_parts}")
    values, inverse, counts = np.unique(keys[:, dim], return_inverse=True, return_counts=True)
    parts = _assign(counts, num_parts, contiguous)
    if prefer_ranges and not contiguous:
        ranges = _assign(counts, num_parts, True)
        if _largest(ranges, counts, num_parts) <= _RANGES_SLACK * _largest(parts, counts, num_parts):
            parts = ranges
    return Partitioning(dim, num_parts, parts[inverse.ravel()])


def _largest(parts: np.ndarray, counts: np.ndarray, num_parts: int) -> int:
    return int(np.bincount(parts, weights=counts, minlength=num_parts).max(initial=0))


def partition_by_whole_key(keys: np.ndarray, num_parts: int) -> Partitioning:
    """Partition so that records with identical keys (all fields) share a part, balanced by counts."""
    if keys.shape[0] == 0:
        return Partitioning(None, num_parts, np.zeros(0, np.int64))
    _, inverse, counts = np.unique(keys, axis=0, return_inverse=True, return_counts=True)
    return Partitioning(None, num_parts, _assign(counts, num_parts, False)[inverse.ravel()])


def partition_by_position(num_records: int, num_parts: int) -> Partitioning:
    """Consecutive runs of records of (almost) equal size, in data order.

    Examples
    --------
    >>> partition_by_position(5, 2).part.tolist()
    [0, 0, 0, 1, 1]
    """
    return Partitioning(None, num_parts, (np.arange(num_records) * num_parts // max(num_records, 1)).astype(np.int64))
