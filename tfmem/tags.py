"""Attrs that passes use to talk to later passes (``_tfmem_*``), and removing them from a finished graph.

They must not reach the session: attrs take part in Grappler's common-subgraph elimination, so a tag left
on two otherwise identical ops would keep them apart.
"""

from __future__ import annotations

from types import MappingProxyType

from tfmem.ir import GraphIR, OpNode

TAG_PREFIX = "_tfmem_"
# verify() checks the swap tags in the final graph; all of them let a reader see what each Identity is for.
KEPT_TAGS = frozenset({"_tfmem_swap_in", "_tfmem_swap_out", "_tfmem_prefetch", "_tfmem_recompute"})


def strip_tags(graph: GraphIR) -> GraphIR:
    """``graph`` without the ``_tfmem_*`` bookkeeping attrs (those in ``KEPT_TAGS`` stay)."""
    nodes = []
    changed = False
    for node in graph.nodes:
        drop = [k for k in node.attrs if k.startswith(TAG_PREFIX) and k not in KEPT_TAGS]
        if not drop:
            nodes.append(node)
            continue
        changed = True
        attrs = {k: v for k, v in node.attrs.items() if k not in drop}
        nodes.append(OpNode(node.name, node.op, node.inputs, node.control_inputs, node.device, node.outputs,
                            MappingProxyType(attrs), node.proto))
    return graph.replace_nodes(tuple(nodes)) if changed else graph
