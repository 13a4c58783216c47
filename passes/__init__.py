"""Graph-rewrite passes that ``tfmem.optimize`` composes.

Each pass is a frozen dataclass with ``name`` and ``run(graph, ctx) -> PassResult`` (``tfmem.pipeline``).
``DEFAULT_PASSES`` is what ``passes="auto"`` runs, in order; ``PASSES`` maps every pass name to an instance.
The memory passes (partition, limit_parallelism, swap_activations, place_persistent, recompute and the
budget planner) land here one by one; until then the pipeline runs with none and reports so.
"""

from __future__ import annotations

from tfmem.pipeline import Pass

DEFAULT_PASSES: tuple[Pass, ...] = ()
PASSES: dict[str, Pass] = {p.name: p for p in DEFAULT_PASSES}
