"""share_constants merges repeated constant computations, bit for bit; the fed tensors' layout bounds the device.

Values are compared in real sessions (Grappler on, as users run them).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tfmem
from passes import LEADING_REWRITES
from passes.share_constants import ShareConstants, shared_constants
from tfmem import examples
from tfmem.ir.editor import GraphEditor
from tfmem.ir.execution import ExecutionGraph
from tfmem.ir.shapes import annotate
from tfmem.optimizer import device_floor_bytes, layout_room
from tfmem.pipeline import PassContext, run_pipeline
from tfmem.sim.bounds import fed_layout_floor, feeds_fit, feeds_floor
from tfmem.testbed import DEVICE, HOST

v1 = tf.compat.v1
MiB = 2**20


def _run(graph_def, fetches, feeds):
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    with v1.Session(graph=g) as sess:
        return sess.run(fetches, feeds)


def _per_step_losses(steps: int, gate: bool, batch: int = 64, width: int = 32):
    """Like an unrolled RNN's loss: a mean per step, whose gradients each build ``1/n`` of the step's shape from
    constants; with ``gate``, each gradient's constants wait for that step's forward op, as a pass's barrier."""
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, (steps, batch, width), name="x")
        w = tf.constant(np.linspace(-1, 1, width * width, dtype=np.float32).reshape(width, width), name="w")
        losses, hs = [], []
        for t in range(steps):
            h = tf.tanh(tf.matmul(x[t], w), name=f"h{t}")
            hs.append(h)
            losses.append(tf.reduce_mean(tf.square(h), name=f"loss{t}"))
        total = tf.add_n(losses, name="total")
        grads = tf.gradients(total, [x], name="grad")
    gd = g.as_graph_def()
    if gate:  # the gradient's constant Tile of step t waits for h_t: Grappler then no longer merges them
        for node in gd.node:
            step = re.search(r"/loss(\d+)_grad/Tile$", node.name)
            if node.op == "Tile" and step:
                node.input.append(f"^h{step.group(1)}")
    x = np.random.default_rng(0).standard_normal((steps, batch, width)).astype(np.float32)
    return gd, ["total:0", grads[0].name], {"x:0": x}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.integers(2, 6), gate=st.booleans())
def test_merged_graph_computes_the_same_values(steps, gate):
    gd, fetches, feeds = _per_step_losses(steps, gate)
    ctx = PassContext(tuple(fetches))
    result = ShareConstants().run(annotate(gd), ctx)
    assert result.changed
    before, after = _run(gd, fetches, feeds), _run(result.graph.to_graph_def(), fetches, feeds)
    for a, b in zip(before, after, strict=True):
        assert np.array_equal(a, b)


def test_readers_of_copies_read_the_first_and_copies_lose_their_readers():
    gd, fetches, _ = _per_step_losses(4, gate=False)
    graph = annotate(gd)
    result = ShareConstants().run(graph, PassContext(tuple(fetches)))
    merged = result.report.details["merged"]
    readers = result.graph.consumers
    assert merged, "the per-step 1/n constants repeat"
    for copy, first in merged.items():
        assert graph[copy].op == graph[first].op
        outputs = [graph[copy].output(i) for i in range(len(graph[copy].outputs))]
        assert not any(readers.get(out) for out in outputs)


def test_fetched_stateful_and_other_device_nodes_are_never_merged_away():
    g = tf.Graph()
    with g.as_default():
        a = tf.fill((128, 128), 2.0, name="a")
        tf.fill((128, 128), 2.0, name="b")                      # fetched: kept
        r1 = tf.random.stateless_uniform((4,), seed=(1, 2), name="r1")
        r2 = tf.random.uniform((4,), seed=1, name="r2")         # stateful: never a constant computation
        r3 = tf.random.uniform((4,), seed=1, name="r3")
        with tf.device("/CPU:1"):
            c = tf.fill((128, 128), 2.0, name="c")              # same value, other device
        _ = tf.add_n([a, c], name="s")
        _ = (r1, r2, r3)
    merged = shared_constants(annotate(g.as_graph_def()), kept=frozenset({"b"}))
    assert "b" not in merged and "c" not in merged
    assert "r2" not in merged and "r3" not in merged
    assert merged.get("a/dims") is None  # the first of each stays
    assert merged.get("b/dims") == "a/dims"  # the inputs of a kept node may still be shared


