"""``GraphEditor``: the one mutable way to build a new ``GraphIR`` from an old one.

Passes never mutate a ``GraphIR``; they open an editor, add nodes and control edges, and ``finish()``.
Every node an editor adds carries ``_grappler_do_not_remove`` (so TensorFlow's optimizer keeps it, see
DESIGN.md) and is listed in ``added``.

Examples
--------
>>> import tensorflow as tf
>>> from tfmem.shapes import annotate
>>> g = tf.Graph()
>>> with g.as_default():
...     a = tf.constant(1.0, name="a")
...     b = tf.constant(2.0, name="b")
>>> ed = GraphEditor(annotate(g.as_graph_def()))
>>> _ = ed.add_noop("tfmem/barrier/0", control_inputs=["a"])
>>> ed.add_control_inputs("b", ["tfmem/barrier/0"])
>>> new = ed.finish()
>>> new["b"].control_inputs, [n.name for n in new.nodes]
(('tfmem/barrier/0',), ['a', 'tfmem/barrier/0', 'b'])
"""

from __future__ import annotations

from collections.abc import Iterable
from types import MappingProxyType

from tensorflow.core.framework import attr_value_pb2

from tfmem.errors import MalformedGraphError
from tfmem.ir import GraphIR, OpNode

DO_NOT_REMOVE = "_grappler_do_not_remove"


class GraphEditor:
    """Collects additions to ``graph``; ``finish()`` returns a new graph in a valid topological layout."""

    def __init__(self, graph: GraphIR) -> None:
        self.graph = graph
        self.added: list[OpNode] = []
        self._extra_control: dict[str, dict[str, None]] = {}
        self._names = set(graph.by_name)

    def add_noop(self, name: str, control_inputs: Iterable[str] = (), device: str = "",
                 attrs: dict[str, attr_value_pb2.AttrValue] | None = None) -> OpNode:
        """Add a ``NoOp`` that waits for ``control_inputs`` (a barrier other ops can wait for)."""
        if name in self._names:
            raise MalformedGraphError(f"cannot add node {name!r}: a node with that name exists")
        all_attrs = {DO_NOT_REMOVE: attr_value_pb2.AttrValue(b=True), **(attrs or {})}
        node = OpNode(name, "NoOp", (), tuple(dict.fromkeys(control_inputs)), device, (),
                      MappingProxyType(all_attrs))
        self.added.append(node)
        self._names.add(name)
        return node

    def add_control_inputs(self, name: str, sources: Iterable[str]) -> None:
        """Make node ``name`` wait for every node in ``sources``."""
        if name not in self._names:
            raise MalformedGraphError(f"cannot add control inputs to {name!r}: no such node")
        self._extra_control.setdefault(name, {}).update(dict.fromkeys(sources))

    @property
    def control_edges_added(self) -> int:
        return sum(len(v) for v in self._extra_control.values()) + sum(len(n.control_inputs) for n in self.added)

    def finish(self) -> GraphIR:
        """The new graph: added nodes are placed right before their first consumer (or at the end)."""
        nodes: list[OpNode] = []
        placed: set[str] = set()
        pending = {n.name: n for n in self.added}
        for node in self.graph.nodes:
            for src in self._extra_control.get(node.name, {}):
                if src in pending and src not in placed:
                    nodes.append(pending[src])
                    placed.add(src)
            nodes.append(self._with_controls(node))
        nodes.extend(n for name, n in pending.items() if name not in placed)
        return self.graph.replace_nodes(tuple(nodes))

    def _with_controls(self, node: OpNode) -> OpNode:
        extra = [c for c in self._extra_control.get(node.name, {}) if c not in node.control_inputs]
        if not extra:
            return node
        return OpNode(node.name, node.op, node.inputs, node.control_inputs + tuple(extra), node.device,
                      node.outputs, node.attrs, node.proto)
