"""Run TensorFlow's graph optimizer (Grappler) offline, exactly as a ``Session`` would before executing.

A session never executes the GraphDef it is given: Grappler first folds constants, removes identity chains
and control-dependency tuples, fuses ``MatMul+BiasAdd+Relu`` and so on. Those rewrites change which tensors
exist and when ops become ready, so the simulator replays the *optimized* graph. ``runtime_graph_def`` calls
Grappler's meta-optimizer with the session's ``ConfigProto`` on a virtual cluster of this machine's devices.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter, OrderedDict
from collections.abc import Iterable

import tensorflow as tf
from tensorflow.core.framework import graph_pb2, node_def_pb2
from tensorflow.core.protobuf import config_pb2, meta_graph_pb2
from tensorflow.python.grappler import cluster as gcluster
from tensorflow.python.grappler import tf_optimizer

from tfmem.errors import first_line
from tfmem.ir.devices import DEFAULT_DEVICE, with_default_device
from tfmem.ir.graph import GraphIR, TensorRef
from tfmem.ir.shapes import as_shape_only_feed
from tfmem.ir.tags import SHAPED_ARGUMENT_TAG

_CLUSTER: gcluster.Cluster | None = None
_log = logging.getLogger(__name__)
# Grappler's answers for recent (graph, fetches, config), keyed by a digest of the serialized inputs (callers get
# copies): optimize asks for one graph's rewrite several times, and each costs seconds on a large graph.
_ANSWERS: OrderedDict[bytes, graph_pb2.GraphDef | None] = OrderedDict()
_ANSWERS_KEPT = 4
# Grappler rewrites run in this process (seconds each on large graphs): the budget search reports them.
WORK: Counter[str] = Counter()


def grappler_cluster() -> gcluster.Cluster:
    """The process's one Grappler cluster: TensorFlow provisions a single cluster at a time, so every caller of
    Grappler shares it (tfmem.traced inlines functions with it)."""
    return _cluster()


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
    disables the meta-optimizer, and when Grappler fails on the graph: the session then runs the graph as given
    (``grappler_rejects``).

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
    rewritten = _optimized(graph_def, fetches, config)
    return graph_def if rewritten is None else rewritten


def grappler_rejects(graph_def: graph_pb2.GraphDef, fetches: Iterable[str],
                     config: config_pb2.ConfigProto | None = None) -> bool:
    """Whether Grappler fails on ``graph_def``, so that a session runs it without any of its rewrites.

    TensorFlow's session logs the failure ("The graph couldn't be sorted in topological order" on some
    acyclic graphs: a 3-layer MoE Transformer of ``models.moe_transformer``) and executes the graph as given
    (``tests/test_optimize.py::test_graph_grappler_fails_on_runs_as_the_session_runs_it``).
    """
    config = config or config_pb2.ConfigProto()
    if config.graph_options.rewrite_options.disable_meta_optimizer:
        return False
    return _optimized(graph_def, fetches, config) is None


def _optimized(graph_def: graph_pb2.GraphDef, fetches: Iterable[str],
               config: config_pb2.ConfigProto | None) -> graph_pb2.GraphDef | None:
    config = config or config_pb2.ConfigProto()
    if config.graph_options.rewrite_options.disable_meta_optimizer:
        return graph_def
    fetches = list(fetches)
    key = hashlib.sha256(b"\0".join([graph_def.SerializeToString(deterministic=True),
                                      config.SerializeToString(deterministic=True),
                                      *(f.encode() for f in fetches)])).digest()
    if key in _ANSWERS:
        _ANSWERS.move_to_end(key)
    else:
        _ANSWERS[key] = _run_grappler(graph_def, fetches, config)
        while len(_ANSWERS) > _ANSWERS_KEPT:
            _ANSWERS.popitem(last=False)
    answer = _ANSWERS[key]
    if answer is None:
        return None
    copy = graph_pb2.GraphDef()
    copy.CopyFrom(answer)
    return copy


def _shape_arguments(graph_def: graph_pb2.GraphDef) -> None:
    """Give each TF2 function argument (``SHAPED_ARGUMENT_TAG``) a shape Grappler trusts, as the function runtime
    does (``as_shape_only_feed``). A session's feeds (plain placeholders) may take any shape, so Grappler's shape
    inference ignores theirs, and rewrites that need static shapes (an add tree folded into one ``AddN``) then
    happen in a function but not in a session (docs/RESULTS.md, "TensorFlow 2")."""
    names = {n.name for n in graph_def.node}
    defaults = []
    for node in graph_def.node:
        if node.op != "Placeholder" or SHAPED_ARGUMENT_TAG not in node.attr:   # (indexing would add the attr)
            continue
        shape = tf.TensorShape(node.attr["shape"].shape)
        if shape.is_fully_defined():
            defaults.append(as_shape_only_feed(node, shape, names))
    graph_def.node.extend(defaults)


def _run_grappler(graph_def: graph_pb2.GraphDef, fetches: list[str],
                  config: config_pb2.ConfigProto) -> graph_pb2.GraphDef | None:
    WORK["rewrites"] += 1
    meta = meta_graph_pb2.MetaGraphDef()
    meta.graph_def.CopyFrom(graph_def)
    _shape_arguments(meta.graph_def)
    keep = meta.collection_def["train_op"].node_list.value
    for f in fetches:
        keep.append(TensorRef.parse(f).node if ":" in f else f)
    try:
        return tf_optimizer.OptimizeGraph(config, meta, verbose=False, cluster=_cluster())
    except Exception as e:  # Grappler reports what it cannot handle as InvalidArgumentError
        # Malformed graphs (missing inputs, duplicate names) are rejected when they are loaded, and a cycle by
        # the scheduler; what is left is Grappler's own failure, which the session survives.
        _log.info("Grappler failed (%s); the session runs the graph without its rewrites", first_line(e))
        return None


def runtime_nodes(graph: GraphIR, fetches: Iterable[str], device: str | None = None,
                  config: config_pb2.ConfigProto | None = None) -> list[node_def_pb2.NodeDef]:
    """The nodes a session with ``config`` runs for ``fetches`` of ``graph``, unplaced ops on ``device``."""
    placed = with_default_device(graph.to_graph_def(), device or DEFAULT_DEVICE)
    return list(runtime_graph_def(placed, list(fetches), config).node)
