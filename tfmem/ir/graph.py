"""The graph IR: an immutable Python view of a TensorFlow ``GraphDef``.

A ``GraphIR`` is a tuple of ``OpNode`` in the GraphDef's own order (so that the round trip is exact), each
with its data inputs, control inputs, device, attrs and one ``TensorSpec`` (dtype, shape, bytes) per output.
Protos appear only at the edges: ``GraphIR.from_graph_def`` and ``GraphIR.to_graph_def``. Passes build new
graphs with ``tfmem.ir.editor.GraphEditor``; analyses use the cached indices (``by_name``, ``consumers``) or the
networkx view ``nx``, never mutate.

Examples
--------
>>> import tensorflow as tf
>>> g = tf.Graph()
>>> with g.as_default():
...     x = tf.compat.v1.placeholder(tf.float32, (4, 8), name="x")
...     y = tf.identity(x * 2.0, name="y")
>>> from tfmem.ir.shapes import annotate
>>> ir = annotate(g.as_graph_def())      # GraphIR.from_graph_def(...) plus a TensorSpec per output
>>> ir.spec("y:0").nbytes
128
>>> ir.to_graph_def() == g.as_graph_def()
True
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Any, TypeVar, cast

import networkx as nx
from tensorflow.core.framework import attr_value_pb2, function_pb2, graph_pb2, node_def_pb2, versions_pb2

from tfmem.errors import MalformedGraphError
from tfmem.ir.devices import device_parse_error

_EMPTY: Mapping[str, Any] = MappingProxyType({})
T = TypeVar("T")


@dataclass(frozen=True, order=True)
class TensorRef:
    """The ``index``-th output of node ``node``; ``str()`` gives TF's ``"node:index"`` name."""

    node: str
    index: int = 0

    def __str__(self) -> str:
        return f"{self.node}:{self.index}"

    @classmethod
    def parse(cls, name: str) -> TensorRef:
        """Parse ``"node:1"``, ``"node"`` (output 0) or a GraphDef input string such as ``"node:1"``."""
        node, sep, idx = name.rpartition(":")
        if sep and idx.isdigit():
            return cls(node, int(idx))
        return cls(name, 0)


@dataclass(frozen=True)
class TensorSpec:
    """What one output holds: TF dtype name, shape (``None`` entries unknown; ``None`` = unknown rank), bytes."""

    dtype: str
    shape: tuple[int | None, ...] | None
    nbytes: int | None

    @property
    def known(self) -> bool:
        return self.nbytes is not None


@dataclass(frozen=True)
class OpNode:
    """One op of the graph. ``proto`` is the NodeDef it came from (kept for fields the IR does not model)."""

    name: str
    op: str
    inputs: tuple[TensorRef, ...] = ()
    control_inputs: tuple[str, ...] = ()
    device: str = ""
    outputs: tuple[TensorSpec, ...] = ()
    attrs: Mapping[str, attr_value_pb2.AttrValue] = field(default_factory=lambda: _EMPTY, compare=False)
    proto: node_def_pb2.NodeDef | None = field(default=None, compare=False, repr=False)

    def output(self, index: int = 0) -> TensorRef:
        return TensorRef(self.name, index)

    @property
    def predecessors(self) -> tuple[str, ...]:
        """Names of nodes this one waits for (data producers first, then control inputs, no duplicates)."""
        seen = dict.fromkeys(t.node for t in self.inputs)
        seen.update(dict.fromkeys(self.control_inputs))
        return tuple(seen)

    def attr_bool(self, key: str) -> bool:
        value = self.attrs.get(key)
        return bool(value is not None and value.b)

    def to_node_def(self) -> node_def_pb2.NodeDef:
        nd = node_def_pb2.NodeDef()
        if self.proto is not None:
            nd.CopyFrom(self.proto)
        nd.name, nd.op, nd.device = self.name, self.op, self.device
        if self.proto is None or _parse_inputs(self.proto.input) != (self.inputs, self.control_inputs):
            del nd.input[:]
            nd.input.extend(_format_input(t) for t in self.inputs)
            nd.input.extend("^" + c for c in self.control_inputs)
        nd.attr.clear()
        for key, value in self.attrs.items():
            nd.attr[key].CopyFrom(value)
        return nd


def _format_input(ref: TensorRef) -> str:
    return ref.node if ref.index == 0 else f"{ref.node}:{ref.index}"


def _parse_inputs(raw: Any) -> tuple[tuple[TensorRef, ...], tuple[str, ...]]:
    data, control = [], []
    for s in raw:
        if s.startswith("^"):
            control.append(s[1:])
        else:
            data.append(TensorRef.parse(s))
    return tuple(data), tuple(control)


