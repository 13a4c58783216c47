"""What one ``Session.run`` executes: the pruned subgraph, its schedulable units, and each tensor's role.

Shared by the memory simulator and the passes. ``ExecutionGraph.build`` prunes the graph to the ancestors of
the fetches (fed tensors cut the walk, as in TensorFlow), folds each v1 control-flow frame into one unit, and
classifies outputs: persistent (constants, variable storage), fed, aliases of another buffer (``Identity``,
``Reshape``, ``ReadVariableOp``...) or ordinary transients.
"""

from __future__ import annotations

import difflib
import heapq
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

from tfmem.errors import BadInputError, MalformedGraphError
from tfmem.ir.frames import back_edges, find_regions, region_members
from tfmem.ir.graph import GraphIR, OpNode, TensorRef
from tfmem.ir.ops import ALIAS_OPS, PLACEHOLDER_OPS

# Out-edges a TF ``EdgeSet`` keeps in insertion order (64 bytes of pointers); more go to a hash set.
EDGE_SET_INLINE = 8


def hash_order(source: str, succs: Sequence[str], seed: int = 0) -> tuple[str, ...]:
    """``succs`` in a pseudo-random order fixed by ``seed``: how TF iterates a node's out-edges once hashed."""
    return tuple(sorted(succs, key=lambda s: zlib.crc32(f"{seed}:{source}->{s}".encode())))


_FETCH_EXAMPLE = "name a tensor ('loss:0') or an op ('train_op')"


def fetch_names(fetches: object) -> list[str]:
    """The names in ``fetches``: a name, a ``tf.Tensor``/``tf.Operation``, or an iterable of those.

    Raises
    ------
    BadInputError
        When ``fetches`` is empty or holds something that is not a name (a number, None, an empty string).

    Examples
    --------
    >>> fetch_names("loss:0"), fetch_names(["loss:0", "train_op"])
    (['loss:0'], ['loss:0', 'train_op'])
    >>> fetch_names(3)
    Traceback (most recent call last):
    ...
    tfmem.errors.BadInputError: fetches must be a name or a list of names, got 3 (int); name a tensor ('loss:0') or an op ('train_op')
    """
    if isinstance(fetches, str | TensorRef) or isinstance(getattr(fetches, "name", None), str):
        items: list[object] = [fetches]
    elif isinstance(fetches, Iterable) and not isinstance(fetches, bytes | Mapping):
        items = list(fetches)
    else:
        raise BadInputError(f"fetches must be a name or a list of names, got {fetches!r} ({type(fetches).__name__}); "
                            f"{_FETCH_EXAMPLE}")
    if not items:
        raise BadInputError(f"no fetches given; {_FETCH_EXAMPLE}")
    return [_fetch_name(f) for f in items]


def _fetch_name(fetch: object) -> str:
    name = str(fetch) if isinstance(fetch, TensorRef) else getattr(fetch, "name", fetch)  # tf.Tensor / tf.Operation
    if not isinstance(name, str) or not name.strip():
        kind = "" if isinstance(name, str) else f" ({type(fetch).__name__})"
        raise BadInputError(f"fetch {fetch!r}{kind} is not a tensor or op name; {_FETCH_EXAMPLE}")
    return name


def parse_fetches(graph: GraphIR, fetches: Iterable[str | TensorRef]) -> tuple[list[TensorRef], list[str]]:
    """Split fetches into tensors (``"y:0"``) and targets (op names such as ``"train_op"``), as TF does.

    Raises
    ------
    BadInputError
        For a fetch that names no tensor or op of ``graph`` (with the closest names it has).
    """
    tensors, targets = [], []
    for name in fetch_names(fetches):
        if ":" in name:
            node, _, index = name.rpartition(":")
            if not index.isdigit():
                raise BadInputError(f"fetch {name!r} is not a tensor name: write NODE:INDEX with the output's index, "
                                    f"e.g. '{node}:0'")
            ref = TensorRef(node, int(index))
        else:
            if name not in graph:
                raise BadInputError(f"fetch {name!r} is not an op of the graph{_did_you_mean(graph, name)}")
            targets.append(name)
            continue
        if ref.node not in graph:
            raise BadInputError(f"fetch {ref} is not a tensor of the graph: it has no op {ref.node!r}"
                                f"{_did_you_mean(graph, ref.node)}")
        outputs = len(graph[ref.node].outputs)
        if ref.index >= max(outputs, 1):
            raise BadInputError(f"fetch {ref} is not a tensor of the graph: {ref.node} ({graph[ref.node].op}) has "
                                f"{outputs} output(s)" + (f"; fetch {ref.node}:0" if outputs else
                                                          f"; fetch the op itself, {ref.node!r}"))
        tensors.append(ref)
    return tensors, targets


