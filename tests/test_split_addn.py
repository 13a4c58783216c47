"""split_addn: the chain of adds reproduces the AddN kernel's sums bit for bit, and frees inputs early.

Values are compared in real sessions (Grappler on, as users run them), on random sums with random names
(Grappler sorts AddN's inputs by name, so names decide the order) and on a DeepSpeech training step.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import passes.split_addn as split_addn
import tfmem
from models import deepspeech, wgan_gp
from passes.split_addn import SplitAddN, kernel_order_groups
from tests.helpers import DEVICE, HOST, THREADS, placed, session_run, v1, values_equal
from tfmem.ir.editor import DO_NOT_REMOVE
from tfmem.ir.shapes import annotate
from tfmem.optimizer import lower_bound_bytes
from tfmem.pipeline import PassContext
from tfmem.sim.grappler import runtime_graph_def


def _run(graph_def, fetches, feeds=None, steps=1):
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
        init = [op.name for op in g.get_operations()
                if op.type in ("AssignVariableOp", "Assign") and op.name.endswith("/Assign")]
        weights = [op.name + ":0" for op in g.get_operations()
                   if op.type == "VarHandleOp" and "Adam" not in op.name]
    with v1.Session(graph=g) as sess:
        if init:
            sess.run(init)
        out = [sess.run(fetches, feeds) for _ in range(steps)]
        if weights:
            out.append(sess.run([w.replace(":0", "/Read/ReadVariableOp:0") for w in weights]))
        return out


def _sum_graph(values, names, forward_every=0):
    """AddN of placeholders named ``names`` (fed with ``values``), some read through an Identity."""
    g = tf.Graph()
    with g.as_default():
        xs = []
        for i, (v, name) in enumerate(zip(values, names, strict=True)):
            x = v1.placeholder(v.dtype, v.shape, name=name)
            if forward_every and i % forward_every == 0:
                x = tf.identity(x, name=f"{name}_fwd")
            xs.append(x)
        tf.math.add_n(xs, name="total")
    return g.as_graph_def(), {f"{name}:0": v for name, v in zip(names, values, strict=True)}


def _split(graph_def, fetches, feeds=None):
    shapes = {k: v.shape for k, v in (feeds or {}).items()}
    return SplitAddN().run(annotate(graph_def, shapes), PassContext(tuple(fetches), feed_shapes=shapes))


@st.composite
def sums(draw):
    n = draw(st.integers(split_addn.MIN_INPUTS, 40))
    names = draw(st.lists(st.from_regex(r"[a-z][a-z0-9_]{0,6}", fullmatch=True), min_size=n, max_size=n,
                          unique=True))
    seed = draw(st.integers(0, 2**16))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    rng = np.random.default_rng(seed)
    shape = (128, 160)
    values = [(rng.standard_normal(shape) * 10.0 ** rng.integers(-6, 7, shape)).astype(dtype) for _ in range(n)]
    return values, names, draw(st.integers(0, 3))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sums())
def test_random_sums_are_bit_identical(case):
    values, names, forward_every = case
    gd, feeds = _sum_graph(values, names, forward_every)
    result = _split(gd, ["total:0"], feeds)
    assert result.changed, result.report.notes
    assert values_equal(_run(gd, "total:0", feeds), _run(result.graph.to_graph_def(), "total:0", feeds))


def test_the_check_fails_for_any_other_order():
    """The same comparison catches a chain in graph order (not Grappler's sorted order): the test can fail."""
    rng = np.random.default_rng(3)
    names = [f"g{i}" for i in range(23)]
    values = [(rng.standard_normal((128, 160)) * 10.0 ** rng.integers(-6, 7, (128, 160))).astype(np.float32)
              for _ in names]
    gd, feeds = _sum_graph(values, names)
    ir = annotate(gd)
    node = next(n for n in ir.nodes if n.op == "AddN")
    wrong = ir.replace_nodes(tuple(
        n for m in ir.nodes for n in (split_addn._chain(ir, node, ("AddN", tuple(node.inputs))) if m.name == "total" else [m])))
    assert not values_equal(_run(gd, "total:0", feeds), _run(wrong.to_graph_def(), "total:0", feeds))
    right = _split(gd, ["total:0"], feeds).graph
    assert values_equal(_run(gd, "total:0", feeds), _run(right.to_graph_def(), "total:0", feeds))


def test_grappler_keeps_the_chain():
    gd, feeds = _sum_graph([np.ones((128, 160), np.float32)] * 12, [f"x{i}" for i in range(12)])
    new = _split(gd, ["total:0"], feeds).graph
    adds = [n for n in new.nodes if n.name.startswith("total")]
    assert len(adds) == 11 and all(n.op == "AddV2" and n.attr_bool(DO_NOT_REMOVE) for n in adds)
    runtime = runtime_graph_def(new.to_graph_def(), ["total:0"])
    assert sum(n.op == "AddV2" for n in runtime.node) == 11
    assert not any(n.op == "AddN" for n in runtime.node)


def _layer_norm_tail():
    """A layer norm's end as Keras 3 writes it: ``x * s + (-mean * s + beta)``, beta broadcast over rows. Grappler
    folds the tree into ``(x * s + -mean * s) + beta`` only while no inner add has a control edge."""
    rng = np.random.default_rng(5)
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, (256, 64), name="x")
        neg_mean_s = v1.placeholder(tf.float32, (256, 64), name="neg_mean_s")
        beta = v1.placeholder(tf.float32, (64,), name="beta")
        s = v1.placeholder(tf.float32, (256, 64), name="s")
        inner = tf.add(neg_mean_s * s, beta, name="add_1")
        tf.multiply(tf.add(x * s, inner, name="add_2"), 2.0, name="y")   # a fetched root is never folded
        tf.no_op(name="elsewhere")
    feeds = {"x:0": rng.standard_normal((256, 64)).astype(np.float32) * 7.0,
             "s:0": rng.standard_normal((256, 64)).astype(np.float32) * 3.0,
             "neg_mean_s:0": rng.standard_normal((256, 64)).astype(np.float32) * 5.0,
             "beta:0": rng.standard_normal(64).astype(np.float32) * 11.0}
    return g.as_graph_def(), feeds


