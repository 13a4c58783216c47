"""Shapes through loops and TensorLists: LSTM and GRU layers plan without shape errors (issue "TensorFlow 2").

TF2 control flow keeps an RNN's steps in ``variant`` TensorLists, whose element shapes a GraphDef does not carry,
and its loops' carried tensors come out of TensorFlow's shape inference partial. ``tfmem.ir.static_values``
follows both (``tfmem.ir.tensor_lists``); these graphs raised ``UnknownShapeError`` before. ``optimize`` plans a
TF1 graph's functional ``While`` loops lowered to v1 frames, as the session's runtime lowers them
(``tfmem.lowering``): each TF1 case is planned, kept as it is at a roomy budget and trained for three steps next
to the original (the fetched values must be identical), and planned at 0.7x its simulated peak, where a plan
must keep the values too or refuse with a lower bound (one RNN layer's lists are all read inside its own
gradient loop, where the step peaks; the Keras 3 case that plans below its peak: ``tests/test_function.py``).
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from tests.helpers import DEVICE, HOST, THREADS, placed, train_steps, values_equal
from tfmem.errors import InfeasibleBudgetError, UnknownShapeError
from tfmem.ir.graph import TensorRef
from tfmem.ir.shape_arithmetic import evaluate
from tfmem.ir.shapes import annotate, require_known
from tfmem.ir.tensor_lists import ListInfo
from tfmem.testbed import initializer_names

v1 = tf.compat.v1
BATCH, STEPS, FEATURES, UNITS = 256, 16, 32, 256
FETCHES = ["loss:0", "train"]
SHARE = 0.7   # of the simulated peak: the loops are kept whole, and the budget keeps a 4 MiB margin


def _feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"x:0": rng.standard_normal((BATCH, STEPS, FEATURES), dtype=np.float32),
            "y:0": rng.integers(0, 10, BATCH).astype(np.int32)}


FEED_SHAPES = {"x:0": (BATCH, STEPS, FEATURES), "y:0": (BATCH,)}


def _inputs() -> tuple[tf.Tensor, tf.Tensor]:
    """Placeholders whose batch is left open, as a user writes them: ``feed_shapes`` gives it."""
    return (v1.placeholder(tf.float32, (None, STEPS, FEATURES), name="x"),
            v1.placeholder(tf.int32, (None,), name="y"))


def _train(logits: tf.Tensor, y: tf.Tensor) -> None:
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
    v1.train.AdamOptimizer(0.01).minimize(tf.identity(loss, name="loss"), name="train")


def dynamic_rnn_graph() -> tf.Graph:
    """``tf.compat.v1.nn.dynamic_rnn`` over an LSTM cell (a ``While`` with TensorLists), then a dense layer."""
    from tf_keras.api._v1.keras.__internal__.legacy import rnn_cell

    g = tf.Graph()
    with g.as_default():
        v1.set_random_seed(0)
        x, y = _inputs()
        cell = rnn_cell.LSTMCell(UNITS, initializer=v1.glorot_uniform_initializer(seed=1))
        out, _ = v1.nn.dynamic_rnn(cell, x, dtype=tf.float32)
        w = v1.get_variable("w", (UNITS, 10), initializer=v1.glorot_uniform_initializer(seed=2))
        _train(tf.matmul(out[:, -1], w), y)
    return g


def tf_keras_graph(layer: str) -> tf.Graph:
    """Two stacked tf_keras ``LSTM``/``GRU`` layers (the first returns sequences) in a TF1 graph."""
    import tf_keras

    g = tf.Graph()
    with g.as_default():
        tf_keras.utils.set_random_seed(0)
        x, y = _inputs()
        cls = {"lstm": tf_keras.layers.LSTM, "gru": tf_keras.layers.GRU}[layer]
        h = cls(UNITS // 2, return_sequences=True)(x)
        _train(tf_keras.layers.Dense(10)(cls(UNITS // 2)(h)), y)
    return g


def _plan_and_train(graph: tf.Graph) -> None:
    source = placed(graph)
    peak = tfmem.simulate(source, FETCHES, feed_shapes=FEED_SHAPES, device=DEVICE, host=HOST,
                          inter_op_threads=THREADS).peak_bytes
    feeds = _feeds()
    want = train_steps(graph, FETCHES, feeds)
    roomy = tfmem.optimize(source, FETCHES, budget=2 * peak, feed_shapes=FEED_SHAPES, device=DEVICE, host=HOST,
                           inter_op_threads=THREADS)
    ops = {n.op for n in roomy.graph_def.node}
    assert "Exit" in ops and not ops & {"While", "StatelessWhile"}   # the loops as the runtime runs them
    assert values_equal(want, train_steps(roomy.graph, FETCHES, feeds, roomy.config))
    try:
        tight = tfmem.optimize(source, FETCHES, budget=int(peak * SHARE), feed_shapes=FEED_SHAPES, device=DEVICE,
                               host=HOST, inter_op_threads=THREADS)
    except InfeasibleBudgetError as e:   # a plan-level refusal, every size known
        assert 0 < e.lower_bound_bytes <= e.best_peak_bytes
        return
    assert tight.report.after.peak_bytes <= SHARE * peak
    assert values_equal(want, train_steps(tight.graph, FETCHES, feeds, tight.config))


@pytest.mark.timeout(300)
def test_a_dynamic_rnn_lstm_is_planned_and_trains_identically():
    _plan_and_train(dynamic_rnn_graph())


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layer", ["lstm", "gru"])
def test_tf_keras_recurrent_layers_are_planned_and_train_identically(layer):
    _plan_and_train(tf_keras_graph(layer))


@pytest.mark.parametrize("layer", ["lstm", "gru"])
def test_tf_keras_recurrent_layers_simulate_with_every_size_known(layer):
    """The session's step (its While loops lowered) is simulated: it raised UnknownShapeError before."""
    profile = tfmem.simulate(placed(tf_keras_graph(layer)), FETCHES, feed_shapes=FEED_SHAPES, device=DEVICE)
    assert profile.peak_bytes > BATCH * STEPS * UNITS // 2 * 4   # at least the first layer's output sequence


