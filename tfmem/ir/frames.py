"""Find TF1 control-flow frames (``Enter``/``Exit``/``Merge``/``Switch``/``NextIteration``), opaque regions, and
the branches of TF1 conds (``maybe_dead``).

A v1 while loop is a cycle in the GraphDef (``NextIteration`` feeds ``Merge``). tfmem never looks inside
one: every node of a top-level frame belongs to one opaque *region*, which the simulator treats as a single
op and the passes never cut. Functional ops (``While``, ``If``, ``PartitionedCall``) are single nodes already
and stay opaque on their own.

Examples
--------
>>> import tensorflow as tf
>>> g = tf.Graph()
>>> with g.as_default():
...     tf.compat.v1.disable_control_flow_v2()
...     r = tf.compat.v1.while_loop(lambda i: i < 3, lambda i: i + 1, [tf.constant(0)], name="loop")
...     tf.compat.v1.enable_control_flow_v2()
>>> from tfmem.ir.graph import GraphIR
>>> regions = find_regions(GraphIR.from_graph_def(g.as_graph_def()))
>>> sorted(set(regions.values()))
['loop/while_context']
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Mapping
from types import MappingProxyType

import networkx as nx

from tfmem.errors import MalformedGraphError
from tfmem.ir.graph import GraphIR, OpNode, TensorRef, cached_on_graph
from tfmem.ir.ops import ENTER_OPS, EXIT_OPS, MERGE_OPS, NEXT_ITERATION_OPS, SWITCH_OPS


@cached_on_graph
def find_regions(graph: GraphIR) -> Mapping[str, str]:
    """Map each node inside a v1 control-flow frame to its top-level frame's name.

    Nodes outside every frame are absent from the result. The frame of a node follows TensorFlow's own rule
    (``BuildControlFlowInfo``): an ``Enter`` opens the frame named by its ``frame_name`` attr, an ``Exit`` is the
    last node of its frame (its readers are in the parent frame), and every other node lives in the frame of its
    first input. Keeping ``Exit`` inside means no pass gives it an input from outside the frame, which TensorFlow
    refuses and Grappler crashes on (``tests/test_loops.py``). Computed once per graph object.
    """
    if not any(n.op in ENTER_OPS for n in graph.nodes):
        return MappingProxyType({})
    frame_of: dict[str, tuple[str, ...]] = {}
    queue = deque(n.name for n in graph.nodes if not n.predecessors)
    for name in queue:
        frame_of[name] = ()
    while queue:
        name = queue.popleft()
        for succ_name in graph.successors[name]:
            if succ_name in frame_of:
                continue
            succ = graph[succ_name]
            first = succ.predecessors[0] if succ.predecessors[0] in frame_of else name
            frame_of[succ_name] = _frame_of(succ.op, succ.attrs, _readers_frame(graph[first].op, frame_of[first]))
            queue.append(succ_name)
    return MappingProxyType({name: frame[0] for name, frame in frame_of.items() if frame})


def _frame_of(op: str, attrs: Mapping[str, object], incoming: tuple[str, ...]) -> tuple[str, ...]:
    if op in ENTER_OPS:
        frame_name = attrs["frame_name"].s.decode() if "frame_name" in attrs else "frame"  # type: ignore[attr-defined]
        return (*incoming, frame_name)
    return incoming


def _readers_frame(op: str, frame: tuple[str, ...]) -> tuple[str, ...]:
    """The frame that the readers of a node in ``frame`` live in (the parent frame for an ``Exit``)."""
    return frame[:-1] if op in EXIT_OPS else frame


@cached_on_graph
def region_members(graph: GraphIR) -> Mapping[str, tuple[str, ...]]:
    """Each top-level frame's nodes (``find_regions`` turned around), in GraphDef order."""
    regions = find_regions(graph)
    members: dict[str, list[str]] = {}
    for n in graph.nodes:
        if n.name in regions:
            members.setdefault(regions[n.name], []).append(n.name)
    return MappingProxyType({r: tuple(ms) for r, ms in members.items()})


@cached_on_graph
def back_edges(graph: GraphIR) -> frozenset[tuple[str, str]]:
    """The ``NextIteration -> Merge`` edges that close v1 loops (removing them leaves a DAG)."""
    return frozenset((n.name, s) for n in graph.nodes if n.op in NEXT_ITERATION_OPS for s in graph.successors[n.name])


