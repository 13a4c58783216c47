"""Run TensorFlow's graph optimizer (Grappler) offline, exactly as a ``Session`` would before executing.

A session never executes the GraphDef it is given: Grappler first folds constants, removes identity chains
and control-dependency tuples, fuses ``MatMul+BiasAdd+Relu`` and so on. Those rewrites change which tensors
exist and when ops become ready, so the simulator replays the *optimized* graph. ``runtime_graph_def`` calls
Grappler's meta-optimizer with the session's ``ConfigProto`` on a virtual cluster of this machine's devices.
"""

from __future__ import annotations

from collections.abc import Iterable

from tensorflow.core.framework import graph_pb2, node_def_pb2
from tensorflow.core.protobuf import config_pb2, meta_graph_pb2
from tensorflow.python.grappler import cluster as gcluster
from tensorflow.python.grappler import tf_optimizer

from tfmem.devices import DEFAULT_DEVICE, with_default_device
from tfmem.errors import MalformedGraphError, first_line
from tfmem.ir import GraphIR, TensorRef

_CLUSTER: gcluster.Cluster | None = None


def _cluster() -> gcluster.Cluster:
    global _CLUSTER
    if _CLUSTER is None:  # creating one costs ~10 ms and some threads; one per process is plenty
        _CLUSTER = gcluster.Cluster(disable_detailed_stats=True, disable_timeline=True)
    return _CLUSTER


def runtime_graph_def(
    graph_def: graph_pb2.GraphDef,
    fetches: Iterable[str],
    config: config_pb2.ConfigProto | None = None,
) -> graph_pb2.GraphDef:
    """The GraphDef a session would execute for ``fetches`` after Grappler's rewrites.

    ``fetches`` are tensor or op names; their nodes are kept. Returns ``graph_def`` unchanged when the config
    disables the meta-optimizer.

    Examples
    --------
    >>> import tensorflow as tf
    >>> g = tf.Graph()
    >>> with g.as_default():
    ...     x = tf.compat.v1.placeholder(tf.float32, (2,), name="x")
    ...     y = tf.identity(tf.identity(x) * 2.0, name="y")
    >>> [n.op for n in runtime_graph_def(g.as_graph_def(), ["y:0"]).node]
    ['Const', 'Placeholder', 'Mul', 'Identity']
    """
    config = config or config_pb2.ConfigProto()
    if config.graph_options.rewrite_options.disable_meta_optimizer:
        return graph_def
    meta = meta_graph_pb2.MetaGraphDef()
    meta.graph_def.CopyFrom(graph_def)
    keep = meta.collection_def["train_op"].node_list.value
    for f in fetches:
        keep.append(TensorRef.parse(f).node if ":" in f else f)
    try:
        return tf_optimizer.OptimizeGraph(config, meta, verbose=False, cluster=_cluster())
    except Exception as e:  # Grappler reports malformed graphs as InvalidArgumentError
        raise MalformedGraphError(f"TensorFlow's optimizer rejected the graph: {first_line(e)}") from None


def runtime_nodes(graph: GraphIR, fetches: Iterable[str], device: str | None = None) -> list[node_def_pb2.NodeDef]:
    """The nodes a session runs for ``fetches`` of ``graph``, unplaced ops on ``device``, after Grappler."""
    placed = with_default_device(graph.to_graph_def(), device or DEFAULT_DEVICE)
    return list(runtime_graph_def(placed, list(fetches)).node)