def _did_you_mean(graph: GraphIR, name: str) -> str:
    close = difflib.get_close_matches(name, list(graph.by_name), n=3)
    return f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""


@dataclass(frozen=True)
class ExecutionGraph:
    """The units (ops, or whole v1 frames) one step runs, with their dependences in graph order."""

    graph: GraphIR
    fetched: frozenset[TensorRef]
    fed: frozenset[TensorRef]
    needed: tuple[str, ...]                 # node names, GraphDef order
    unit_of: Mapping[str, str]              # node -> unit (itself, or "frame:<name>")
    units: tuple[str, ...]                  # GraphDef order of each unit's first node
    members: Mapping[str, tuple[str, ...]]  # unit -> its nodes

    @classmethod
    def build(
        cls, graph: GraphIR, fetches: Iterable[str | TensorRef], feeds: Iterable[str | TensorRef] = ()
    ) -> ExecutionGraph:
        tensors, targets = parse_fetches(graph, fetches)
        fed = {TensorRef.parse(f) if isinstance(f, str) else f for f in feeds}
        regions = find_regions(graph)
        needed = _ancestors(graph, [t.node for t in tensors] + targets, fed)
        for node in needed:  # TF requires every reachable placeholder to be fed
            if graph[node].op in PLACEHOLDER_OPS:
                fed.add(TensorRef(node, 0))
        unit_of = {n: ("frame:" + regions[n]) if n in regions else n for n in needed}
        members: dict[str, list[str]] = {}
        for n in needed:
            members.setdefault(unit_of[n], []).append(n)
        return cls(graph, frozenset(tensors), frozenset(fed), tuple(needed), unit_of, tuple(members),
                   {u: tuple(m) for u, m in members.items()})

    @cached_property
    def unit_preds(self) -> Mapping[str, tuple[str, ...]]:
        loops = back_edges(self.graph)
        preds: dict[str, dict[str, None]] = {u: {} for u in self.units}
        for n in self.needed:
            u = self.unit_of[n]
            node = self.graph[n]
            sources = [t.node for t in node.inputs if t not in self.fed] + list(node.control_inputs)
            for p in sources:
                if (p, n) not in loops and p in self.unit_of and self.unit_of[p] != u:
                    preds[u][self.unit_of[p]] = None
        return {u: tuple(p) for u, p in preds.items()}

    @cached_property
    def topological_units(self) -> tuple[str, ...]:
        """``units`` in a topological order: GraphDef order wherever that is one, else the nearest to it.

        A v1 frame's unit sits at its first node, and gradients add nodes that feed it later (a stack that the
        forward loop pushes to), so GraphDef order alone can put a frame before its inputs
        (``tests/test_loops.py``).

        Raises
        ------
        MalformedGraphError
            When the units form a cycle (a graph TensorFlow cannot run): no order would hold every unit.
        """
        position = {u: i for i, u in enumerate(self.units)}
        pending = {u: len(self.unit_preds[u]) for u in self.units}
        succs: dict[str, list[str]] = {u: [] for u in self.units}
        for u in self.units:
            for p in self.unit_preds[u]:
                succs[p].append(u)
        ready = [position[u] for u in self.units if not pending[u]]
        heapq.heapify(ready)
        order = []
        while ready:
            u = self.units[heapq.heappop(ready)]
            order.append(u)
            for s in succs[u]:
                pending[s] -= 1
                if not pending[s]:
                    heapq.heappush(ready, position[s])
        if len(order) < len(self.units):
            cyclic = [u for u in self.units if pending[u]]
            raise MalformedGraphError(f"{len(cyclic)} ops never become ready: they are on a cycle outside v1 loops, or "
                                      f"wait for one (e.g. {', '.join(cyclic[:5])}); TensorFlow cannot run the graph")
        return tuple(order)

    @cached_property
    def unit_succs(self) -> Mapping[str, tuple[str, ...]]:
        """Successors in the order TF's executor activates them (``activation_order(0)``)."""
        return self.activation_order(0)

    def activation_order(self, seed: int) -> Mapping[str, tuple[str, ...]]:
        """Successors in the order TF's executor activates them, for one draw ``seed`` of the hashed orders.

        The executor walks a node's out-edges in ``EdgeSet`` order: up to ``EDGE_SET_INLINE`` edges sit in an
        array in the order they were added (data consumers as the graph is built, here GraphDef order, then
        control ones); beyond that they move to a hash set keyed by the edges' addresses, an order that differs
        between processes and that no one can predict. Those successors come in ``hash_order(seed)``.
        """
        cached = self._activation_orders.get(seed)
        if cached is None:
            data, fan_out = self._successors
            cached = self._activation_orders[seed] = {
                u: hash_order(u, succs, seed) if fan_out[u] > EDGE_SET_INLINE else succs for u, succs in data.items()
            }
        return cached

    @cached_property
    def _activation_orders(self) -> dict[int, Mapping[str, tuple[str, ...]]]:
        return {}

    @cached_property
    def _successors(self) -> tuple[dict[str, tuple[str, ...]], dict[str, int]]:
        """Per unit: successors as edges were added (data consumers, then control ones), and its edge count."""
        data: dict[str, dict[str, None]] = {u: {} for u in self.units}
        control: dict[str, dict[str, None]] = {u: {} for u in self.units}
        edges = dict.fromkeys(self.units, 0)
        for n in self.needed:
            u = self.unit_of[n]
            node = self.graph[n]
            for t in node.inputs:
                p = self.unit_of.get(t.node)
                if p is not None and p != u and p in self.unit_preds[u]:
                    data[p][u] = None
                    edges[p] += 1
            for c in node.control_inputs:
                p = self.unit_of.get(c)
                if p is not None and p != u and p in self.unit_preds[u]:
                    control[p][u] = None
                    edges[p] += 1
        return {u: tuple(data[u]) + tuple(c for c in control[u] if c not in data[u]) for u in self.units}, edges

    def consumers(self, tensor: TensorRef) -> tuple[str, ...]:
        """Units (other than the producer's own) that read ``tensor`` in this step."""
        cached = self._consumers.get(tensor)
        if cached is None:
            own = self.unit_of.get(tensor.node)
            out = dict.fromkeys(
                self.unit_of[c] for c in self.graph.consumers.get(tensor, ()) if c in self.unit_of
            )
            out.pop(own, None)  # type: ignore[arg-type]
            cached = self._consumers[tensor] = tuple(out)
        return cached

    @cached_property
    def _consumers(self) -> dict[TensorRef, tuple[str, ...]]:
        return {}  # filled lazily by consumers(): a frozen dataclass can still own a mutable cache

    @cached_property
    def unit_inputs(self) -> Mapping[str, tuple[TensorRef, ...]]:
        """Per unit, the tensors it reads from outside itself (fed tensors included), each once."""
        out = {}
        for u in self.units:
            inside = set(self.members[u])
            out[u] = tuple(dict.fromkeys(
                t for n in self.members[u] for t in self.graph[n].inputs if t.node not in inside
            ))
        return out

    def is_region(self, unit: str) -> bool:
        return unit.startswith("frame:")

    def outputs_of(self, unit: str) -> list[TensorRef]:
        """Tensors a unit makes visible outside itself (all outputs of a plain op)."""
        if not self.is_region(unit):
            return self._plain_outputs[unit]
        inside = set(self.members[unit])
        return [
            TensorRef(n, i)
            for n in self.members[unit]
            for i in range(len(self.graph[n].outputs))
            if TensorRef(n, i) in self.fetched
            or any(c not in inside for c in self.graph.consumers.get(TensorRef(n, i), ()))
        ]

    @cached_property
    def _plain_outputs(self) -> dict[str, list[TensorRef]]:
        return {u: [TensorRef(u, i) for i in range(len(self.graph[u].outputs))]
                for u in self.units if not self.is_region(u)}

    def internal_tensors(self, unit: str) -> list[TensorRef]:
        """Tensors that live and die inside a region (its per-iteration working set)."""
        if not self.is_region(unit):
            return []
        visible = set(self.outputs_of(unit))
        return [
            TensorRef(n, i) for n in self.members[unit] if self.graph[n].op not in ALIAS_OPS
            for i in range(len(self.graph[n].outputs)) if TensorRef(n, i) not in visible
        ]


def _ancestors(graph: GraphIR, roots: Sequence[str], fed: set[TensorRef]) -> list[str]:
    regions, members = find_regions(graph), region_members(graph)
    seen: set[str] = set()
    stack = list(roots)
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        node = graph[name]
        if name in regions:  # a frame runs whole: pull in every member
            stack.extend(m for m in members[regions[name]] if m not in seen)
        stack.extend(_needed_preds(node, fed))
    return [n.name for n in graph.nodes if n.name in seen]


def _needed_preds(node: OpNode, fed: set[TensorRef]) -> list[str]:
    preds = [t.node for t in node.inputs if t not in fed]
    return preds + list(node.control_inputs)
