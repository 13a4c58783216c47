"""Functional control flow lowered to what the session runs: ``While``/``If`` to v1 frames, calls inlined.

TensorFlow's runtime lowers a graph's functional ``While`` and ``If`` ops (TF2 control flow, also in TF1 graphs
built with control flow v2, as ``tf.compat.v1.nn.dynamic_rnn`` and tf_keras RNN layers are) to v1 frames before
it runs them, and inlines function calls. tfmem plans the lowered graph: a loop is then one unit whose lists the
simulator follows (``tfmem.sim.tensor_list_memory``) and whose handed-on lists a swap can move
(``passes.swap_activations``); the functional op's outputs have partial shapes a plan cannot size. Grappler's
function optimizer alone does the lowering, as for ``tf.function`` steps (``tfmem.traced``), so no other rewrite
changes what the user wrote.
"""

from __future__ import annotations

from collections.abc import Sequence

from tensorflow.core.framework import graph_pb2
from tensorflow.core.protobuf import config_pb2, meta_graph_pb2
from tensorflow.python.grappler import tf_optimizer

from tfmem.errors import MalformedGraphError, first_line
from tfmem.sim.grappler import grappler_cluster

LOOP_OPS = frozenset({"While", "StatelessWhile"})


def has_functional_loops(gd: graph_pb2.GraphDef) -> bool:
    """Whether ``gd`` has a functional loop among its own nodes: what ``optimize`` lowers a TF1 graph for. A graph
    with conditionals or calls only (an assertion's ``If``) is planned as written: its ops are sized already, and
    lowering would give the plan a v1 ``cond`` (``tests/test_loops.py``, assertions planned as without)."""
    return bool(gd.library.function) and any(n.op in LOOP_OPS for n in gd.node)


def lower_functional(gd: graph_pb2.GraphDef, keep: Sequence[str]) -> graph_pb2.GraphDef:
    """``gd`` with nested function calls inlined and ``If``/``While`` lowered, by Grappler's function optimizer
    alone; ``keep`` names the nodes whose names must survive (the fetches). A graph without functions comes back
    as a copy."""
    if not gd.library.function:
        out = graph_pb2.GraphDef()
        out.CopyFrom(gd)
        return out
    config = config_pb2.ConfigProto()
    rewrite = config.graph_options.rewrite_options
    rewrite.optimizers.append("function")
    rewrite.min_graph_nodes = -1
    meta = meta_graph_pb2.MetaGraphDef()
    meta.graph_def.CopyFrom(gd)
    meta.collection_def["train_op"].node_list.value.extend(keep)
    try:
        return tf_optimizer.OptimizeGraph(config, meta, cluster=grappler_cluster())   # TF allows one cluster at a time
    except Exception as e:
        raise MalformedGraphError(f"TensorFlow cannot inline the graph's functions: {first_line(e)}") from e
