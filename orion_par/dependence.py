"""Dependence vectors between the accesses of a loop body (Orion's dependence analysis).

Two iterations ``p`` and ``q`` conflict when one writes an element the other reads or writes.  For a
pair of accesses ``a`` (in ``p``) and ``b`` (in ``q``) of the same array, each array dimension where
both subscripts are ``key[j] + c`` pins the key distance ``key_q[j] - key_p[j]`` to an interval; other
dimensions pin nothing.  The result is a box of possible distances per key dimension, ``None`` meaning
unbounded.  A box that is ``(0, 0)`` in every dimension only links records with equal keys, which the
partitioner always keeps together.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from orion_par.access import Access, ConstSub, KeySub

Interval = tuple[int | None, int | None]
ANY: Interval = (None, None)
ZERO: Interval = (0, 0)


@dataclass(frozen=True)
class DepVec:
    """Key distances ``key_q - key_p`` at which ``source`` (in iteration p) and ``sink`` (in q) may
    touch the same element."""

    distance: tuple[Interval, ...]
    source: Access
    sink: Access

    @property
    def array(self) -> str:
        return self.source.array

    def is_zero(self, dim: int) -> bool:
        return self.distance[dim] == ZERO

    def same_key_only(self) -> bool:
        return all(d == ZERO for d in self.distance)

    def sort_key(self) -> tuple[str, int, int, str]:
        return (self.array, self.source.line, self.sink.line, repr(self))

    def describe(self, key_names: tuple[str, ...] = ()) -> str:
        dist = ", ".join(_fmt(iv) for iv in self.distance)
        names = ", ".join(key_names[j] or f"key[{j}]" for j in range(len(self.distance))) if key_names else ""
        head = f"({dist})" + (f" in ({names})" if names else "")
        return (
            f"{self.array}: {'write' if self.source.is_write else 'read'} {self.source.text} (line "
            f"{self.source.line}) vs {'write' if self.sink.is_write else 'read'} {self.sink.text} (line "
            f"{self.sink.line}) at key distance {head}"
        )


def _fmt(iv: Interval) -> str:
    lo, hi = iv
    if lo is None and hi is None:
        return "*"
    if lo == hi:
        return str(lo)
    return f"{'-inf' if lo is None else lo}..{'inf' if hi is None else hi}"


def conflict_box(a: Access, b: Access, key_ndim: int) -> tuple[Interval, ...] | None:
    """Distances ``key_q - key_p`` at which ``a`` in p and ``b`` in q may touch one element, or None.

    Examples
    --------
    >>> from orion_par.access import KeySub, FULL
    >>> w = Access("A", (KeySub(0, 0, 0),), True, 3, "A[i]")
    >>> r = Access("A", (KeySub(0, -1, -1),), False, 4, "A[i - 1]")
    >>> conflict_box(w, r, 1)   # q reads what p wrote when key_q = key_p + 1
    ((1, 1),)
    """
    box: list[Interval] = [ANY] * key_ndim
    for sa, sb in zip(a.subs, b.subs, strict=True):
        if isinstance(sa, ConstSub) and isinstance(sb, ConstSub) and sa.value != sb.value:
            return None
        if isinstance(sa, KeySub) and isinstance(sb, KeySub) and sa.dim == sb.dim:
            # key_q + cb = key_p + ca  =>  key_q - key_p = ca - cb, ca in [a.lo, a.hi], cb in [b.lo, b.hi]
            lo, hi = _intersect(box[sa.dim], (sa.lo - sb.hi, sa.hi - sb.lo))
            if lo is not None and hi is not None and lo > hi:
                return None
            box[sa.dim] = (lo, hi)
    return tuple(box)


def _intersect(x: Interval, y: Interval) -> Interval:
    lo = y[0] if x[0] is None else x[0] if y[0] is None else max(x[0], y[0])
    hi = y[1] if x[1] is None else x[1] if y[1] is None else min(x[1], y[1])
    return lo, hi


def dependence_vectors(accesses: Iterable[Access], key_ndim: int) -> set[DepVec]:
    """All dependences between pairs of accesses, at least one a write, of the same array.

    Both orders of each pair are included (the box of ``(b, a)`` is the negation of ``(a, b)``'s), so the
    set is symmetric; ordered loops pick the direction from the serial order.

    Examples
    --------
    >>> from orion_par.access import KeySub, UNKNOWN
    >>> w = Access("W", (KeySub(0), UNKNOWN), True, 5, "W[u, r]")
    >>> sorted(d.distance for d in dependence_vectors([w], key_ndim=2))
    [((0, 0), (None, None))]
    """
    by_array: dict[str, list[Access]] = {}
    for acc in accesses:
        by_array.setdefault(acc.array, []).append(acc)
    deps: set[DepVec] = set()
    for accs in by_array.values():
        for a in accs:
            for b in accs:
                if not (a.is_write or b.is_write):
                    continue
                box = conflict_box(a, b, key_ndim)
                if box is not None:
                    deps.add(DepVec(box, a, b))
    return deps


def lex_positive_boxes(box: tuple[Interval, ...]) -> list[tuple[Interval, ...]]:
    """Split the lexicographically positive part of ``box`` into boxes (for ordered loops).

    A distance is lexicographically positive when its first non-zero component is positive, i.e. the
    sink iteration comes later in key order.

    Examples
    --------
    >>> lex_positive_boxes(((-1, 1), (None, None)))
    [((1, 1), (None, None)), ((0, 0), (1, None))]
    """
    out: list[tuple[Interval, ...]] = []
    for k in range(len(box)):
        if any(not _contains_zero(box[i]) for i in range(k)):
            break
        lo, hi = _intersect(box[k], (1, None))
        if lo is not None and hi is not None and lo > hi:
            continue
        out.append(tuple([ZERO] * k + [(lo, hi)] + list(box[k + 1:])))
    return out


def _contains_zero(iv: Interval) -> bool:
    return (iv[0] is None or iv[0] <= 0) and (iv[1] is None or iv[1] >= 0)


def nonnegative(iv: Interval) -> bool:
    return iv[0] is not None and iv[0] >= 0
