"""What one subscript of a shared array touches, in terms of the record's key.

Every index of a DistArray subscript is classified (Orion's per-subscript classification) as

* ``KeySub(j, lo, hi)``: ``key[j] + c`` for some ``c`` in ``[lo, hi]`` (a plain ``key[j] + 2`` has
  ``lo == hi == 2``; a slice ``key[j] - 1 : key[j] + 2`` has ``lo, hi == -1, 1``);
* ``ConstSub(c)``: the same integer in every iteration;
* ``AnySub(why)``: a whole dimension (``why == "slice"``, written ``:``) or an index the analyzer cannot
  tie to the key (``why == "unknown"``: a loop counter, a value read from data, ...).

An ``Access`` is one read or write of an array with one such classification per dimension.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class KeySub:
    """Index ``key[dim] + c`` with ``lo <= c <= hi``."""

    dim: int
    lo: int = 0
    hi: int = 0

    def shifted(self, by: int) -> KeySub:
        return KeySub(self.dim, self.lo + by, self.hi + by)

    def describe(self, key_names: tuple[str, ...] = ()) -> str:
        name = key_names[self.dim] if self.dim < len(key_names) and key_names[self.dim] else f"key[{self.dim}]"
        if self.lo == self.hi:
            return name if self.lo == 0 else f"{name} {'+' if self.lo > 0 else '-'} {abs(self.lo)}"
        return f"{name} + [{self.lo}..{self.hi}]"


@dataclass(frozen=True, order=True)
class ConstSub:
    """The same index ``value`` in every iteration."""

    value: int

    def describe(self, key_names: tuple[str, ...] = ()) -> str:
        return str(self.value)


@dataclass(frozen=True, order=True)
class AnySub:
    """A whole dimension (``why="slice"``) or an index not tied to the key (``why="unknown"``)."""

    why: str = "unknown"

    def describe(self, key_names: tuple[str, ...] = ()) -> str:
        return ":" if self.why == "slice" else "unknown"


Sub = KeySub | ConstSub | AnySub
Guard = tuple[int, str, int]  # (j, op, c): key[j] op c, op one of ==, !=, <, <=, >, >=
FULL = AnySub("slice")
UNKNOWN = AnySub("unknown")


@dataclass(frozen=True)
class Access:
    """One read or write of a shared array by the loop body.

    Attributes
    ----------
    array : str
        The name the body uses for the array.
    subs : tuple of Sub
        One classification per dimension of the array.
    is_write : bool
        True for a store (``A[i] = x``, ``A[i] += x``, an in-place method), False for a load.
    line : int
        Line number in the body's source file.
    text : str
        The subscript as written, e.g. ``"W[u, r]"``.
    via : str
        The function the body called that made the access (empty in the body itself); ``line`` is then
        the body's line of the call.
    guards : tuple of (int, str, int)
        Conditions on the key under which the access happens, ``(j, op, c)`` for ``key[j] op c`` (from
        ``if t == 0: ... else: ...`` and early exits); the bounds check looks only at records that meet them.
    """

    array: str
    subs: tuple[Sub, ...]
    is_write: bool
    line: int
    text: str
    via: str = ""
    guards: tuple[Guard, ...] = ()

    def sort_key(self) -> tuple[str, int, bool, str, str, str, str]:
        return (self.array, self.line, self.is_write, self.text, repr(self.subs), self.via, repr(self.guards))

    def describe(self, key_names: tuple[str, ...] = ()) -> str:
        kind = "write" if self.is_write else "read"
        cls = ", ".join(s.describe(key_names) for s in self.subs)
        return f"{kind} {self.text} (line {self.line}) = {self.array}[{cls}]"
