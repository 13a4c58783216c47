"""Which results of a plan may round differently from the user's session, and why (issue 32)."""

from __future__ import annotations

from collections.abc import Sequence

import networkx as nx

from tfmem.ir.graph import GraphIR, TensorRef
from tfmem.ir.ops import ASSIGN_OPS
from tfmem.ir.shared_init import updates_in_place
from tfmem.pipeline import PassReport


def rounding_caveat(ir: GraphIR, reports: Sequence[PassReport], fetches: Sequence[str]) -> str | None:
    """The fetched tensors and variable updates of ``ir`` that read, through data edges, a chain of float products
    or sums that ``pin_reassociation`` left for Grappler to re-associate (its rewrite did not match the graph):
    other passes may change how Grappler builds such a chain, and so the last bits. None when there is none
    (``tests/test_zoo.py``)."""
    left = next((r.details.get("unmatched") for r in reports if r.name == "pin_reassociation"), None)
    if not isinstance(left, list) or not left:
        return None
    data = nx.subgraph_view(ir.nx, filter_edge=lambda a, b: not ir.nx[a][b]["control"])
    present = [name for name in left if name in ir.by_name]
    reached = set(present).union(*(nx.descendants(data, name) for name in present))
    outputs = sorted(f for f in fetches if ":" in f and TensorRef.parse(f).node in reached)
    updated = sorted({ir[n].inputs[0].node for n in reached if ir[n].inputs and (
        ir[n].op in ASSIGN_OPS or updates_in_place(ir[n].op) or ir[n].op.startswith("Apply"))})
    named = outputs[:3] + [f"the update of {v}" for v in updated[:3]]
    if not named:
        return None
    more = len(outputs) + len(updated) - len(named)
    return (f"{len(left)} op(s) in chains of float products or sums are left for Grappler to re-associate (their "
            f"rewrite did not match this graph, e.g. {sorted(left)[0]}): {', '.join(named)}"
            + (f" and {more} more" if more else "") + " may differ from the unoptimized session's in the last bits")
