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

from collections import deque
from collections.abc import Mapping

import networkx as nx

from tfmem.ir.graph import GraphIR, OpNode, TensorRef
from tfmem.ir.ops import ENTER_OPS, EXIT_OPS, MERGE_OPS, NEXT_ITERATION_OPS, SWITCH_OPS


def find_regions(graph: GraphIR) -> Mapping[str, str]:
    """Map each node inside a v1 control-flow frame to its top-level frame's name.

    Nodes outside every frame are absent from the result. The frame of a node follows TensorFlow's own rule
    (``BuildControlFlowInfo``): an ``Enter`` opens the frame named by its ``frame_name`` attr, an ``Exit`` is the
    last node of its frame (its readers are in the parent frame), and every other node lives in the frame of its
    first input. Keeping ``Exit`` inside means no pass gives it an input from outside the frame, which TensorFlow
    refuses and Grappler crashes on (``tests/test_loops.py``).
    """
    if not any(n.op in ENTER_OPS for n in graph.nodes):
        return {}
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
    return {name: frame[0] for name, frame in frame_of.items() if frame}


def _frame_of(op: str, attrs: Mapping[str, object], incoming: tuple[str, ...]) -> tuple[str, ...]:
    if op in ENTER_OPS:
        frame_name = attrs["frame_name"].s.decode() if "frame_name" in attrs else "frame"  # type: ignore[attr-defined]
        return (*incoming, frame_name)
    return incoming


def _readers_frame(op: str, frame: tuple[str, ...]) -> tuple[str, ...]:
    """The frame that the readers of a node in ``frame`` live in (the parent frame for an ``Exit``)."""
    return frame[:-1] if op in EXIT_OPS else frame


def back_edges(graph: GraphIR) -> frozenset[tuple[str, str]]:
    """The ``NextIteration -> Merge`` edges that close v1 loops (removing them leaves a DAG)."""
    return frozenset(
        (p, n.name) for n in graph.nodes for p in n.predecessors if graph[p].op in NEXT_ITERATION_OPS
    )


def acyclic_view(graph: GraphIR) -> nx.DiGraph:
    """``graph.nx`` without the loops' back edges: a DAG for topological sorts and ancestor walks.

    Read-only, like ``graph.nx``. Raises nothing itself; a cycle outside v1 loops stays a cycle.
    """
    return nx.restricted_view(graph.nx, (), back_edges(graph))


def whole_frame_preds(graph: GraphIR) -> dict[str, tuple[str, ...]]:
    """Each node's predecessors as if every v1 frame ran as one op, loop back edges left out.

    A frame's first nodes wait for everything the frame reads from outside, and a node that reads a frame's
    node waits for the frame's last nodes. A node-level order of the plain predecessors is not enough: with its
    back edges gone, a loop's ``Exit`` waits only for the loop condition, so a gradient loop's result can come
    before the forward layers that feed it (``tests/test_loops.py``). These are a DAG whenever the graph's
    frames and other ops are (``tfmem.ir.execution.ExecutionGraph.unit_preds``).
    """
    loops = back_edges(graph)
    preds = {n.name: tuple(p for p in n.predecessors if (p, n.name) not in loops) for n in graph.nodes}
    regions = find_regions(graph)
    if not regions:
        return preds
    members: dict[str, list[str]] = {}
    for name, region in regions.items():
        members.setdefault(region, []).append(name)
    inner_succs = {p for name, ps in preds.items() if name in regions for p in ps if regions.get(p) == regions[name]}
    last = {r: [m for m in ms if m not in inner_succs] for r, ms in members.items()}

    def outer(ps: tuple[str, ...] | list[str], region: str | None) -> list[str]:
        # a predecessor in another frame stands for that frame's last nodes
        return [q for p in ps for q in ((p,) if regions.get(p) in (None, region) else last[regions[p]])]

    reads = {r: dict.fromkeys(q for m in ms for q in outer(preds[m], r) if regions.get(q) != r)
             for r, ms in members.items()}
    out = {}
    for name, ps in preds.items():
        own = regions.get(name)
        mine = outer(ps, own)
        if own is not None and not any(regions.get(p) == own for p in ps):
            mine += reads[own]   # a first node of its frame
        out[name] = tuple(dict.fromkeys(mine))
    return out


def maybe_dead(graph: GraphIR) -> frozenset[str]:
    """Nodes that a step may skip: those below a TF1 ``cond``'s ``Switch`` (its branches), wherever they are.

    A ``Switch`` outside v1 frames forwards its input on one output and leaves the other *dead*; an op with a
    dead input is dead, control inputs included, and so are its outputs (``Merge`` aside: it forwards whichever
    input is alive). A control edge from a dead op to an op that always runs stops that op, and with it the
    training step (``tests/test_loops.py``). A node is below a branch ``(switch, output)`` if an input is that
    output or is below it; a ``Merge`` is below only what all its inputs are below. A control edge from a
    ``Switch`` itself is as alive as the ``Switch`` (TensorFlow's executor marks only the untaken output dead).
    Nodes in frames are included when they are below a cond outside, but a loop's own ``Switch`` and ``Merge``
    ops guard nothing outside it.

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
    position = {n.name: i for i, n in enumerate(graph.nodes)}
    for name in nx.lexicographical_topological_sort(acyclic_view(graph), key=position.__getitem__):
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