@pytest.mark.xfail(strict=True, raises=UnknownShapeError,
                   reason="BroadcastGradientArgs in the lowered gradient loop of dynamic_rnn stay unknown")
def test_every_tensor_of_a_lowered_lstm_step_has_the_size_it_has_at_run_time():
    """The session's graph (``While`` lowered to frames by Grappler): each tensor tfmem sizes, inside the loops and
    after them, has the shape the step gives it (read from the run's step stats, every iteration alike)."""
    from tfmem.sim.grappler import runtime_graph_def

    graph = dynamic_rnn_graph()
    runtime = runtime_graph_def(placed(graph), FETCHES)
    ir = annotate(runtime, FEED_SHAPES)
    require_known(ir, [TensorRef(n.name, i) for n in ir.nodes for i in range(len(n.outputs))])
    assert any(n.op == "TensorListPopBack" for n in ir.nodes) and any(n.op == "Merge" for n in ir.nodes)
    seen = _run_shapes(runtime)
    checked = 0
    for (name, index), shapes in seen.items():
        if name in ir and ir[name].outputs[index].dtype not in ("variant", "resource"):
            assert shapes == {ir[name].outputs[index].shape}, (name, index, shapes, ir[name].outputs[index])
            checked += 1
    assert checked > 200


def _run_shapes(gd: tf.compat.v1.GraphDef) -> dict[tuple[str, int], set[tuple[int, ...]]]:
    """The shapes each op's outputs had in one traced training step of ``gd``."""
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(gd, name="")
    options = v1.RunOptions(trace_level=v1.RunOptions.FULL_TRACE)
    meta = v1.RunMetadata()
    config = v1.ConfigProto(graph_options=v1.GraphOptions(rewrite_options={"disable_meta_optimizer": True}))
    with v1.Session(graph=g, config=config) as sess:
        sess.run(initializer_names(gd))
        sess.run(FETCHES, _feeds(), options=options, run_metadata=meta)
    out: dict[tuple[str, int], set[tuple[int, ...]]] = {}
    for dev in meta.step_stats.dev_stats:
        for stats in dev.node_stats:
            for output in stats.output:
                dims = tuple(d.size for d in output.tensor_description.shape.dim)
                out.setdefault((stats.node_name, output.slot), set()).add(dims)
    return out


def _v1_loop(grow: bool) -> tf.Graph:
    """A TF1 while loop over a batch-open tensor: ``h`` keeps its shape, or (``grow``) gains a row each step."""
    g = tf.Graph()
    with g.as_default():
        v1.disable_control_flow_v2()
        try:
            x = v1.placeholder(tf.float32, (None, 8), name="x")
            w = tf.ones((8, 8))
            if grow:
                body = lambda i, h: (i + 1, tf.concat([h, h[:1]], 0))  # noqa: E731
                invariants = [tf.TensorShape([]), tf.TensorShape([None, 8])]
            else:
                body = lambda i, h: (i + 1, tf.tanh(tf.matmul(h, w)))  # noqa: E731
                invariants = None
            _, h = v1.while_loop(lambda i, h: i < 4, body, [tf.constant(0), x], shape_invariants=invariants,
                                 name="loop")
            tf.reduce_sum(tf.square(h), name="loss")
        finally:
            v1.enable_control_flow_v2()
    return g


