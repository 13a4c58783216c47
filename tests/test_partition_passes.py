"""partition and limit_parallelism: structure, same outputs, idempotence, and properties on random DAGs."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tfmem
from passes.limit_parallelism import BARRIER_PREFIX, LimitParallelism
from passes.ordering import STRATEGIES, OrderingProblem, refine
from passes.partition import ORDER_ATTR, PARTITION_ATTR, Partition
from tests.helpers import random_dags, session_run, v1
from tfmem import examples
from tfmem.ir.execution import ExecutionGraph
from tfmem.ir.verify import verify
from tfmem.pipeline import PassContext
from tfmem.sim.analysis import order_footprint


def _ctx(built, threads=8, budget=None):
    return PassContext(tuple(built.fetches), budget, feed_shapes=built.feed_shapes, inter_op_threads=threads)


@pytest.fixture(scope="module")
def wide():
    return examples.wide_branches(branches=4, elems=1 << 14, depth=2)


def test_every_strategy_gives_a_topological_order(wide):
    ir = tfmem.load(wide.graph, wide.feed_shapes)
    eg = ExecutionGraph.build(ir, wide.fetches, wide.feed_shapes)
    problem = OrderingProblem(eg)
    for name, strategy in STRATEGIES.items():
        order = strategy(problem)
        assert sorted(order) == sorted(eg.units), name
        position = {u: i for i, u in enumerate(order)}
        assert all(position[p] < position[u] for u in eg.units for p in problem.preds[u]), name


def test_partition_only_tags(wide):
    ir = tfmem.load(wide.graph, wide.feed_shapes)
    result = Partition().run(ir, _ctx(wide))
    tagged = [n for n in result.graph.nodes if PARTITION_ATTR in n.attrs]
    assert tagged and len(result.graph) == len(ir)
    assert all(a.inputs == b.inputs and a.control_inputs == b.control_inputs
               for a, b in zip(ir.nodes, result.graph.nodes, strict=True))
    assert "wins" in " ".join(result.report.notes)


def test_limit_parallelism_serialises_branches_and_keeps_outputs(wide):
    ir = tfmem.load(wide.graph, wide.feed_shapes)
    ctx = _ctx(wide)
    result = LimitParallelism(k=1).run(Partition().run(ir, ctx).graph, ctx)
    assert result.changed and result.report.control_edges_added > 0
    barriers = [n for n in result.graph.nodes if n.name.startswith(BARRIER_PREFIX)]
    assert barriers and all(n.op == "NoOp" and n.attr_bool("_grappler_do_not_remove") for n in barriers)
    assert not any(PARTITION_ATTR in n.attrs for n in result.graph.nodes)
    verify(result.graph)
    before = session_run(wide.graph, wide.fetches, wide.feeds)
    after = session_run(result.graph.to_graph_def(), wide.fetches, wide.feeds)
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    assert ctx.simulate(result.graph).peak_bytes < ctx.simulate(ir).peak_bytes


def test_optimize_with_both_passes_is_idempotent(wide):
    once = tfmem.optimize(wide.graph, wide.fetches, passes=["partition", "limit_parallelism"],
                          feed_shapes=wide.feed_shapes, inter_op_threads=8)
    lp = next(p for p in once.report.passes if p.name == "limit_parallelism")
    assert lp.details["k"] >= 1 and lp.control_edges_added > 0
    twice = tfmem.optimize(once.graph, wide.fetches, passes=["partition", "limit_parallelism"],
                           feed_shapes=wide.feed_shapes, inter_op_threads=8)
    assert not next(p for p in twice.report.passes if p.name == "limit_parallelism").changed
    # The same ops and edges come back. (Comparing the two reports' simulated peaks would compare two
    # simulations of one graph from differently ordered GraphDefs, whose executor orders may differ.)
    def edges(gd):
        return {(n.name, tuple(sorted(n.input))) for n in gd.node}
    assert edges(twice.graph_def) == edges(once.graph_def)
    assert twice.report.after.peak_bytes < once.report.before.peak_bytes


def test_budget_picks_the_largest_k_that_fits(wide):
    ir = tfmem.load(wide.graph, wide.feed_shapes)
    generous = LimitParallelism().run(Partition().run(ir, _ctx(wide)).graph, _ctx(wide, budget=1 << 40))
    assert not generous.changed  # the unlimited graph already fits: nothing is given up


def _dag_graph(preds, sizes):
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, (max(sizes),), name="x")
        nodes = []
        for i, (ps, size) in enumerate(zip(preds, sizes, strict=True)):
            base = x[:size] * float(i + 1)
            terms = [tf.reduce_sum(nodes[p]) for p in ps]
            nodes.append(tf.math.sin(base + tf.add_n(terms) if terms else base, name=f"n{i}"))
        consumed = {p for ps in preds for p in ps}
        sinks = [f"n{i}:0" for i in range(len(preds)) if i not in consumed]
    feeds = {"x:0": np.random.default_rng(len(preds)).standard_normal(max(sizes)).astype(np.float32)}
    return g, sinks, feeds


@settings(max_examples=24, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_dags(), st.sampled_from([1, 2, 4, "auto"]))
def test_random_dags_stay_acyclic_equal_and_no_worse(dag, k):
    g, sinks, feeds = _dag_graph(*dag)
    shapes = {"x:0": feeds["x:0"].shape}
    ir = tfmem.load(g, shapes)
    ctx = PassContext(tuple(sinks), feed_shapes=shapes, inter_op_threads=4)
    result = LimitParallelism(k=k).run(Partition().run(ir, ctx).graph, ctx)
    verify(result.graph)
    assert nx.is_directed_acyclic_graph(result.graph.nx)
    if k == "auto":  # the chooser never accepts a worse peak; an explicit k is the user's call
        assert ctx.simulate(result.graph, grappler=False).peak_bytes <= ctx.simulate(ir, grappler=False).peak_bytes
    before = session_run(g, sinks, feeds)
    after = session_run(result.graph.to_graph_def(), sinks, feeds)
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))


def test_a_tight_budget_gets_a_limit_that_meets_it(wide):
    ir = Partition().run(tfmem.load(wide.graph, wide.feed_shapes), _ctx(wide)).graph
    unlimited = _ctx(wide).simulate(ir, grappler=False).peak_bytes
    serial = LimitParallelism(k=1).run(ir, _ctx(wide))
    serial_peak = serial.report.details["peak_after"]
    budget = (unlimited + serial_peak) // 2
    result = LimitParallelism().run(ir, _ctx(wide, budget=budget))
    assert result.changed and result.report.details["peak_after"] <= budget


@pytest.mark.parametrize("bad", [0, -2, "fast", 1.5, True])
def test_bad_k_is_refused(bad):
    with pytest.raises(tfmem.BadInputError, match="positive int or 'auto'"):
        LimitParallelism(k=bad)


def test_footprint_of_a_chain_counts_forwarding():
    # x is fed (not counted); s0 gets a new 4 KiB buffer and every later sin writes into its dying input, so
    # one 4 KiB buffer is live throughout; while s0 runs it is being allocated: peak 4 KiB.
    g = tf.Graph()
    with g.as_default():
        h = v1.placeholder(tf.float32, (1024,), name="x")
        for i in range(6):
            h = tf.math.sin(h, name=f"s{i}")
    ir = tfmem.load(g)
    eg = ExecutionGraph.build(ir, ["s5:0"])
    fp = order_footprint(eg, [f"s{i}" for i in range(6)])
    assert fp.alloc == (4096, 0, 0, 0, 0, 0)
    assert fp.peak_bytes == 4096 and fp.slice_bound(0, 6) == 4096


def test_partitions_are_safe_to_run_concurrently(wide):
    ir = tfmem.load(wide.graph, wide.feed_shapes)
    tagged = Partition().run(ir, _ctx(wide)).graph
    eg = ExecutionGraph.build(tagged, wide.fetches, wide.feed_shapes)
    order = sorted(eg.units, key=lambda u: tagged[eg.members[u][0]].attrs[ORDER_ATTR].i)
    part = [tagged[eg.members[u][0]].attrs[PARTITION_ATTR].i for u in order]
    fp = order_footprint(eg, order)
    starts = [i for i in range(len(order)) if i == 0 or part[i] != part[i - 1]]
    assert len(starts) > 1
    for a, b in zip(starts, [*starts[1:], len(order)], strict=True):  # any interleaving stays within the peak
        assert b - a == 1 or fp.slice_bound(a, b) <= fp.peak_bytes


def test_k1_makes_every_allocating_op_wait_for_the_previous_partition(wide):
    ir = tfmem.load(wide.graph, wide.feed_shapes)
    tagged = Partition().run(ir, _ctx(wide)).graph
    eg = ExecutionGraph.build(tagged, wide.fetches, wide.feed_shapes)
    parts: dict[int, list[str]] = {}
    for u in eg.units:
        parts.setdefault(tagged[eg.members[u][0]].attrs[PARTITION_ATTR].i, []).append(u)
    limited = LimitParallelism(k=1).run(tagged, _ctx(wide)).graph
    g = limited.nx
    for i in range(1, len(parts)):
        before = set().union(*(nx.ancestors(g, u) | {u} for u in parts[i - 1]))
        for u in parts[i]:
            if any((s.nbytes or 0) > 0 for s in limited[u].outputs) and limited[u].op not in ("Const", "Identity"):
                assert before <= nx.ancestors(g, u) | set(parts[i]), u  # all of partition i-1 runs first


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_dags())
def test_local_search_keeps_a_topological_order_and_never_raises_the_estimate(dag):
    g, sinks, feeds = _dag_graph(*dag)
    ir = tfmem.load(g, {"x:0": feeds["x:0"].shape})
    problem = OrderingProblem(ExecutionGraph.build(ir, sinks, ["x:0"]))
    start = STRATEGIES["tf_natural"](problem)
    order, fp = refine(problem, start)
    position = {u: i for i, u in enumerate(order)}
    assert sorted(order) == sorted(start)
    assert all(position[p] < position[u] for u in order for p in problem.preds[u])
    assert fp.peak_bytes <= problem.footprints.footprint(start).peak_bytes
