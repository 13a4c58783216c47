"""A small cache of results computed for a graph, shared by graphs that are the same program.

Passes tag, untag and re-tag one graph, and ``optimize`` simulates before, between and after passes; on a
20,000-op graph a simulation costs seconds (``experiments/results/optimize_speed.md``). An entry answers for
the graph object it was computed for and for any graph equal to it up to ``_tfmem_*`` tags
(``tfmem.ir.tags.same_program``).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

from tfmem.ir.graph import GraphIR
from tfmem.ir.tags import same_program

V = TypeVar("V")


class GraphCache(Generic[V]):
    """The ``kept`` most recent results, keyed by a graph and the other arguments that produced them.

    Examples
    --------
    >>> from tfmem.ir.graph import OpNode
    >>> cache: GraphCache[int] = GraphCache(kept=2)
    >>> g = GraphIR((OpNode("x", "Const"),))
    >>> cache.put(g, ("fetch",), 42)
    >>> cache.get(GraphIR((OpNode("x", "Const"),)), ("fetch",)), cache.get(g, ("other",))
    (42, None)
    """

    def __init__(self, kept: int = 8, *, same_object: bool = False) -> None:
        self.kept = kept
        self.same_object = same_object   # answer only for the very graph object (when tags matter to the result)
        self._entries: list[tuple[GraphIR, Hashable, V]] = []   # oldest first; each holds its graph alive

    def get(self, graph: GraphIR, key: Hashable) -> V | None:
        matching = [(g, v) for g, k, v in reversed(self._entries) if k == key]
        for g, v in matching:   # the same object first: that check is free
            if g is graph:
                return v
        if self.same_object:
            return None
        for g, v in matching:
            if same_program(g, graph):
                return v
        return None

    def put(self, graph: GraphIR, key: Hashable, value: V) -> None:
        self._entries.append((graph, key, value))
        del self._entries[:-self.kept]