@dataclass(frozen=True)
class GraphIR:
    """An immutable graph: nodes in GraphDef order plus the function library and versions.

    Build one with ``from_graph_def`` (specs left empty) or ``tfmem.ir.shapes.annotate`` /
    ``tfmem.load`` (specs filled in); write one back with ``to_graph_def``.
    """

    nodes: tuple[OpNode, ...]
    library: function_pb2.FunctionDefLibrary = field(
        default_factory=function_pb2.FunctionDefLibrary, compare=False, repr=False
    )
    versions: versions_pb2.VersionDef | None = field(default=None, compare=False, repr=False)
    annotated: bool = field(default=False, compare=False)   # every output has a TensorSpec

    @classmethod
    def from_graph_def(cls, gd: graph_pb2.GraphDef) -> GraphIR:
        """Read a GraphDef; checks every node has a name and a parsable device, names are unique and every input
        names a node of the graph."""
        nodes = []
        for i, nd in enumerate(gd.node):
            if not nd.name:
                raise MalformedGraphError(f"node {i} of the graph ({nd.op or 'no op type'}) has no name; every node "
                                          "needs a unique name")
            if nd.device and device_parse_error(nd.device):
                raise MalformedGraphError(f"node {nd.name!r} ({nd.op}) has device {nd.device!r}, which is not a "
                                          f"device string ({device_parse_error(nd.device)}); fix or clear it")
            inputs, control = _parse_inputs(nd.input)
            nodes.append(
                OpNode(
                    name=nd.name, op=nd.op, inputs=inputs, control_inputs=control, device=nd.device,
                    attrs=MappingProxyType(dict(nd.attr)), proto=nd,
                )
            )
        ir = cls(tuple(nodes), gd.library, gd.versions if gd.HasField("versions") else None)
        ir.check_references()
        return ir

    def to_graph_def(self) -> graph_pb2.GraphDef:
        """Write the graph back; ``GraphIR.from_graph_def(gd).to_graph_def() == gd`` for any valid ``gd``."""
        gd = graph_pb2.GraphDef()
        gd.node.extend(n.to_node_def() for n in self.nodes)
        if self.library.function or self.library.gradient or self.library.registered_gradients:
            gd.library.CopyFrom(self.library)
        if self.versions is not None:
            gd.versions.CopyFrom(self.versions)
        return gd

    def check_references(self) -> None:
        """Raise ``MalformedGraphError`` for duplicate node names or inputs naming missing nodes."""
        names: set[str] = set()
        for n in self.nodes:
            if n.name in names:
                raise MalformedGraphError(f"duplicate node name {n.name!r}; node names must be unique")
            names.add(n.name)
        for n in self.nodes:
            for pred in n.predecessors:
                if pred not in names:
                    raise MalformedGraphError(
                        f"node {n.name!r} ({n.op}) has input {pred!r}, which is not a node of the graph"
                    )

    def replace_nodes(self, nodes: tuple[OpNode, ...], *, annotated: bool | None = None) -> GraphIR:
        """A graph with the same library and versions and these nodes."""
        keep = self.annotated if annotated is None else annotated
        return GraphIR(nodes, self.library, self.versions, keep)

    def __iter__(self) -> Iterator[OpNode]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def __contains__(self, name: object) -> bool:
        return name in self.by_name

    def __getitem__(self, name: str) -> OpNode:
        try:
            return self.by_name[name]
        except KeyError:
            raise KeyError(f"no node named {name!r} in the graph") from None

    @cached_property
    def by_name(self) -> Mapping[str, OpNode]:
        return MappingProxyType({n.name: n for n in self.nodes})

    @cached_property
    def consumers(self) -> Mapping[TensorRef, tuple[str, ...]]:
        """For each tensor, the names of the nodes that read it (a node reading it twice appears once)."""
        out: dict[TensorRef, dict[str, None]] = {}
        for n in self.nodes:
            for t in n.inputs:
                out.setdefault(t, {})[n.name] = None
        return MappingProxyType({t: tuple(c) for t, c in out.items()})

    @cached_property
    def successors(self) -> Mapping[str, tuple[str, ...]]:
        """For each node, the nodes that wait for it (through data or control edges)."""
        out: dict[str, dict[str, None]] = {n.name: {} for n in self.nodes}
        for n in self.nodes:
            for p in n.predecessors:
                out[p][n.name] = None
        return MappingProxyType({k: tuple(v) for k, v in out.items()})

    @cached_property
    def nx(self) -> nx.DiGraph:
        """A networkx DiGraph of node names (edge attr ``control`` is True for control-only edges). Read-only."""
        g = nx.DiGraph()
        g.add_nodes_from(n.name for n in self.nodes)
        for n in self.nodes:
            data_preds = {t.node for t in n.inputs}
            for p in n.predecessors:
                g.add_edge(p, n.name, control=p not in data_preds)
        return nx.freeze(g)

    def spec(self, tensor: str | TensorRef) -> TensorSpec:
        """The spec of a tensor given as ``"node:i"`` or a ``TensorRef``."""
        ref = TensorRef.parse(tensor) if isinstance(tensor, str) else tensor
        node = self[ref.node]
        if ref.index >= len(node.outputs):
            raise KeyError(f"{ref} does not exist or has no spec ({node.op} has {len(node.outputs)} specs)")
        return node.outputs[ref.index]


def cached_on_graph(fn: Callable[[GraphIR], T]) -> Callable[[GraphIR], T]:
    """Compute ``fn(graph)`` once per ``GraphIR`` object, for analyses that live outside this module.

    The result is kept on the graph as ``functools.cached_property`` keeps its own (in the instance's
    ``__dict__``): a ``GraphIR`` never changes, and the result goes with it. A new graph (``replace_nodes``, an
    editor's ``finish``) starts with none. Callers must not mutate the result.

    Examples
    --------
    >>> calls = []
    >>> @cached_on_graph
    ... def size(graph: GraphIR) -> int:
    ...     calls.append(graph)
    ...     return len(graph)
    >>> g = GraphIR((OpNode("x", "Const"),))
    >>> size(g), size(g), len(calls), size(g.replace_nodes(g.nodes)), len(calls)
    (1, 1, 1, 1, 2)
    """
    key = f"_cached_on_graph:{fn.__module__}.{fn.__qualname__}"

    @functools.wraps(fn)
    def cached(graph: GraphIR) -> T:
        store = graph.__dict__
        if key not in store:
            store[key] = fn(graph)
        return cast(T, store[key])

    return cached
