"""Graph helpers of the testbed: the device strings, placement onto them, and finding variable initializers.

Public names are re-exported by ``tfmem.testbed``; import them from there.
"""

from __future__ import annotations

import difflib
from typing import TypeAlias

import tensorflow as tf

from tfmem.errors import BadInputError
from tfmem.ir.ops import ASSIGN_OPS, VARIABLE_OPS


def device_name(machine: int = 0, job: str = "worker") -> str:
    """The device string of one machine's capped device (job ``worker``) or its host (job ``host``).

    >>> device_name(2), device_name(2, "host")
    ('/job:worker/replica:0/task:2/device:CPU:0', '/job:host/replica:0/task:2/device:CPU:0')
    """
    return f"/job:{job}/replica:0/task:{machine}/device:CPU:0"


DEVICE = device_name(0)
HOST = device_name(0, "host")

GraphLike: TypeAlias = tf.Graph | tf.compat.v1.GraphDef


def calibration_graph(sizes: dict[int, int]) -> tf.Graph:
    """A graph whose peak on each machine is known: on machine ``m`` a random tensor ``x`` of ``sizes[m]`` bytes
    and ``sum(2x + x)`` (``x`` and ``2x`` live at once: ``2 * sizes[m]``, with ``2x + x`` written over ``2x``);
    the sums are added up on machine 0, fetch ``"total:0"``. Random, so Grappler cannot fold it. Sizes of 4 MiB
    and more: a smaller tensor can take a chunk of the allocator's 2 MiB first region whole."""
    g = tf.Graph()
    with g.as_default():
        sums = []
        for m, nbytes in sorted(sizes.items()):
            with tf.device(device_name(m)):
                x = tf.random.uniform([nbytes // 4], seed=m + 1, name=f"x{m}")
                y = tf.multiply(x, 2.0, name=f"y{m}")
                sums.append(tf.reduce_sum(tf.add(y, x, name=f"z{m}"), name=f"s{m}"))
        with tf.device(device_name(0)):
            tf.add_n(sums, name="total")
    return g


def as_graph_def(graph: GraphLike) -> tf.compat.v1.GraphDef:
    """A copy of ``graph`` as a GraphDef."""
    if isinstance(graph, tf.Graph):
        return graph.as_graph_def()
    if isinstance(graph, tf.compat.v1.GraphDef):
        gd = tf.compat.v1.GraphDef()
        gd.CopyFrom(graph)
        return gd
    raise BadInputError(f"testbed: expected a tf.Graph or GraphDef, got {type(graph).__name__}")


def place_on_device(graph: GraphLike, device: str = DEVICE) -> tf.compat.v1.GraphDef:
    """Return a copy of ``graph`` with every node on ``device``, except nodes already placed on a job.

    Nodes whose device names a job (``/job:host/...``, e.g. put there by a pass) keep it; ``/job:localhost``
    (what a local session writes) does not count, since the testbed's cluster has no such job.

    Parameters
    ----------
    graph : tf.Graph or GraphDef
        Not modified.
    device : str
        Where unplaced nodes go; defaults to the testbed's capped device.

    Returns
    -------
    GraphDef

    Examples
    --------
    >>> g = tf.Graph()
    >>> with g.as_default():
    ...     x = tf.constant(1.0, name="x")
    ...     with tf.device(HOST):
    ...         y = tf.identity(x, name="y")
    >>> {n.name: n.device for n in place_on_device(g).node} == {"x": DEVICE, "y": HOST}
    True
    """
    gd = as_graph_def(graph)
    for node in gd.node:
        if "/job:" not in node.device or "/job:localhost" in node.device:
            node.device = device
    return gd


def _node_name(inp: str) -> str:
    return inp.lstrip("^").split(":")[0]


def initializer_names(graph_def: tf.compat.v1.GraphDef) -> list[str]:
    """Names of the ops that initialise the variables of ``graph_def`` (collections are lost in a GraphDef).

    For each variable node ``v`` (``VarHandleOp``, ``VariableV2``), its initializer is the ``Assign`` /
    ``AssignVariableOp`` named ``v/Assign`` whose first input is ``v``: the name every TF variable constructor
    gives it (``tf.Variable``, ``get_variable``, optimizer slots). Variables without one are skipped; pass
    ``init_ops`` to ``Testbed.run`` for graphs that name their initializers otherwise.

    Examples
    --------
    >>> g = tf.Graph()
    >>> with g.as_default():
    ...     v = tf.compat.v1.get_variable("v", shape=[2], initializer=tf.compat.v1.zeros_initializer())
    ...     _ = tf.compat.v1.assign_add(v, [1.0, 1.0], name="update")
    >>> initializer_names(g.as_graph_def())
    ['v/Assign']
    """
    variables = {n.name for n in graph_def.node if n.op in VARIABLE_OPS}
    return [
        n.name for n in graph_def.node
        if n.op in ASSIGN_OPS and n.input and _node_name(n.input[0]) in variables
        and n.name == f"{_node_name(n.input[0])}/Assign"
    ]


def check_names(graph_def: tf.compat.v1.GraphDef, names: list[str]) -> None:
    """Raise ``BadInputError`` naming the first fetch or feed that is not a node of ``graph_def``."""
    nodes = {n.name for n in graph_def.node}
    for name in names:
        if name.split(":")[0] not in nodes:
            close = difflib.get_close_matches(name.split(":")[0], nodes, n=3)
            raise BadInputError(
                f"testbed: {name!r} (a fetch or feed) names no node of the graph; close names: {close}. "
                f"Fetch tensors as 'node:index' and ops as 'node'."
            )