def test_a_broadcast_add_tree_runs_in_the_order_grappler_folds_it(monkeypatch):
    """Grappler folds a layer norm's tree ``x*s + (-mean*s + beta)`` into ``AddN(-mean*s, x*s) + beta`` (seen on
    Keras 3's LayerNormalization in a training step: tests/test_function.py checks the values there); given that
    runtime form, the chain computes it in that order, which rounds differently from the tree as written."""
    gd, feeds = _layer_norm_tail()
    real = split_addn.runtime_nodes

    def folded(graph, fetches, device=None, config=None):
        nodes = {n.name: n for n in real(graph, fetches, device, config)}
        leaf = v1.NodeDef(name="ArithmeticOptimizer/AddOpsRewrite_Leaf_1_add_2", op="AddN", input=["mul", "mul_1"])
        root = v1.NodeDef(name="ArithmeticOptimizer/AddOpsRewrite_add_2", op="AddV2", input=[leaf.name, "beta"])
        nodes["y"].input[0] = root.name
        return [n for name, n in nodes.items() if name not in ("add_1", "add_2")] + [leaf, root]

    monkeypatch.setattr(split_addn, "runtime_nodes", folded)
    result = _split(gd, ["y:0"], feeds)
    assert result.report.details["split"] == {"add_2": 3}
    x, s, m, beta = (feeds[k] for k in ("x:0", "s:0", "neg_mean_s:0", "beta:0"))
    folded_order = ((m * s + x * s) + beta) * np.float32(2.0)
    written_order = (x * s + (m * s + beta)) * np.float32(2.0)
    assert not np.array_equal(folded_order, written_order)   # the orders round differently: the test can fail
    assert values_equal([folded_order], _run(result.graph.to_graph_def(), "y:0", feeds))
    chain = [n for n in result.graph.nodes if n.name.startswith("add_2")]
    assert len(chain) == 2 and all(n.attr_bool(DO_NOT_REMOVE) for n in chain)
    assert [tuple(n.outputs[0].shape) for n in chain] == [(256, 64), (256, 64)]


