"""A ``TensorList`` one loop hands to another can be swapped to the host (``passes.swap_activations``).

An RNN's forward loop keeps every time step's activations in lists for its gradient loop; in a stacked RNN the
first layer's lists wait through the second layer's forward and gradient loops, where the step peaks. The lists
are ``variant`` handles of no size to the shapes, and their loops are single units to the planner, so they
stayed on the device. TensorFlow copies a list between devices item by item (``_Send``/``_Recv`` of a variant,
also across the testbed's gRPC link), so swapping one frees its items. The Keras LSTM case:
``tests/test_function.py``.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import list_ops

from passes.swap_activations import SwapActivations
from tests.helpers import DEVICE, HOST, THREADS, placed, train_steps, values_equal
from tfmem.ir.loading import load
from tfmem.pipeline import PassContext

v1 = tf.compat.v1
ITEM, STEPS = 16384, 32   # 64 KiB items: a 2 MiB list


def _loops() -> tf.Graph:
    """Loop A pushes ``STEPS`` items into a list; a 4 MiB op peaks while it waits; loop C reads it back."""
    g = tf.Graph()
    was_v2 = tf.compat.v1.control_flow_v2_enabled()
    with g.as_default():
        v1.disable_control_flow_v2()
        try:
            x = v1.placeholder(tf.float32, (ITEM,), name="x")
            empty = list_ops.empty_tensor_list(element_shape=(ITEM,), element_dtype=tf.float32)
            _, kept = v1.while_loop(lambda i, _: i < STEPS, lambda i, lst: (
                i + 1, list_ops.tensor_list_push_back(lst, tf.sin(x * tf.cast(i, tf.float32)))),
                [tf.constant(0), empty], name="forward")
            with tf.control_dependencies([kept]):   # after loop A: the list waits through it
                big = tf.reduce_sum(tf.sin(tf.tile(x, [32])), name="big")   # 2 MiB tiled, 2 MiB of sines
            _, total = v1.while_loop(lambda i, _: i < STEPS, lambda i, t: (
                i + 1, t + tf.reduce_sum(list_ops.tensor_list_get_item(kept, i, tf.float32, element_shape=(ITEM,)))),
                [tf.constant(0), big * 0.5], name="backward")   # (the product can start the copy back)
            tf.identity(total, name="loss")
        finally:
            if was_v2:
                v1.enable_control_flow_v2()
    return g


def test_a_list_one_loop_hands_to_another_is_swapped_over_the_peak_between_them_with_the_same_values() -> None:
    graph = _loops()
    ir = load(placed(graph))
    ctx = PassContext(("loss:0",), None, DEVICE, HOST, inter_op_threads=THREADS)
    peak = ctx.simulate(ir).peak_bytes
    target = peak - (1 << 20)   # the list's 2 MiB must go
    ctx = PassContext(("loss:0",), target, DEVICE, HOST, inter_op_threads=THREADS)
    result = SwapActivations().run(ir, ctx)
    assert result.changed, result.report.notes
    swapped = [name for name, *_ in result.report.details["swapped"]]  # type: ignore[attr-defined]
    assert any(name.startswith("forward/Exit") for name in swapped), swapped
    assert ctx.simulate(result.graph).peak_bytes <= target
    feeds = {"x:0": np.linspace(-1, 1, ITEM, dtype=np.float32)}
    assert values_equal(train_steps(graph, ["loss:0"], feeds, steps=1),
                        train_steps(result.graph.to_graph_def(), ["loss:0"], feeds, steps=1))
