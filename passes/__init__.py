"""Graph-rewrite passes that ``tfmem.optimize`` composes.

Each pass is a frozen dataclass with ``name`` and ``run(graph, ctx) -> PassResult`` (``tfmem.pipeline``).
``DEFAULT_PASSES`` is what ``passes="auto"`` runs, in order; ``PASSES`` maps every pass name to an instance.
``auto`` runs pin_fusions, split_addn, partition, limit_parallelism and the planner; place_persistent,
swap_activations and recompute can also run on their own, each stopping as soon as the simulated peak meets
the budget.
"""

from __future__ import annotations

from passes.limit_parallelism import LimitParallelism
from passes.partition import Partition
from passes.pin_fusions import PinFusions
from passes.place_persistent import PlacePersistent
from passes.planner import Planner
from passes.recompute import Recompute
from passes.split_addn import SplitAddN
from passes.swap_activations import SwapActivations
from tfmem.pipeline import Pass

DEFAULT_PASSES: tuple[Pass, ...] = (
    PinFusions(),         # first, exact and budget-free: the kernels Grappler fuses, fused before any rewrite
    SplitAddN(),          # the session's summation order, as binary adds; a large AddN frees its inputs early
    Partition(),          # then: a memory-aware order and its partitions
    LimitParallelism(),   # then: enforce that order with control edges, as loosely as the budget allows
    Planner(),            # then, if the budget needs it: keep, swap, recompute or host-place each candidate
)
# Each memory-moving strategy on its own, greedy and budget-driven (the planner chooses among them).
SINGLE_STRATEGIES: tuple[Pass, ...] = (PlacePersistent(), SwapActivations(), Recompute())
PASSES: dict[str, Pass] = {p.name: p for p in DEFAULT_PASSES + SINGLE_STRATEGIES}
# Run before any pass list (tfmem.optimize adds them): rewrites change how Grappler fuses kernels and orders
# sums, so these two first write the user's graph's runtime arithmetic into the graph itself.
EXACT_REWRITES: tuple[Pass, ...] = (PinFusions(), SplitAddN())
