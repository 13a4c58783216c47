"""Code the tests share: a two-device session, graph placement, the rewrites ``optimize`` runs first, training
steps, value comparison, and hypothesis strategies for random graphs.

Values are checked in a local session with two CPU devices: ``DEVICE`` (``CPU:0``) plays the accelerator and
``HOST`` (``CPU:1``) the host, so every transfer a pass inserts is a real cross-device copy. Test modules import
from here, never from each other (tests/test_layers.py checks it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf
from hypothesis import strategies as st
from tensorflow.core.protobuf import config_pb2

from passes import LEADING_REWRITES
from tfmem.ir.graph import GraphIR
from tfmem.pipeline import PassContext, run_pipeline
from tfmem.testbed import initializer_names

v1 = tf.compat.v1
DEVICE = "/job:localhost/replica:0/task:0/device:CPU:0"
HOST = "/job:localhost/replica:0/task:0/device:CPU:1"
THREADS = 2  # the two-device session's inter-op pool: simulate with inter_op_threads=THREADS to match it
MiB = 2**20


def two_device_config(config: config_pb2.ConfigProto | None = None) -> config_pb2.ConfigProto:
    """The session config with ``DEVICE`` and ``HOST`` and ``THREADS`` inter-op threads; ``config``'s graph
    options (e.g. Grappler turned off by ``optimize``) carried over."""
    out = v1.ConfigProto(device_count={"CPU": 2}, inter_op_parallelism_threads=THREADS)
    if config is not None:
        out.graph_options.CopyFrom(config.graph_options)
    return out


def _imported(graph: tf.Graph | Any) -> tf.Graph:
    if isinstance(graph, tf.Graph):
        return graph
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(graph, name="")
    return g


def session_run(graph_def: tf.Graph | Any, fetches: Any, feeds: dict | None = None, init: bool = True) -> Any:
    """Fetch ``fetches`` once in the two-device session, after running the variables' ``*/Assign`` initialisers
    (with ``init``)."""
    g = _imported(graph_def)
    init_ops = [op for op in g.get_operations() if op.type in ("AssignVariableOp", "Assign")
                and op.name.endswith("/Assign")]
    with v1.Session(graph=g, config=two_device_config()) as sess:
        if init and init_ops:
            sess.run(init_ops)
        return sess.run(fetches, feeds)


def train_steps(graph: tf.Graph | Any, fetches: Sequence[str], feeds: dict, config: config_pb2.ConfigProto | None = None,
                steps: int = 3) -> list:
    """The first fetched tensor of each of ``steps`` training steps from freshly initialised variables, in the
    two-device session (``config``'s graph options carried over)."""
    g = _imported(graph)
    ordered = [f for f in fetches if ":" in f] + [f for f in fetches if ":" not in f]
    with v1.Session(graph=g, config=two_device_config(config)) as sess:
        sess.run(initializer_names(g.as_graph_def()))
        return [sess.run(ordered, feeds)[0] for _ in range(steps)]


def placed(graph: tf.Graph | Any, device: str = DEVICE) -> Any:
    """A copy of ``graph``'s GraphDef with every unplaced node on ``device``."""
    gd = graph.as_graph_def() if isinstance(graph, tf.Graph) else graph
    out = v1.GraphDef()
    out.CopyFrom(gd)
    for node in out.node:
        node.device = node.device or device
    return out


def as_optimize_plans(graph: GraphIR, ctx: PassContext) -> GraphIR:
    """``graph`` after the exact rewrites ``optimize`` runs before any pass, for tests that run passes directly.

    Without them a pass's control edges and renamed inputs may change how Grappler fuses kernels and orders
    a sum's terms, and values round differently (on an AVX2 machine, a WGAN-GP's ``gen_loss`` differed in its
    last bit after host placement and swapping; on CI's machine it did not)."""
    return run_pipeline(graph, LEADING_REWRITES, ctx)[0]


def values_equal(a: Any, b: Any) -> bool:
    """Whether two fetched results (arrays, scalars, None, or nested lists of them) are equal bit for bit."""
    if isinstance(a, (list, tuple)):
        return (isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(values_equal(x, y) for x, y in zip(a, b, strict=True)))
    return (a is None and b is None) or np.array_equal(a, b)


# --- hypothesis strategies and the graphs they describe ----------------------------------------------------------

@st.composite
def random_dags(draw: st.DrawFn, max_nodes: int = 12, min_nodes: int = 3, preds: tuple[int, int] = (0, 2),
                sizes: Sequence[int] = (256, 4096, 16384)) -> tuple[list[list[int]], list[int]]:
    """A random DAG as (each node's predecessors, each node's element count): node ``i`` reads between
    ``preds[0]`` and ``preds[1]`` of the nodes before it."""
    n = draw(st.integers(min_nodes, max_nodes))
    fewest, most = preds
    edges = [sorted(draw(st.sets(st.integers(0, i - 1), min_size=min(fewest, i), max_size=most))) if i else []
             for i in range(n)]
    elems = draw(st.lists(st.sampled_from(list(sizes)), min_size=n, max_size=n))
    return edges, elems


@st.composite
def training_like_dags(draw: st.DrawFn, max_layers: int = 6) -> tuple[int, list[int], list[int]]:
    """A forward chain whose activations a backward chain reads again, plus random skip reads."""
    layers = draw(st.integers(2, max_layers))
    sizes = draw(st.lists(st.sampled_from([4096, 16384, 65536]), min_size=layers, max_size=layers))
    skips = draw(st.lists(st.integers(0, layers - 1), max_size=3))
    return layers, sizes, skips


def training_like_graph(layers: int, sizes: Sequence[int], skips: Sequence[int]) -> tuple[tf.Graph, list[str], dict]:
    """The graph a ``training_like_dags`` example describes: (graph, fetches, feeds)."""
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, (max(sizes),), name="x")
        acts = []
        h = x
        for i, size in enumerate(sizes):
            h = tf.math.sin(h[:size] * float(i + 2) if i == 0 else tf.tile(h[:1], [size]) + x[:size], name=f"f{i}")
            acts.append(h)
        back = tf.reduce_sum(h)
        for i in reversed(range(layers)):
            back = tf.reduce_sum(tf.math.cos(acts[i] * back), name=f"b{i}")
        for s in skips:
            back = back + tf.reduce_sum(acts[s])
        out = tf.identity(back, name="out")
    feeds = {"x:0": np.random.default_rng(layers).standard_normal(max(sizes)).astype(np.float32)}
    return g, [out.name], feeds


# --- the testbed --------------------------------------------------------------------------------------------------

def run_on_testbed(budget: int, graph: tf.Graph | Any, built: Any, steps: int, step_timeout_s: float = 120.0,
                   config: config_pb2.ConfigProto | None = None) -> Any:
    """Run ``graph`` (fetches and feeds from ``built``) on a fresh testbed capped at ``budget``, with ``config``
    (``Optimized.config``: its thread pool too): a ``tfmem.testbed.RunResult``. A device server that crashes or a
    phase past its time limit is a failed run (``ending`` ``"crash"`` or ``"timeout"``, the reason in ``error``)."""
    from tfmem.errors import TestbedError
    from tfmem.testbed import RunResult, Testbed

    try:
        with Testbed(budget, step_timeout_s=step_timeout_s) as tb:
            return tb.run(graph, built.fetches, built.feeds, steps=steps, config=config)
    except TestbedError as e:   # a timeout or a crash: ``ending`` says which, never an OOM
        return RunResult.failed(e)
