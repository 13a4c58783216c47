"""Abstract values for the analyzer: what a local name can be, and how subscripts narrow array views.

The analyzer walks the body once, tracking for every local name an ``AbsVal``: the subscript class it
would have as an index (``key[j] + c``, a constant or unknown), whether it is certainly a scalar, and
which shared-array views it may alias (``w = W[u]`` makes ``w`` a view of row ``u`` of ``W``, so that a
later ``w += g`` is a write of ``W[u, :]``).  Joins over-approximate: when two branches disagree the
result may be either, so every access found is a superset of what can happen.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from orion_par.access import FULL, UNKNOWN, AnySub, ConstSub, KeySub, Sub


@dataclass(frozen=True)
class ArrayRef:
    """A view of shared array ``array``: ``subs`` per array dimension, ``free`` the dims still exposed.

    ``opaque`` means the analyzer lost track of which array dimension a further index would hit
    (fancy indexing, ``.T``, ``reshape``); further indexing then makes every free dimension unknown.
    """

    array: str
    subs: tuple[Sub, ...]
    free: tuple[int, ...]
    opaque: bool = False
    # Per array dimension, the array index of the view's element 0 there (``W[u, 1:]``: 1 in dimension 1),
    # so that indexing the view again lands on the right element; None where a slice has a step or an
    # unknown start.  Empty means 0 everywhere.
    starts: tuple[Sub | None, ...] = ()

    @classmethod
    def whole(cls, array: str, ndim: int) -> ArrayRef:
        return cls(array, (FULL,) * ndim, tuple(range(ndim)))

    def start(self, dim: int) -> Sub | None:
        return self.starts[dim] if self.starts else ConstSub(0)

    def make_opaque(self) -> ArrayRef:
        return replace(self, opaque=True)


@dataclass(frozen=True)
class AbsVal:
    """What the analyzer knows about one value (see the module docstring)."""

    sub: Sub = UNKNOWN
    scalar: bool = False
    views: frozenset[ArrayRef] = field(default_factory=frozenset)
    is_key: bool = False


NOTHING = AbsVal()
SCALAR = AbsVal(scalar=True)


def const(value: int) -> AbsVal:
    return AbsVal(ConstSub(value), scalar=True)


def views_of(refs: Iterable[ArrayRef], *, opaque: bool = False) -> AbsVal:
    refs = frozenset(r.make_opaque() if opaque else r for r in refs)
    return AbsVal(views=refs)


def join_sub(a: Sub, b: Sub) -> Sub:
    """The least classification covering both ``a`` and ``b``."""
    if a == b:
        return a
    if isinstance(a, KeySub) and isinstance(b, KeySub) and a.dim == b.dim:
        return KeySub(a.dim, min(a.lo, b.lo), max(a.hi, b.hi))
    if isinstance(a, AnySub) and isinstance(b, AnySub):
        return FULL if a.why == b.why == "slice" else UNKNOWN
    return UNKNOWN


def join(a: AbsVal, b: AbsVal) -> AbsVal:
    if a == b:
        return a
    return AbsVal(join_sub(a.sub, b.sub), a.scalar and b.scalar, a.views | b.views, a.is_key and b.is_key)


def join_env(a: dict[str, AbsVal], b: dict[str, AbsVal]) -> dict[str, AbsVal]:
    """Join two environments; a name bound on one path only keeps its value (it may be unbound)."""
    out = dict(a)
    for name, val in b.items():
        out[name] = join(out[name], val) if name in out else val
    return out


def add_sub(a: Sub, b: Sub, sign: int) -> Sub:
    """Classify ``a + b`` (``sign=1``) or ``a - b`` (``sign=-1``)."""
    if isinstance(b, ConstSub):
        if isinstance(a, ConstSub):
            return ConstSub(a.value + sign * b.value)
        if isinstance(a, KeySub):
            return a.shifted(sign * b.value)
    if sign == 1 and isinstance(a, ConstSub) and isinstance(b, KeySub):
        return b.shifted(a.value)
    return UNKNOWN


@dataclass(frozen=True)
class IndexItem:
    """One element of a subscript: an index value, a slice, or something the analyzer gives up on."""

    kind: str  # "index" | "slice" | "weird"
    value: AbsVal = NOTHING
    slice_sub: Sub = FULL
    slice_start: Sub | None = ConstSub(0)  # the index of the slice's first element (None: unknown)


def slice_sub(lower: AbsVal | None, upper: AbsVal | None, has_step: bool) -> Sub:
    """Classify a slice: ``key[j]+a : key[j]+b`` covers offsets ``a .. b-1``; ``:`` is the whole dim."""
    if lower is None and upper is None and not has_step:
        return FULL
    lo, hi = (lower.sub if lower else None), (upper.sub if upper else None)
    if not has_step and isinstance(lo, KeySub) and isinstance(hi, KeySub) and lo.dim == hi.dim:
        if lo.lo <= hi.hi - 1:
            return KeySub(lo.dim, lo.lo, hi.hi - 1)
    return UNKNOWN


def slice_start(lower: AbsVal | None, has_step: bool) -> Sub | None:
    """The index of a slice's first element: 0 for ``:hi``, ``c`` or ``key[j] + c`` for those starts."""
    if has_step:
        return None
    if lower is None:
        return ConstSub(0)
    sub = lower.sub
    if isinstance(sub, ConstSub) and sub.value >= 0 or isinstance(sub, KeySub) and sub.lo == sub.hi:
        return sub
    return None