def test_copies_gated_by_a_pass_would_each_be_held_as_a_constant_merged_first_one_is():
    """A pass's barrier on the loss gradients' ``1/n`` tensors stops Grappler merging them, and the executor folds
    each into a constant held all session (measured on the 24-step unrolled RNN at 30 MiB: 10 of them, 5 MiB). Merged
    before any pass, the one shared tensor is gated once."""
    steps, batch, width = 6, 256, 128
    gd, fetches, _ = _per_step_losses(steps, gate=False, batch=batch, width=width)
    graph = annotate(gd)
    ctx = PassContext(tuple(fetches))

    def barrier(g):  # what limit_parallelism does: each gradient's constant work waits for its step's forward op
        editor = GraphEditor(g)
        for node in g.nodes:
            step = re.search(r"/loss(\d+)_grad/Tile$", node.name)
            if node.op == "Tile":
                editor.add_control_inputs(node.name, [f"h{step.group(1) if step else 0}"])
        return editor.finish()

    copies = ctx.simulate(barrier(graph)).persistent_bytes
    shared = ctx.simulate(barrier(ShareConstants().run(graph, ctx).graph)).persistent_bytes
    assert copies - shared >= (steps - 1) * batch * width * 4


def test_fed_layout_floor_refuses_a_budget_the_feeds_cannot_be_laid_out_in():
    built = examples.unrolled_rnn(steps=12, batch=256, hidden=512, inputs=128)   # x 1.5 MiB, target 6 MiB
    ir = annotate(tfmem.optimizer.with_default_device(built.graph.as_graph_def(), DEVICE), built.feed_shapes)
    ctx = PassContext(tuple(built.fetches), device=DEVICE, host=HOST, feed_shapes=built.feed_shapes)
    ir, _ = run_pipeline(ir, LEADING_REWRITES, ctx)   # the graph optimize takes its bounds on
    floor, why = fed_layout_floor(ExecutionGraph.build(ir, ctx.fetches, ctx.feed_shapes))
    assert (floor, why) == device_floor_bytes(ir, ctx)
    fed = 1.5 * MiB + 6 * MiB
    assert floor > fed + 2 * MiB and "whole free chunk" in why
    budget = int((floor + 4 * MiB) / 0.98) - MiB          # its layout room is just under the floor
    assert layout_room(budget) < floor
    with pytest.raises(tfmem.InfeasibleBudgetError) as err:
        tfmem.optimize(built.graph, built.fetches, budget=budget, feed_shapes=built.feed_shapes,
                       device=DEVICE, host=HOST)
    assert err.value.lower_bound_bytes >= floor - 64 * 1024
    assert "nothing was tried" in str(err.value)


@pytest.mark.parametrize("sizes,unfed", [([6 * MiB, 12 * MiB], 4 * MiB), ([3 * MiB], 5 * MiB),
                                         ([MiB, 2 * MiB, 7 * MiB], 300_000)])
def test_feeds_floor_is_the_boundary(sizes, unfed):
    """Below the floor some order fails; a little above it, every order fits."""
    orders = [sizes, sizes[::-1]]
    floor, _ = feeds_floor(orders, unfed)
    assert not feeds_fit(orders, unfed, floor - 1) and feeds_fit(orders, unfed, floor + 8192)
    assert floor >= sum(sizes) + unfed


def test_device_floor_is_at_least_the_working_set_bound():
    built = examples.unrolled_rnn(steps=6, batch=64, hidden=128, inputs=32)
    ir = annotate(tfmem.optimizer.with_default_device(built.graph.as_graph_def(), DEVICE), built.feed_shapes)
    ctx = PassContext(tuple(built.fetches), device=DEVICE, feed_shapes=built.feed_shapes)
    floor, _ = device_floor_bytes(ir, ctx)
    assert floor >= tfmem.optimizer.lower_bound_bytes(ir, ctx)[0]


def test_a_refusal_names_the_op_whose_working_set_is_the_bound():
    """Where the feeds are tiny beside one op's working set, the bound's reason names that op, not the feeds
    (issue 32: VGG-16's refusal blamed 1.15 MiB of feeds for a 1.15 GiB gradient sum)."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (4,), name="x")
        a = tf.fill((2048, 2048), x[0])
        b = tf.fill((2048, 2048), x[1])
        tf.add_n([a, b], name="total")
    ir = annotate(g.as_graph_def())
    floor, why = fed_layout_floor(ExecutionGraph.build(ir, ("total:0",), {}))
    assert why.startswith("the working set of total (48.00 MiB"), why
    assert 48 * MiB <= floor < 50 * MiB