def acyclic_view(graph: GraphIR) -> nx.DiGraph:
    """``graph.nx`` without the loops' back edges: a DAG for ancestor walks (``topological_order`` sorts it).

    Read-only, like ``graph.nx``. Raises nothing itself; a cycle outside v1 loops stays a cycle.
    """
    return nx.restricted_view(graph.nx, (), back_edges(graph))


@cached_on_graph
def topological_order(graph: GraphIR) -> tuple[str, ...]:
    """Node names in a topological order of ``acyclic_view(graph)``: GraphDef order wherever that is one, else
    the nearest to it (the order networkx's ``lexicographical_topological_sort`` gives, keyed by position).

    Computed once per graph object.

    Raises
    ------
    MalformedGraphError
        When the graph has a cycle outside v1 loops (TensorFlow would refuse to run it).

    Examples
    --------
    >>> from tfmem.ir.graph import OpNode
    >>> g = GraphIR((OpNode("b", "Identity", (TensorRef("a"),)), OpNode("a", "Const"), OpNode("c", "Const")))
    >>> topological_order(g)
    ('a', 'b', 'c')
    """
    loops = back_edges(graph)
    position = {n.name: i for i, n in enumerate(graph.nodes)}
    edges = [(p, s) for p, succs in graph.successors.items() for s in succs if (p, s) not in loops]
    if all(position[p] < position[s] for p, s in edges):
        return tuple(n.name for n in graph.nodes)   # GraphDef order is one (the usual case)
    waiting = dict.fromkeys(position, 0)
    for _, s in edges:
        waiting[s] += 1
    ready = [position[name] for name, count in waiting.items() if not count]
    heapq.heapify(ready)
    order: list[str] = []
    while ready:
        name = graph.nodes[heapq.heappop(ready)].name
        order.append(name)
        for succ in graph.successors[name]:
            if (name, succ) not in loops:
                waiting[succ] -= 1
                if not waiting[succ]:
                    heapq.heappush(ready, position[succ])
    if len(order) < len(graph.nodes):
        left = [n for n, count in waiting.items() if count]
        cycle = [u for u, _ in nx.find_cycle(acyclic_view(graph).subgraph(left))]
        raise MalformedGraphError(f"the graph has a cycle outside v1 loops: {' -> '.join(cycle[:8])}"
                                  f"{' -> ...' if len(cycle) > 8 else ''} -> {cycle[0]}; TensorFlow cannot run it")
    return tuple(order)


@cached_on_graph
def whole_frame_preds(graph: GraphIR) -> Mapping[str, tuple[str, ...]]:
    """Each node's predecessors as if every v1 frame ran as one op, loop back edges left out.

    A frame's first nodes wait for everything the frame reads from outside, and a node that reads a frame's
    node waits for the frame's last nodes. A node-level order of the plain predecessors is not enough: with its
    back edges gone, a loop's ``Exit`` waits only for the loop condition, so a gradient loop's result can come
    before the forward layers that feed it (``tests/test_loops.py``). These are a DAG whenever the graph's
    frames and other ops are (``tfmem.ir.execution.ExecutionGraph.unit_preds``).

    One node stands for each end of a frame, so that the edges grow with the graph, not with the product of a
    frame's reads and first nodes: the frame's *entry* (its first first node in GraphDef order) waits for what
    the frame reads, and its other first nodes wait for the entry; its *exit* (its last last node) waits for the
    other last nodes, and a reader outside waits for the exit. Computed once per graph object.
    """
    loops = back_edges(graph)
    preds = {n.name: tuple(p for p in n.predecessors if (p, n.name) not in loops) for n in graph.nodes}
    regions = find_regions(graph)
    if not regions:
        return MappingProxyType(preds)
    members = region_members(graph)
    feeds_own_frame = {p for name, ps in preds.items() if name in regions for p in ps if regions.get(p) == regions[name]}
    firsts = {m for ms in members.values() for m in ms if not any(regions.get(p) == regions[m] for p in preds[m])}
    entry = {r: next(m for m in ms if m in firsts) for r, ms in members.items()}
    lasts = {r: [m for m in ms if m not in feeds_own_frame] for r, ms in members.items()}
    exit_of = {r: ms[-1] for r, ms in lasts.items()}

    def outer(ps: tuple[str, ...], region: str | None) -> list[str]:
        # a predecessor in another frame stands for that frame's exit
        return [p if regions.get(p) in (None, region) else exit_of[regions[p]] for p in ps]

    reads = {r: dict.fromkeys(q for m in ms for q in outer(preds[m], r) if regions.get(q) != r)
             for r, ms in members.items()}
    out = {}
    for name, ps in preds.items():
        own = regions.get(name)
        mine = outer(ps, own)
        if own is not None:
            if name == entry[own]:
                mine += reads[own]
            elif name in firsts:
                mine.append(entry[own])
            if name == exit_of[own]:
                mine += (m for m in lasts[own] if m != name)
        out[name] = tuple(dict.fromkeys(mine))
    return MappingProxyType(out)


