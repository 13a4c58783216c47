"""Graph-rewrite passes that ``tfmem.optimize`` composes.

Each pass is a frozen dataclass with ``name`` and ``run(graph, ctx) -> PassResult`` (``tfmem.pipeline``).
``DEFAULT_PASSES`` is what ``passes="auto"`` runs, in order; ``PASSES`` maps every pass name to an instance.
Today: ``partition`` and ``limit_parallelism``; swap_activations, place_persistent, recompute and the budget
planner come next (issues 4 and 5).
"""

from __future__ import annotations

from passes.limit_parallelism import LimitParallelism
from passes.partition import Partition
from tfmem.pipeline import Pass

DEFAULT_PASSES: tuple[Pass, ...] = (
    Partition(),          # first: a memory-aware order and its partitions, on the graph as the user wrote it
    LimitParallelism(),   # then: enforce that order with control edges, as loosely as the budget allows
)
PASSES: dict[str, Pass] = {p.name: p for p in DEFAULT_PASSES}
