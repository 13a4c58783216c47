"""passes.peak_descent: it lowers a plan's peak by moving what is live there, and keeps every fetched value.

Values are checked in the two-CPU session of ``tests.test_swap_placement`` (``CPU:1`` plays the host).
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from passes import PlacePersistent, SwapActivations
from passes.peak_descent import descend
from passes.planner import fenced
from tests.test_swap_placement import (
    DEVICE,
    HOST,
    _placed,
    _session_run,
    _training_like_graph,
    as_optimize_plans,
    training_like_dags,
)
from tfmem import load
from tfmem.ir.verify import SWAP_IN_ATTR, verify
from tfmem.pipeline import PassContext


def _greedy_plan(graph, ctx):
    """Host placement then swapping, each as far as it goes, fenced: copies come back early, to hide them.

    Planned on the graph ``optimize`` plans, after its exact rewrites (``as_optimize_plans``)."""
    graph = as_optimize_plans(graph, ctx)
    for strategy in (PlacePersistent(), SwapActivations()):
        graph = strategy.run(graph, ctx).graph
    return fenced(graph, ctx)


def test_descent_lowers_a_greedy_plan_and_keeps_the_values():
    """On a WGAN-GP planned greedily for as little as it goes, the copies and activations live at the peak
    move off the device; the graph stays well formed and every fetched value is bit-identical."""
    from models import wgan_gp

    built = wgan_gp.build(batch=128, data_dim=64, hidden=256, layers=3)
    graph = load(built.graph, built.feed_shapes)
    ctx = PassContext(tuple(built.fetches), 1, DEVICE, HOST, dict(built.feed_shapes or {}))
    plan = _greedy_plan(graph, ctx)
    start = ctx.simulate(plan)
    found = descend(plan, ctx, start, judge=lambda g: fenced(g, ctx))
    assert found.moves > 0 and found.profile.peak_bytes < start.peak_bytes
    assert found.profile.peak_bytes == ctx.simulate(found.graph).peak_bytes
    assert found.trials >= found.moves
    verify(found.graph)
    copies = [n for n in found.graph if n.attr_bool(SWAP_IN_ATTR)]
    assert all(n.device == HOST for n in copies)
    fetches = [f for f in built.fetches if ":" in f]
    before = _session_run(_placed(graph.to_graph_def()), fetches, built.feeds)
    after = _session_run(_placed(found.graph.to_graph_def()), fetches, built.feeds)
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))


def test_descent_stops_at_the_budget_and_without_a_host_only_reorders():
    from models import wgan_gp

    built = wgan_gp.build(batch=128, data_dim=64, hidden=256, layers=3)
    graph = load(built.graph, built.feed_shapes)
    utmost = PassContext(tuple(built.fetches), 1, DEVICE, HOST, dict(built.feed_shapes or {}))
    plan = _greedy_plan(graph, utmost)
    start = utmost.simulate(plan)
    roomy = PassContext(tuple(built.fetches), start.peak_bytes, DEVICE, HOST, dict(built.feed_shapes or {}))
    assert descend(plan, roomy, start).moves == 0
    # Without a host, only reordering is left: the peak's op waiting for a tensor's last readers. No copy is
    # added, and the peak does not rise.
    no_host = PassContext(tuple(built.fetches), 1, DEVICE, None, dict(built.feed_shapes or {}))
    found = descend(plan, no_host, start)
    assert {n.name for n in found.graph.nodes} == {n.name for n in plan.nodes}
    assert found.profile.peak_bytes <= start.peak_bytes


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(training_like_dags(), st.sampled_from([0.3, 0.6]))
def test_random_graphs_keep_values_and_the_peak_never_rises(dag, fraction):
    g, fetches, feeds = _training_like_graph(*dag)
    gd = _placed(g)
    shapes = {"x:0": feeds["x:0"].shape}
    ir = load(gd, shapes)
    peak = PassContext(tuple(fetches), None, DEVICE, HOST, shapes).simulate(ir).peak_bytes
    ctx = PassContext(tuple(fetches), int(peak * fraction), DEVICE, HOST, shapes)
    plan = _greedy_plan(ir, ctx)
    start = ctx.simulate(plan)
    found = descend(plan, ctx, start, judge=lambda g: fenced(g, ctx))
    verify(found.graph)
    assert found.profile.peak_bytes <= start.peak_bytes
    before = _session_run(gd, fetches, feeds, init=False)
    after = _session_run(found.graph.to_graph_def(), fetches, feeds, init=False)
    assert np.array_equal(before[0], after[0])


def test_the_peak_op_waits_for_the_last_reader_of_a_tensor_live_beside_it():
    """Two threads run ``large`` beside the ``e``/``c`` chain, so at the peak (``c``) the 8 MiB ``large`` waits
    for its sum; making the peak's op wait for that sum frees ``large`` first. The values stay the same."""
    import tensorflow as tf

    v1 = tf.compat.v1
    n = 1 << 20   # 4 MiB of float32
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, (n,), name="x")
        a = tf.math.sin(x, name="a")
        b = tf.math.cos(a, name="b")
        large = tf.tile(b, [2], name="large")
        c = tf.reduce_sum(tf.math.cos(b, name="e"), name="c")
        r = tf.reduce_sum(tf.multiply(a, c, name="scaled"), name="r")
        out = tf.identity(tf.reduce_sum(large, name="Sum") + r, name="out")
    feeds = {"x:0": np.linspace(-1.0, 1.0, n, dtype=np.float32)}
    gd = _placed(g)
    ir = load(gd, {"x:0": (n,)})
    ctx = PassContext((out.name,), 1, DEVICE, HOST, {"x:0": (n,)}, inter_op_threads=2)
    start = ctx.simulate(ir)
    assert start.peak_unit == "c" and "large:0" in {x.tensor for x in start.live_at_peak}
    found = descend(ir, ctx, start)
    assert found.profile.peak_bytes < start.peak_bytes and "Sum" in found.graph["c"].control_inputs
    verify(found.graph)
    before = _session_run(gd, [out.name], feeds, init=False)
    after = _session_run(found.graph.to_graph_def(), [out.name], feeds, init=False)
    assert np.array_equal(before[0], after[0])