def index_view(ref: ArrayRef, items: Sequence[IndexItem]) -> ArrayRef:
    """Apply a subscript to a view; returns the narrowed view (``free == ()`` means one element).

    An index into a dimension that an earlier slice kept is shifted by the slice's start (``W[u, 1:][0]`` is
    ``W[u, 1]``); a negative constant index counts from the end, so it is unknown here.
    """
    if ref.opaque or any(it.kind == "weird" for it in items) or len(items) > len(ref.free):
        return _give_up(ref)
    subs = list(ref.subs)
    starts = [ref.start(d) for d in range(len(ref.subs))]
    free = list(ref.free)
    opaque = False
    kept: list[int] = []
    for pos, item in enumerate(items):
        dim = free[pos]
        base = starts[dim]
        if item.kind == "slice":
            subs[dim] = item.slice_sub if base == ConstSub(0) else _shifted_range(base, item.slice_sub)
            starts[dim] = None if base is None or item.slice_start is None else _add(base, item.slice_start)
            kept.append(dim)
        else:
            sub = item.value.sub
            if isinstance(sub, ConstSub) and sub.value < 0:
                sub = UNKNOWN
            subs[dim] = UNKNOWN if base is None else _add(base, sub)
            # An index that may be an array is fancy indexing: the result's dims no longer line up.
            opaque = opaque or not item.value.scalar
    rest = tuple(kept) + tuple(free[len(items):])
    plain = all(s == ConstSub(0) for s in starts)
    return ArrayRef(ref.array, tuple(subs), rest, opaque, () if plain else tuple(starts))


def _add(a: Sub, b: Sub) -> Sub:
    return b if a == ConstSub(0) else add_sub(a, b, 1)


def _shifted_range(base: Sub | None, sub: Sub) -> Sub:
    # A slice of a view that does not start at 0: the elements it covers, if they can be told exactly.
    if base is None:
        return UNKNOWN
    if isinstance(sub, KeySub) and isinstance(base, ConstSub):
        return sub.shifted(base.value)
    return FULL if sub == FULL and isinstance(base, ConstSub) else UNKNOWN


def _give_up(ref: ArrayRef) -> ArrayRef:
    subs = tuple(UNKNOWN if d in ref.free else s for d, s in enumerate(ref.subs))
    return ArrayRef(ref.array, subs, ref.free, True, ref.starts)


def region(ref: ArrayRef) -> tuple[Sub, ...]:
    """The elements a use of the whole view touches (free dims whole, or unknown when opaque)."""
    if not ref.opaque:
        return ref.subs
    return tuple(UNKNOWN if d in ref.free else s for d, s in enumerate(ref.subs))