def test_a_loop_carried_tensor_takes_the_shape_its_body_keeps():
    ir = annotate(_v1_loop(grow=False).as_graph_def(), {"x:0": (32, 8)})
    merges = [n for n in ir.nodes if n.op == "Merge" and n.outputs[0].dtype == "float32"]
    assert merges and all(n.outputs[0].shape == (32, 8) for n in merges)
    assert ir.spec("loop/Exit_1:0").shape == (32, 8)
    assert all(s.known for n in ir.nodes for s in n.outputs)


def test_a_tensor_that_grows_in_a_loop_stays_unknown_and_is_named():
    ir = annotate(_v1_loop(grow=True).as_graph_def(), {"x:0": (32, 8)})
    assert ir.spec("loop/Exit_1:0").shape == (None, 8)   # its rows are the trip count's: data, to tfmem
    with pytest.raises(UnknownShapeError, match=r"Square:0 \(\?, 8\)") as caught:
        tfmem.simulate(_v1_loop(grow=True), ["loss:0"], feed_shapes={"x:0": (32, 8)})
    assert "Square:0" in caught.value.tensors


def test_list_info_joins_what_a_loop_puts_in_a_list():
    reserved = ListInfo(tf.TensorShape([None, 32]), None, 12)
    a, b = reserved.with_item(tf.TensorShape([16, 32])), reserved.with_item(tf.TensorShape([8, 32]))
    assert a.element_shape() == tf.TensorShape([16, 32]) and a.length == 12
    assert a.join(b).element_shape().as_list() == [None, 32]
    pushed = ListInfo(tf.TensorShape(None), None, 0).with_item(tf.TensorShape([4]), 1)
    assert pushed.join(ListInfo(tf.TensorShape(None), None, 0)).length is None   # a loop's pushes: length unknown


@pytest.mark.parametrize("s0,s1", [((16, 32), (16, 32)), ((16, 32), (32,)), ((1, 1, 3), (2, 1, 3)),
                                   ((3,), (1, 1, 3)), ((0, 3), (1, 3)), ((1,), ()), ((), ())])
def test_broadcast_gradient_args_are_evaluated_as_tensorflow_does(s0, s1):
    want = tf.raw_ops.BroadcastGradientArgs(s0=np.array(s0, np.int32), s1=np.array(s1, np.int32))
    for i in (0, 1):
        got = evaluate("BroadcastGradientArgs", {}, [np.array(s0, np.int32), np.array(s1, np.int32)], i)
        assert got.tolist() == want[i].numpy().tolist()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layer", ["LSTM", "GRU"])
def test_keras3_recurrent_training_steps_are_planned_with_every_size_known(layer):
    """A Keras 3 ``fit`` step of two stacked recurrent layers, traced as ``MemoryBudget`` traces it: every
    tensor sized (its loops' trip counts read, so every list holds its items), and planned below its peak or
    refused with a lower bound, never a shape error."""
    import keras

    from tfmem.traced import trace

    keras.utils.set_random_seed(0)
    cls = getattr(keras.layers, layer)
    model = keras.Sequential([keras.Input((STEPS, FEATURES)), cls(32, return_sequences=True), cls(32),
                              keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.Adam(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=False)
    model.optimizer.build(model.trainable_variables)
    feeds = _feeds()
    concrete = tf.function(lambda data: model.train_step(data), jit_compile=False).get_concrete_function(
        (tf.constant(feeds["x:0"]), tf.constant(feeds["y:0"])))
    traced = trace(concrete)
    profile = tfmem.unoptimized_profile(traced.graph_def, traced.fetches)
    assert not [n for n in profile.notes if "unknown" in n], profile.notes
    assert profile.peak_bytes > 2 * BATCH * STEPS * 32 * 4   # at least the first layer's output sequence, twice
    try:
        plan = tfmem.optimize(traced.graph_def, traced.fetches, budget=int(0.8 * profile.peak_bytes))
    except InfeasibleBudgetError as e:
        assert 0 < e.lower_bound_bytes <= e.best_peak_bytes
        return
    assert plan.report.after.peak_bytes <= 0.8 * profile.peak_bytes
