"""``verify(graph)``: the one well-formedness check every pass's output must pass.

Checks unique names, inputs that name existing nodes and outputs, an acyclic graph outside v1 loop back
edges, reads of outputs that exist, and that every swap-in (``_tfmem_swap_in``) reads a swap-out.
"""

from __future__ import annotations

import networkx as nx

from tfmem.errors import MalformedGraphError
from tfmem.ir.frames import back_edges
from tfmem.ir.graph import GraphIR

SWAP_IN_ATTR = "_tfmem_swap_in"
SWAP_OUT_ATTR = "_tfmem_swap_out"


def verify(graph: GraphIR) -> None:
    """Raise ``MalformedGraphError`` naming the offending node and its neighbours if ``graph`` is malformed.

    Examples
    --------
    >>> import tensorflow as tf
    >>> from tfmem.ir.shapes import annotate
    >>> g = tf.Graph()
    >>> with g.as_default():
    ...     _ = tf.identity(tf.constant(1.0), name="y")
    >>> verify(annotate(g.as_graph_def()))
    """
    graph.check_references()
    names = [n.name for n in graph.nodes]
    for node in graph.nodes:
        for t in node.inputs:
            producer = graph[t.node]
            if graph.annotated and t.index >= len(producer.outputs):
                _fail(graph, names, node.name, f"reads {t}, but {t.node} has {len(producer.outputs)} output(s)")
        if node.attr_bool(SWAP_IN_ATTR) and not any(graph[t.node].attr_bool(SWAP_OUT_ATTR) for t in node.inputs):
            _fail(graph, names, node.name, "is a swap-in whose input is not a swap-out")
    dag = nx.DiGraph(graph.nx)
    dag.remove_edges_from(back_edges(graph))
    if not nx.is_directed_acyclic_graph(dag):
        cycle = nx.find_cycle(dag)
        _fail(graph, names, cycle[0][0], "is on a cycle: " + " -> ".join(u for u, _ in cycle[:8]))


def _fail(graph: GraphIR, names: list[str], name: str, problem: str) -> None:
    i = names.index(name)
    context = ", ".join(names[max(0, i - 5): i + 6])
    raise MalformedGraphError(f"node {name!r} {problem} (nearby nodes: {context})")
