"""Where TensorFlow's placer runs the ops a graph leaves unplaced, written into the graph.

On one device an op with no device string runs on the device, and the planner reads it so. Across several
machines it does not: TensorFlow's placer puts an op with a ``_class`` colocation constraint (``loc:@var``:
initialisers, optimizer updates, slot variables) and an op that reads a resource or reference tensor (a
variable's ``ReadVariableOp``) on the device of the op it is tied to, and only the rest on the session's
default device. A variable's reads on machine 1 run on machine 1, even where the graph names machine 0 for them
(the testbed's step stats: tests/test_optimize_devices.py), so a plan for machine 0 must not count them.

Examples
--------
>>> import tensorflow as tf
>>> from tfmem.ir.shapes import annotate
>>> g = tf.Graph()
>>> with g.as_default():
...     with tf.device("/job:worker/task:1"):
...         v = tf.Variable(1.0, name="v")
...     y = tf.identity(v.read_value() * 2.0, name="y")
>>> placed = placed_as_tensorflow_would(annotate(g.as_graph_def()), "/job:worker/task:0")
>>> read = next(n for n in placed.nodes if n.op == "ReadVariableOp" and not n.name.startswith("v/"))
>>> read.device, placed["y"].device
('/job:worker/task:1', '/job:worker/task:0')
"""

from __future__ import annotations

from tfmem.ir.editor import GraphEditor
from tfmem.ir.graph import GraphIR, OpNode

COLOCATION_ATTR = "_class"


def colocated_with(node: OpNode) -> list[str]:
    """The ops ``node``'s ``_class`` attribute colocates it with (``loc:@name`` entries)."""
    value = node.attrs.get(COLOCATION_ATTR)
    if value is None:
        return []
    return [s.decode()[5:] for s in value.list.s if s.startswith(b"loc:@")]


def _ties_to_producer(dtype: str) -> bool:
    """Whether a tensor of ``dtype`` ties its reader to its producer's device (a resource handle, a ref)."""
    return dtype == "resource" or dtype.endswith("_ref")


def placed_as_tensorflow_would(graph: GraphIR, default: str) -> GraphIR:
    """``graph`` with every unplaced op given the device TensorFlow's placer runs it on: that of the ops it is
    colocated with (``_class``, or through a resource or reference input it reads, transitively), or
    ``default`` when none of those is placed. Placed ops keep their device; ``graph`` when nothing changes.
    """
    parent: dict[str, str] = {}

    def root(name: str) -> str:
        while parent.get(name, name) != name:
            parent[name] = parent.get(parent[name], parent[name])   # halve the path
            name = parent[name]
        return name

    def join(a: str, b: str) -> None:
        ra, rb = root(a), root(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)

    for node in graph.nodes:
        for other in colocated_with(node):
            if other in graph:
                join(node.name, other)
        for ref in node.inputs:
            producer = graph.by_name.get(ref.node)
            if producer is not None and ref.index < len(producer.outputs) \
                    and _ties_to_producer(producer.outputs[ref.index].dtype):
                join(node.name, ref.node)
    group_device: dict[str, str] = {}
    for node in graph.nodes:   # graph order: the first placed op of a group decides, as the placer's merge would
        if node.device:
            group_device.setdefault(root(node.name), node.device)
    unplaced = [n.name for n in graph.nodes if not n.device]
    if not unplaced:
        return graph
    editor = GraphEditor(graph)
    for name in unplaced:
        editor.set_device(name, group_device.get(root(name), default))
    return editor.finish()