@pytest.mark.parametrize("n, sizes", [(4, [4]), (8, [8]), (9, [9]), (10, [2, 8]), (17, [9, 8]), (30, [6, 8, 8, 8])])
def test_kernel_groups(n, sizes):
    groups = kernel_order_groups(n)
    assert [len(g) for g in groups] == sizes
    assert [i for g in groups for i in g] == list(range(n))


def test_half_precision_pairs_and_looped_sums_are_left_alone():
    g = tf.Graph()
    with g.as_default():
        tf.math.add_n([v1.placeholder(tf.float16, (256, 256)) for _ in range(6)], name="half")
        tf.math.add_n([v1.placeholder(tf.float32, (256, 256)) for _ in range(2)], name="pair")
        v1.disable_control_flow_v2()
        try:
            loop = v1.while_loop(lambda i, a: i < 3,
                                 lambda i, a: (i + 1, tf.math.add_n([a * float(k) for k in range(1, 5)])),
                                 [tf.constant(0), tf.zeros((256, 256))], name="loop")
        finally:
            v1.enable_control_flow_v2()
        tf.identity(loop[1], name="looped")
    result = _split(g.as_graph_def(), ["half:0", "pair:0", "looped:0"])
    assert not result.changed


@pytest.mark.slow
def test_moving_passes_keep_the_sums_grappler_folds_bit_identical():
    """WGAN-GP's gradient penalty has add trees that Grappler folds into sorted AddNs; passes that add control
    edges and host copies stopped that folding, and the step differed by 1 ulp (measured) until optimize fixed
    every sum's order first (split_addn runs before any explicit pass list)."""
    built = wgan_gp.build(batch=256, data_dim=512, z_dim=128, hidden=1024, layers=3)  # the size that differed
    gd = placed(built.graph)
    peak = tfmem.simulate(gd, built.fetches, feed_shapes=built.feed_shapes, device=DEVICE, host=HOST,
                          inter_op_threads=THREADS).peak_bytes
    opt = tfmem.optimize(gd, built.fetches, budget=int(peak * 0.7), feed_shapes=built.feed_shapes, device=DEVICE,
                         host=HOST, passes=["partition", "limit_parallelism", "place_persistent"],
                         inter_op_threads=THREADS)
    assert [r.name for r in opt.report.passes][:2] == ["pin_fusions", "split_addn"]
    assert values_equal(session_run(gd, built.fetches, built.feeds), session_run(opt.graph_def, built.fetches,
                                                                             built.feeds))


@pytest.fixture(scope="module")
def rnn():
    return deepspeech.build(seq_len=32, batch=4, freq=16, conv_layers=0, rnn_layers=1, hidden=512, cell="rnn")


def test_a_training_step_is_bit_identical_and_needs_less(rnn):
    gd = rnn.graph.as_graph_def()
    ctx = PassContext(tuple(rnn.fetches), feed_shapes=rnn.feed_shapes)
    ir = annotate(gd, rnn.feed_shapes)
    result = SplitAddN().run(ir, ctx)
    assert result.report.details["split"]
    assert values_equal(_run(gd, rnn.fetches, rnn.feeds, steps=2), _run(result.graph.to_graph_def(), rnn.fetches,
                                                                     rnn.feeds, steps=2))
    before, after = lower_bound_bytes(ir, ctx)[0], lower_bound_bytes(result.graph, ctx)[0]
    assert after < before
    assert ctx.simulate(result.graph).peak_bytes < ctx.simulate(ir).peak_bytes


@pytest.mark.slow
def test_optimize_runs_it_first_and_takes_the_bound_after_it(rnn):
    # Below what it needs on one inter-op thread: a budget the graph meets returns it unchanged, no pass run.
    one = tfmem.simulate(rnn.graph, rnn.fetches, feed_shapes=rnn.feed_shapes, inter_op_threads=1).peak_bytes
    opt = tfmem.optimize(rnn.graph, rnn.fetches, feed_shapes=rnn.feed_shapes, budget=int(0.9 * one))
    split = next(r for r in opt.report.passes if r.name == "split_addn")
    assert split.changed
    assert values_equal(_run(rnn.graph.as_graph_def(), rnn.fetches, rnn.feeds, steps=2),
                  _run(opt.graph_def, rnn.fetches, rnn.feeds, steps=2))
