"""Graph-rewrite passes that ``tfmem.optimize`` composes.

Each pass is a frozen dataclass with ``name`` and ``run(graph, ctx) -> PassResult`` (``tfmem.pipeline``).
``DEFAULT_PASSES`` is what ``passes="auto"`` runs, in order; ``PASSES`` maps every pass name to an instance.
``auto`` runs them all; each memory-moving pass stops as soon as the simulated peak meets the budget.
"""

from __future__ import annotations

from passes.limit_parallelism import LimitParallelism
from passes.partition import Partition
from passes.place_persistent import PlacePersistent
from passes.swap_activations import SwapActivations
from tfmem.pipeline import Pass

DEFAULT_PASSES: tuple[Pass, ...] = (
    Partition(),          # first: a memory-aware order and its partitions, on the graph as the user wrote it
    LimitParallelism(),   # then: enforce that order with control edges, as loosely as the budget allows
    PlacePersistent(),    # weights to the host when the budget needs it (they move every step either way)
    SwapActivations(),    # then idle activations, until the budget is met
)
PASSES: dict[str, Pass] = {p.name: p for p in DEFAULT_PASSES}
