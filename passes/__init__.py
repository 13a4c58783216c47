"""Graph-rewrite passes that ``tfmem.optimize`` composes.

Each pass is a frozen dataclass with ``name`` and ``run(graph, ctx) -> PassResult`` (``tfmem.pipeline``).
``DEFAULT_PASSES`` is what ``passes="auto"`` runs, in order; ``PASSES`` maps every pass name to an instance.
``auto`` runs pin_fusions, split_addn, pin_reassociation, share_constants, unshare_initial_values,
serialize_scratch, split_identity_n, partition, limit_parallelism, the planner and fence_transfers; place_persistent,
swap_activations and recompute can also run on their own, each stopping as soon as the simulated peak meets the
budget.
"""

from __future__ import annotations

from passes.fence_transfers import FenceTransfers
from passes.limit_parallelism import LimitParallelism
from passes.partition import Partition
from passes.pin_fusions import PinFusions
from passes.pin_reassociation import PinReassociation
from passes.place_persistent import PlacePersistent
from passes.planner import Planner
from passes.recompute import Recompute
from passes.serialize_scratch import SerializeScratch
from passes.share_constants import ShareConstants
from passes.split_addn import SplitAddN
from passes.split_identity_n import SplitIdentityN
from passes.swap_activations import SwapActivations
from passes.unshare_initial_values import UnshareInitialValues
from tfmem.pipeline import Pass

# Run before any pass list (tfmem.optimize adds them), once, as they do not depend on the budget: rewrites change
# how Grappler fuses kernels, orders sums and associates products, so the first three write the user's graph's
# runtime arithmetic into the graph itself; the fourth merges repeated constant computations while Grappler
# still would (control edges stop it, and the executor then holds each copy as a constant); the fifth gives each
# variable initialised to a constant its own buffer, so the first step does not copy it into the middle of free
# memory; the sixth keeps kernels with large scratch buffers from running side by side; the seventh lets each
# tensor of an IdentityN (Keras 3 passes every gradient through one) flow on without waiting for the others.
LEADING_REWRITES: tuple[Pass, ...] = (PinFusions(), SplitAddN(), PinReassociation(), ShareConstants(),
                                      UnshareInitialValues(), SerializeScratch(), SplitIdentityN())
# Run after any pass list: the device waits for its copies to host where the plan counted their memory as freed.
FINAL_REWRITES: tuple[Pass, ...] = (FenceTransfers(),)
DEFAULT_PASSES: tuple[Pass, ...] = (
    *LEADING_REWRITES,    # exact and budget-free: the session's fused kernels and summation order, scratch chained
    Partition(),          # then: a memory-aware order and its partitions
    LimitParallelism(),   # then: enforce that order with control edges, as loosely as the budget allows
    Planner(),            # then, if the budget needs it: keep, swap, recompute or host-place each candidate
    *FINAL_REWRITES,      # last: fence the copies to host the plan made
)
# Each memory-moving strategy on its own, greedy and budget-driven (the planner chooses among them).
SINGLE_STRATEGIES: tuple[Pass, ...] = (PlacePersistent(), SwapActivations(), Recompute())
PASSES: dict[str, Pass] = {p.name: p for p in DEFAULT_PASSES + SINGLE_STRATEGIES}