@cached_on_graph
def maybe_dead(graph: GraphIR) -> frozenset[str]:
    """Nodes that a step may skip: those below a TF1 ``cond``'s ``Switch`` (its branches), wherever they are.

    A ``Switch`` outside v1 frames forwards its input on one output and leaves the other *dead*; an op with a
    dead input is dead, control inputs included, and so are its outputs (``Merge`` aside: it forwards whichever
    input is alive). A control edge from a dead op to an op that always runs stops that op, and with it the
    training step (``tests/test_loops.py``). A node is below a branch ``(switch, output)`` if an input is that
    output or is below it; a ``Merge`` is below only what all its inputs are below. A control edge from a
    ``Switch`` itself is as alive as the ``Switch`` (TensorFlow's executor marks only the untaken output dead).
    Nodes in frames are included when they are below a cond outside, but a loop's own ``Switch`` and ``Merge``
    ops guard nothing outside it. Computed once per graph object.

    A ``Switch`` is in the result only if its input may be dead: one of its outputs is dead every step, so
    ask ``may_be_dead`` about a tensor, and use this set for control edges.

    Examples
    --------
    >>> import tensorflow as tf
    >>> g = tf.Graph()
    >>> with g.as_default():
    ...     tf.compat.v1.disable_control_flow_v2()
    ...     x = tf.compat.v1.placeholder(tf.float32, (), name="x")
    ...     y = tf.identity(tf.compat.v1.cond(x > 0, lambda: x * 2.0, lambda: x - 1.0), name="y")
    ...     tf.compat.v1.enable_control_flow_v2()
    >>> dead = maybe_dead(GraphIR.from_graph_def(g.as_graph_def()))
    >>> "cond/mul" in dead, "y" in dead, "x" in dead, "cond/mul/Switch" in dead
    (True, False, False, False)
    """
    regions = find_regions(graph)
    if not any(n.op in SWITCH_OPS and n.name not in regions for n in graph.nodes):
        return frozenset()
    below: dict[str, frozenset[tuple[str, int]]] = {}
    for name in topological_order(graph):
        node = graph[name]
        reads = [below.get(t.node, frozenset()) | ({(t.node, t.index)} if _branches(graph[t.node], regions) else set())
                 for t in node.inputs]
        after = [below.get(c, frozenset()) for c in node.control_inputs]
        if node.op in MERGE_OPS and name not in regions and reads:
            below[name] = frozenset.intersection(*reads).union(*after)
        else:
            below[name] = frozenset().union(*reads, *after)
    return frozenset(name for name, guards in below.items() if guards)


def may_be_dead(graph: GraphIR, tensor: TensorRef) -> bool:
    """Whether a step may skip ``tensor``: its op may be dead (``maybe_dead``), or it is an output of a ``Switch``.

    Ask this of every tensor a pass makes a new op read where that op then holds back others (a fence, a
    receipt): one output of each ``Switch`` is dead every step, though the ``Switch`` itself is not.

    Examples
    --------
    >>> import tensorflow as tf
    >>> g = tf.Graph()
    >>> with g.as_default():
    ...     tf.compat.v1.disable_control_flow_v2()
    ...     x = tf.compat.v1.placeholder(tf.float32, (), name="x")
    ...     y = tf.identity(tf.compat.v1.cond(x > 0, lambda: x * 2.0, lambda: x - 1.0), name="y")
    ...     tf.compat.v1.enable_control_flow_v2()
    >>> ir = GraphIR.from_graph_def(g.as_graph_def())
    >>> [may_be_dead(ir, TensorRef(name, i)) for name, i in (("cond/mul/Switch", 1), ("cond/Merge", 0), ("y", 0))]
    [True, False, False]
    """
    return graph[tensor.node].op in SWITCH_OPS or tensor.node in maybe_dead(graph)


def _branches(node: OpNode, regions: Mapping[str, str]) -> bool:
    return node.op in SWITCH_OPS and node.name not in regions
