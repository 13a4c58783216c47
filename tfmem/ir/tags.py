"""Attrs that passes use to talk to later passes (``_tfmem_*``), and removing them from a finished graph.

They must not reach the session: attrs take part in Grappler's common-subgraph elimination, so a tag left
on two otherwise identical ops would keep them apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from tfmem.ir.graph import GraphIR, OpNode

TAG_PREFIX = "_tfmem_"
# On a variable: it must stay where it is. A TF2 variable lives where it was created; a rebuilt function can read
# it there, not move it (``tfmem.traced``, which restores the captured handle in its place; place_persistent
# leaves it: tests/test_function.py::test_captured_variables_stay_where_they_were_created).
PINNED_TAG = "_tfmem_pinned"
# On a placeholder: an argument of a TF2 function, whose shape the function runtime's Grappler knows (a session's
# does not: a feed may take any shape), so its rewrites (an add tree folded into one AddN) depend on that shape
# (tfmem.sim.grappler; tests/test_function.py::test_a_function_arguments_shape_is_known_to_grapplers_rewrite).
SHAPED_ARGUMENT_TAG = "_tfmem_shaped_argument"
# verify() checks the swap tags in the final graph; all of them let a reader see what each Identity is for. The pin
# must outlive every pass.
KEPT_TAGS = frozenset({"_tfmem_swap_in", "_tfmem_swap_out", "_tfmem_prefetch", "_tfmem_recompute", PINNED_TAG})


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


def same_program(a: GraphIR, b: GraphIR) -> bool:
    """Whether ``a`` and ``b`` are the same graph up to ``_tfmem_*`` tags (which the simulator ignores).

    Passes tag, untag and re-tag one graph; this lets simulations and analyses cached for one of those
    copies answer for the others. Exact: every other attr value must be equal.

    Examples
    --------
    >>> from tensorflow.core.framework import attr_value_pb2
    >>> a = GraphIR((OpNode("x", "Const"),))
    >>> tagged = a.replace_nodes((OpNode("x", "Const", attrs={"_tfmem_order": attr_value_pb2.AttrValue(i=3)}),))
    >>> same_program(a, tagged), same_program(a, GraphIR((OpNode("x", "Placeholder"),)))
    (True, False)
    """
    if a is b:
        return True
    if len(a.nodes) != len(b.nodes):
        return False
    for x, y in zip(a.nodes, b.nodes, strict=True):
        if x is y:
            continue
        if x != y:  # every field but attrs and proto
            return False
        if x.attrs is not y.attrs and _untagged(x.attrs) != _untagged(y.attrs):
            return False
    return True


def _untagged(attrs: Mapping[str, object]) -> dict[str, object]:
    return {k: v for k, v in attrs.items() if not k.startswith(TAG_PREFIX)}

