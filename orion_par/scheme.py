"""Choose how to parallelise a loop from its dependence vectors (Orion's scheme selection).

* ``none``: no two iterations with different keys conflict.
* ``1d``: one key field ``j`` has distance 0 in every dependence, so partitioning the data by
  ``key[j]`` leaves every conflicting pair on one worker.
* ``2d``: every dependence has distance 0 in the space field ``s`` or in the time field ``t``; workers
  own space partitions and time partitions rotate among them, so concurrent blocks never share either
  (DSGD).  Any serial order is fine for an unordered loop, and the rotation order is one.
* ``2d_ordered``: for ``ordered=True``, every dependence that points forward in key order points
  forward (>= 0) in both ``s`` and ``t``; blocks run as a wavefront, block ``(i, j)`` after ``(i-1, j)``
  and ``(i, j-1)``, which keeps the serial result.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from orion_par.access import AnySub, KeySub
from orion_par.dependence import DepVec, lex_positive_boxes, nonnegative


class ParallelScheme(str, Enum):
    """The parallelisation scheme of a plan; compares equal to its string value (``"2d"``)."""

    NONE = "none"
    ONE_D = "1d"
    TWO_D = "2d"
    TWO_D_ORDERED = "2d_ordered"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class SchemeChoice:
    """A scheme and the key fields it partitions by (``space_dim`` is the 1D field)."""

    scheme: ParallelScheme
    space_dim: int | None = None
    time_dim: int | None = None


def candidates(key_ndim: int, ordered: bool) -> list[SchemeChoice]:
    """Every scheme there is for ``key_ndim`` key fields, simplest first."""
    out = [SchemeChoice(ParallelScheme.NONE)]
    out += [SchemeChoice(ParallelScheme.ONE_D, j) for j in range(key_ndim)]
    two = ParallelScheme.TWO_D_ORDERED if ordered else ParallelScheme.TWO_D
    out += [SchemeChoice(two, s, t) for s in range(key_ndim) for t in range(key_ndim) if s != t]
    return out


def satisfies(choice: SchemeChoice, dep: DepVec) -> bool:
    """Whether executing under ``choice`` can never reorder the two iterations ``dep`` links."""
    if dep.same_key_only():
        return True
    s, t = choice.space_dim, choice.time_dim
    if choice.scheme is ParallelScheme.NONE:
        return False
    if choice.scheme is ParallelScheme.ONE_D:
        return dep.is_zero(s)  # type: ignore[arg-type]
    if choice.scheme is ParallelScheme.TWO_D:
        return dep.is_zero(s) or dep.is_zero(t)  # type: ignore[arg-type]
    return all(nonnegative(b[s]) and nonnegative(b[t]) for b in lex_positive_boxes(dep.distance))  # type: ignore[index]


def violations(choice: SchemeChoice, deps: Iterable[DepVec]) -> list[DepVec]:
    return [d for d in deps if not satisfies(choice, d)]


def choose_scheme(
    deps: Iterable[DepVec], key_ndim: int, *, ordered: bool, distinct: Sequence[int], space_bytes: Mapping[int, int]
) -> SchemeChoice | None:
    """The simplest valid scheme, or None.

    Among valid 1D fields, the one with most distinct key values (more room to balance); among valid 2D
    pairs, the space field that keeps the most bytes of arrays in place (``space_bytes``), then the one
    with more distinct values.

    Examples
    --------
    >>> from orion_par.access import Access, KeySub, UNKNOWN
    >>> from orion_par.dependence import dependence_vectors
    >>> W = Access("W", (KeySub(0), UNKNOWN), True, 3, "W[u, r]")
    >>> H = Access("H", (KeySub(1), UNKNOWN), True, 4, "H[i, r]")
    >>> c = choose_scheme(dependence_vectors([W, H], 2), 2, ordered=False, distinct=[10, 5], space_bytes={})
    >>> (str(c.scheme), c.space_dim, c.time_dim)
    ('2d', 0, 1)
    """
    deps = list(deps)
    valid = [c for c in candidates(key_ndim, ordered) if not violations(c, deps)]
    if not valid:
        return None
    simplest = valid[0].scheme
    same = [c for c in valid if c.scheme is simplest]
    return max(same, key=lambda c: (space_bytes.get(c.space_dim or 0, 0), distinct[c.space_dim or 0], -(c.space_dim or 0)))


def why(dep: DepVec) -> str:
    """One phrase saying what kind of conflict ``dep`` is."""
    finite = [iv for iv in dep.distance if iv != (None, None) and iv != (0, 0)]
    accs = (dep.source, dep.sink)
    if finite and all(iv[0] is not None and iv[1] is not None for iv in finite):
        return "a chain dependence: iterations whose keys differ by this distance touch the same element"
    unknown = [a.text for a in accs if any(isinstance(s, AnySub) and s.why == "unknown" for s in a.subs)]
    if unknown and not any(isinstance(s, KeySub) for a in accs for s in a.subs):
        return f"a data-dependent subscript ({unknown[0]}): any two iterations may touch the same element"
    if not any(isinstance(s, KeySub) for a in accs for s in a.subs):
        return "a global write: every iteration touches the same elements"
    return "the subscripts share no key field at distance 0"
