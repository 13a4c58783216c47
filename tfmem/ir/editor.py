"""``GraphEditor``: the one mutable way to build a new ``GraphIR`` from an old one.

Passes never mutate a ``GraphIR``; they open an editor, add nodes and control edges, and ``finish()``.
Every node an editor adds carries ``_grappler_do_not_remove`` (so Grappler keeps it rather than bypass a
device-crossing ``Identity``, see ``docs/ARCHITECTURE.md``) and is listed in ``added``.

Examples
--------
>>> import tensorflow as tf
>>> from tfmem.ir.shapes import annotate
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
from tfmem.ir.graph import GraphIR, OpNode, TensorRef, TensorSpec

DO_NOT_REMOVE = "_grappler_do_not_remove"


def claim_name(names: set[str], base: str) -> str:
    """``base``, or ``base_1``, ``base_2``... the first not in ``names``; added to ``names``."""
    name, i = base, 0
    while name in names:
        i += 1
        name = f"{base}_{i}"
    names.add(name)
    return name


class GraphEditor:
    """Collects additions to ``graph``; ``finish()`` returns a new graph in a valid topological layout."""

    def __init__(self, graph: GraphIR) -> None:
        self.graph = graph
        self.added: list[OpNode] = []
        self._extra_control: dict[str, dict[str, None]] = {}
        self._rewired: dict[str, dict[TensorRef, TensorRef]] = {}   # consumer -> {old input: new input}
        self._devices: dict[str, str] = {}
        self._dropped_attrs: dict[str, set[str]] = {}
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

    def add_op(self, name: str, op: str, inputs: Iterable[TensorRef], outputs: Iterable[TensorSpec], *,
               control_inputs: Iterable[str] = (), device: str = "",
               attrs: dict[str, attr_value_pb2.AttrValue] | None = None) -> OpNode:
        """Add an op reading ``inputs`` (existing or added tensors) with the given output specs."""
        if name in self._names:
            raise MalformedGraphError(f"cannot add node {name!r}: a node with that name exists")
        all_attrs = {DO_NOT_REMOVE: attr_value_pb2.AttrValue(b=True), **(attrs or {})}
        node = OpNode(name, op, tuple(inputs), tuple(dict.fromkeys(control_inputs)), device, tuple(outputs),
                      MappingProxyType(all_attrs))
        self.added.append(node)
        self._names.add(name)
        return node

    def unique_name(self, base: str) -> str:
        """``base``, or ``base_1``, ``base_2``... when a node already has that name."""
        name, i = base, 0
        while name in self._names:
            i += 1
            name = f"{base}_{i}"
        return name

    def rewire(self, consumer: str, old: TensorRef, new: TensorRef) -> None:
        """Make ``consumer`` read ``new`` wherever it read ``old``."""
        if consumer not in self.graph:
            raise MalformedGraphError(f"cannot rewire {consumer!r}: no such node in the original graph")
        self._rewired.setdefault(consumer, {})[old] = new

    def set_device(self, name: str, device: str) -> None:
        """Place the original node ``name`` on ``device``."""
        if name not in self.graph:
            raise MalformedGraphError(f"cannot place {name!r}: no such node in the original graph")
        self._devices[name] = device

    def drop_attr(self, name: str, key: str) -> None:
        """Remove attribute ``key`` (e.g. a ``_class`` colocation constraint) from the original node ``name``."""
        self._dropped_attrs.setdefault(name, set()).add(key)

    def add_control_inputs(self, name: str, sources: Iterable[str]) -> None:
        """Make node ``name`` wait for every node in ``sources``."""
        if name not in self._names:
            raise MalformedGraphError(f"cannot add control inputs to {name!r}: no such node")
        self._extra_control.setdefault(name, {}).update(dict.fromkeys(sources))

    @property
    def control_edges_added(self) -> int:
        return sum(len(v) for v in self._extra_control.values()) + sum(len(n.control_inputs) for n in self.added)

    def finish(self) -> GraphIR:
        """The new graph: added nodes are placed right before their first consumer (or at the end).

        An added node that reads other added nodes comes after them (they are added in dependence order).
        """
        nodes: list[OpNode] = []
        placed: set[str] = set()
        pending = {n.name: self._with_changes(n) for n in self.added}

        def place(name: str) -> None:
            if name in pending and name not in placed:
                placed.add(name)
                for pred in pending[name].predecessors:
                    place(pred)
                nodes.append(pending[name])

        for node in self.graph.nodes:
            new = self._with_changes(node)
            for src in new.predecessors:
                place(src)
            nodes.append(new)
        for name in pending:
            place(name)
        return self.graph.replace_nodes(tuple(nodes))

    def _with_changes(self, node: OpNode) -> OpNode:
        extra = [c for c in self._extra_control.get(node.name, {}) if c not in node.control_inputs]
        rewired = self._rewired.get(node.name, {})
        device = self._devices.get(node.name, node.device)
        dropped = self._dropped_attrs.get(node.name, set()) & set(node.attrs)
        if not extra and not rewired and device == node.device and not dropped:
            return node
        attrs = node.attrs
        if dropped:
            attrs = MappingProxyType({k: v for k, v in node.attrs.items() if k not in dropped})
        inputs = tuple(rewired.get(t, t) for t in node.inputs)
        return OpNode(node.name, node.op, inputs, node.control_inputs + tuple(extra), device,
                      node.outputs, attrs, node.proto)
